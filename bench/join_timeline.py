"""Where a join into a busy resident launch spends its time beyond the prefill (issue 9's join target: <= 1 ms).

    python bench/join_timeline.py [--preset llama-3.2-1b] [--batch 8] [--joins 10] [--out DIR]

B - 1 requests decode in a resident launch of the B build (random bf16 weights); then --joins requests of a
32-token prompt join one after another, each a different fraction of a step after the last one ended (as
bench/batch.py's join_cost does). Each join's handover steps are stamped on the host, relative to its submit:
the scheduler picks it (Joiner.start), its row staged, its prefill (synchronized; or, queued by the scheduler from a
captured graph, from its replay to the publication), the hidden state handed over, the admission words published,
the kernel's acknowledgement seen by the scheduler, the first token at the caller. Also where in the running launch's
step the publication landed (since the running slots' last token, in steps) and the same request's stamps on an idle
engine (its launch, first token). Prints one JSON line per join and a summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class Stamps:
    """(perf_counter, label) pairs from every thread; wrap(obj, name, label) stamps a method's entry and exit."""

    def __init__(self):
        self.log: list[tuple[float, str]] = []

    def wrap(self, obj, name: str, label: str, sync=None, when=None) -> None:
        f = getattr(obj, name)

        def stamped(*a, **k):
            t = time.perf_counter()
            r = f(*a, **k)
            if sync is not None:
                sync()
            if when is None or when(r):
                self.log.append((t, f"{label} start"))
                self.log.append((time.perf_counter(), f"{label} end"))
            return r
        setattr(obj, name, stamped)

    def since(self, t0: float, t1: float) -> list[tuple[float, str]]:
        return [(round(1e3 * (t - t0), 3), what) for t, what in sorted(self.log) if t0 <= t <= t1]


def first(tl, label):
    return next((t for t, what in tl if what == label), None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--joins", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import cupy as cp

    from bench.decode import random_tensors
    from replicas.checkpoint import preset_config
    from replicas.engine import SamplingParams
    from replicas.monokernel_batched import BatchedMonokernelEngine

    config = preset_config(args.preset)
    eng = BatchedMonokernelEngine(config, random_tensors(cp, config), batch=args.batch, max_context=2048,
                                  resident=True)
    n_new = 4096 if args.preset == "llama-3.2-1b" else 1024
    summary, joins, idle = probe(eng, config.vocab_size, args.batch, args.joins, n_new,
                                 sync=lambda: cp.cuda.get_current_stream().synchronize())
    summary["preset"] = args.preset
    print(json.dumps(summary), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "join_timeline.json").write_text(json.dumps({"summary": summary, "joins": joins,
                                                                       "idle": idle}, indent=1))
    eng.close()


def probe(eng, vocab_size: int, batch: int, n_joins: int, n_new: int, sync=None):
    """(summary, per-join rows, idle timelines) of n_joins joins into batch - 1 running requests."""
    from replicas.engine import SamplingParams

    st = Stamps()
    for p in eng._prefill:
        st.wrap(p, "run", "prefill", sync=sync)
        if getattr(p, "graphs", None) is not None:  # a join the scheduler queues itself (not waited for here)
            st.wrap(p.graphs, "replay_captured", "replay queued", when=lambda r: r is not None)
    st.wrap(eng.gpu, "stage_join", "stage_join")
    st.wrap(eng.gpu, "hand_over", "hand_over")
    st.wrap(eng.gpu, "launch_single", "launch_single")
    st.wrap(eng.gpu, "launch_slots", "launch_slots")
    st.wrap(eng.gpu.admissions, "publish", "publish")
    st.wrap(eng.gpu.admissions, "settle", "ack seen", when=lambda r: r != 0)
    st.wrap(eng._joiner, "start", "picked")
    drains: list[float] = []
    drain = eng._drain

    def timed_drain(*a, **k):
        t = time.perf_counter()
        drain(*a, **k)
        drains.append(time.perf_counter() - t)
    eng._drain = timed_drain

    ps = [[(100 + 37 * k + i) % vocab_size for i in range(32)] for k in range(batch)]
    prompt = ps[-1]
    two = SamplingParams(max_tokens=2, ignore_eos=True)

    def timed_request():
        t0 = time.perf_counter()
        g = eng.generate(prompt, two)
        next(g)
        t1 = time.perf_counter()
        st.log.append((t1, "first token"))
        list(g)
        return t0, t1

    for _ in range(2):
        timed_request()  # warm
    idle = []
    for _ in range(3):
        t0, t1 = timed_request()
        idle.append(st.since(t0, t1))
    q = SamplingParams(max_tokens=n_new, ignore_eos=True)
    gens = [eng.generate(p, q) for p in ps[:batch - 1]]
    [next(g) for g in gens]
    stamps: list[list[float]] = [[] for _ in gens]

    def consume(g, s):
        for _ in g:
            s.append(time.perf_counter())
    threads = [threading.Thread(target=consume, args=(g, s), daemon=True) for g, s in zip(gens, stamps)]
    for t in threads:
        t.start()
    t_wait = time.perf_counter()
    while len(stamps[0]) < 9 and time.perf_counter() - t_wait < 60:  # (the CPU emulation is slow)
        time.sleep(0.01)
    recent = stamps[0][-9:]
    step = statistics.median(b - a for a, b in zip(recent, recent[1:]))
    joins = []
    for k in range(n_joins):
        time.sleep(step * k / n_joins)
        n_drains = len(drains)
        t0, t1 = timed_request()
        tl = st.since(t0, t1)
        pub = first(tl, "publish end")
        row = {"join": k, "ttft_ms": round(1e3 * (t1 - t0), 3), "timeline_ms": tl,
               "drain_us_p50_max": [round(1e6 * statistics.median(drains[n_drains:]), 1),
                                    round(1e6 * max(drains[n_drains:]), 1)] if len(drains) > n_drains else None}
        if pub is not None:
            tp = t0 + pub / 1e3
            last = max((s for ss in stamps for s in ss if s <= tp), default=None)
            row["publish_phase_steps"] = round((tp - last) / step, 3) if last else None
            ack = first(tl, "ack seen start")
            row["publish_to_ack_ms"] = round(ack - pub, 3) if ack is not None else None
            row["ack_to_token_ms"] = round(tl[-1][0] - ack, 3) if ack is not None else None
            pre = [t for t, what in tl if what.startswith("prefill")]
            queued = first(tl, "replay queued start")
            if len(pre) < 2 and queued is not None:  # queued by the scheduler: replay -> published (an upper bound)
                pre = [queued, pub]
            row["prefill_ms"] = round(pre[-1] - pre[0], 3) if len(pre) >= 2 else None
            row["beyond_prefill_ms"] = round(row["ttft_ms"] - row["prefill_ms"], 3) if row["prefill_ms"] else None
        joins.append(row)
        print(json.dumps(row), flush=True)
    for g in gens:
        g.cancel()
    for t in threads:
        t.join(5)
    for i, tl in enumerate(idle):
        pre = [t for t, what in tl if what.startswith("prefill")]
        print(json.dumps({"idle": i, "ttft_ms": tl[-1][0], "beyond_prefill_ms": round(tl[-1][0] - (pre[-1] - pre[0]), 3),
                          "timeline_ms": tl}), flush=True)
    med = lambda key: round(statistics.median(r[key] for r in joins if r.get(key) is not None), 3)  # noqa: E731
    idle_beyond = statistics.median(tl[-1][0] - (lambda p: p[-1] - p[0])([t for t, w in tl if w.startswith("prefill")])
                                    for tl in idle)
    summary = {"batch": batch, "running": batch - 1, "step_ms": round(1e3 * step, 3),
               "joins": len(joins), "resident_joins": eng.resident_joins,
               "median_ms": {k: med(k) for k in ("ttft_ms", "prefill_ms", "beyond_prefill_ms", "publish_to_ack_ms",
                                                 "ack_to_token_ms")},
               "idle_beyond_prefill_ms": round(idle_beyond, 3),
               "join_beyond_prefill_less_idle_ms": sorted(round(r["beyond_prefill_ms"] - idle_beyond, 3)
                                                          for r in joins if r.get("beyond_prefill_ms") is not None)}
    return summary, joins, idle


if __name__ == "__main__":
    main()
