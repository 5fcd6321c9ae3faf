"""Small-batch decode on one GPU (issue 9): the batched monokernel (replicas/monokernel_batched.py)
with n concurrent requests against the single-sequence engine, in one run, plus the cost of a join.

    python bench/batch.py --presets llama-3.2-1b llama-3.1-8b --builds 8 4 --out DIR

Per preset: copy bandwidth; the B = 1 engine (32-token prompt, --new-tokens greedy, median of --runs);
for each batch build B: n = 1, 2, 4, .. B requests started together: per-request tok/s (first to last
token) and aggregate tok/s; on the largest build, a request joining n - 1 running ones: submit ->
first token vs the same request on an idle engine, and the longest gap the running slots saw.
Random bf16 weights (bench/decode.py). Writes batch.json and batch.md under --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.decode import bench_peer, copy_bandwidth, random_tensors, time_generation  # noqa: E402


def run_together(engine, prompts, n_new: int) -> list[dict]:
    """Start every prompt at once; per request: first/last token times and token count."""
    from replicas.engine import SamplingParams

    gens = [engine.generate(p, SamplingParams(max_tokens=n_new, ignore_eos=True)) for p in prompts]
    t0 = time.perf_counter()
    res = [dict() for _ in gens]

    def consume(g, r):
        stamps = [time.perf_counter() for _ in g]
        r.update(first=stamps[0] - t0, last=stamps[-1] - t0, n=len(stamps),
                 gap=max((b - a for a, b in zip(stamps, stamps[1:])), default=0.0))

    threads = [threading.Thread(target=consume, args=(g, r)) for g, r in zip(gens, res)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return res


def rates(res: list[dict]) -> tuple[float, float]:
    """(median per-request tok/s, aggregate tok/s over the window where every request decodes)."""
    per = [(r["n"] - 1) / (r["last"] - r["first"]) for r in res]
    return statistics.median(per), sum(per)


class _GpuSeconds:
    """A prefill the resident engine's scheduler queued without waiting for it (Joiner.start's captured-graph
    path): its GPU time between two events, read when first used as a number (by then it has run)."""

    def __init__(self, cp):
        self.begin, self.end = cp.cuda.Event(), cp.cuda.Event()
        self.begin.record()
        self._cp = cp

    def __float__(self) -> float:
        self.end.synchronize()
        return self._cp.cuda.get_elapsed_time(self.begin, self.end) / 1e3

    def __add__(self, other):
        return float(self) + other

    __radd__ = __add__


def _time_prefills(engine) -> list:
    """Wrap the engine's per-slot prefills: each call appends (start, seconds) to the returned list (seconds: a
    number, or for a replay the resident scheduler only queued, a _GpuSeconds that sums as one)."""
    try:
        import cupy as cp
        sync = lambda: cp.cuda.get_current_stream().synchronize()  # noqa: E731
    except ImportError:  # a host-only stand-in engine (tests/test_bench_batch_cpu.py)
        sync = lambda: None  # noqa: E731

    log: list = []
    for pre in getattr(engine, "_prefill", []):
        run = pre.run

        def timed(*a, _run=run, **k):
            t = time.perf_counter()
            out = _run(*a, **k)
            # the prefill's stream: the engine's between launches, or a resident engine's prefill stream
            # while its kernel decodes (a device-wide sync would wait for that kernel)
            sync()
            log.append((t, time.perf_counter() - t))
            return out
        pre.run = timed
        graphs = getattr(pre, "graphs", None)
        if graphs is not None and hasattr(graphs, "replay_captured"):
            replay = graphs.replay_captured

            def queued(*a, _replay=replay, **k):
                t, gpu_s = time.perf_counter(), _GpuSeconds(cp)  # (events on the caller's stream)
                out = _replay(*a, **k)
                gpu_s.end.record()
                if out is not None:
                    log.append((t, gpu_s))
                return out
            graphs.replay_captured = queued
    return log


def join_cost(engine, prompt, running_prompts, n_new: int, joins: int = 7) -> dict:
    """Requests joining running ones: submit -> first token, vs idle; the running slots' worst gap. Also
    both TTFTs less the request's own prefill (issue 9 counts the join's cost beyond it: the prefill is
    host-bound and varies run to run by more than the join costs). `joins` joiners, one after another,
    each submitted a different fraction of a step after the last one's end (where in the running launch's
    step a join lands decides how long it waits for the step boundary): median and worst."""
    from replicas.engine import SamplingParams

    prefills = _time_prefills(engine)
    idle_runs = []
    for _ in range(3):
        n0 = len(prefills)
        ttft = time_generation(engine, prompt, 2)[2]
        idle_runs.append((ttft, sum(d for _, d in prefills[n0:])))
    idle = statistics.median(t for t, _ in idle_runs)
    idle_beyond = statistics.median(t - d for t, d in idle_runs)
    q = SamplingParams(max_tokens=n_new, ignore_eos=True)
    gens = [engine.generate(p, q) for p in running_prompts]
    heads = [next(g) for g in gens]  # all running
    stamps = [[] for _ in gens]

    def consume(g, s):
        for _ in g:
            s.append(time.perf_counter())

    threads = [threading.Thread(target=consume, args=(g, s)) for g, s in zip(gens, stamps)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    recent = stamps[0][-9:]
    step_s = statistics.median(b - a for a, b in zip(recent, recent[1:])) if len(recent) > 1 else 1e-3
    t_first_submit = time.perf_counter()
    samples = []  # (ttft, its prefill seconds) per joiner
    for k in range(joins):
        time.sleep(step_s * k / joins)  # offsets spread over a step
        t_submit = time.perf_counter()
        busy = time_generation(engine, prompt, 2)[2]
        samples.append((busy, sum(d for t, d in prefills if t_submit <= t <= t_submit + busy)))
    still_running = all(len(s) < n_new - 1 for s in stamps)
    for t in threads:
        t.join()
    gaps = [max((b - a for a, b in zip(s, s[1:]) if b > t_first_submit - 0.01), default=0.0) for s in stamps]
    # the worst gap's slot: how many tokens reach the host within 0.25 ms after the gap. A kernel that stalled
    # resumes one token a step (burst 1); a host that stalled finds the tokens the kernel kept producing meanwhile
    s = stamps[max(range(len(stamps)), key=lambda i: gaps[i])]
    ends = [j + 1 for j in range(len(s) - 1) if s[j + 1] > t_first_submit - 0.01]  # (the gaps' window)
    end = max(ends, key=lambda j: s[j] - s[j - 1], default=None)
    burst = 0 if end is None else sum(1 for t in s[end:] if t - s[end] <= 0.25e-3)
    del heads
    beyond = sorted(busy - pre - idle_beyond for busy, pre in samples)
    busy_ms = sorted(busy for busy, _ in samples)
    ms = lambda v: round(v * 1e3, 2)  # noqa: E731
    return {"ttft_idle_ms": ms(idle), "ttft_joining_ms": ms(statistics.median(busy_ms)),
            "join_overhead_ms": ms(statistics.median(busy_ms) - idle), "running_slots": len(running_prompts),
            "joins": joins, "running_throughout": still_running, "step_ms": ms(step_s),
            "prefill_idle_ms": ms(idle - idle_beyond),
            "prefill_joining_ms": ms(statistics.median(pre for _, pre in samples)),
            "join_overhead_beyond_prefill_ms": ms(statistics.median(beyond)),
            "join_overhead_beyond_prefill_max_ms": ms(beyond[-1]),
            "join_overhead_beyond_prefill_all_ms": [ms(v) for v in beyond],
            "running_worst_gap_ms": ms(max(gaps)), "running_worst_gap_burst": burst}


PHASES = ["lm_head+sample", "qkv", "attention", "attn+o", "mlp", "down"]


def phase_profile(cp, engine, run, layers: int) -> dict:
    """Block 0's barrier-to-barrier µs per phase (LM head per step, the others per layer-step) of the
    last launch of `run()` (csrc/monokernel.cu prof[])."""
    engine.profile = cp.zeros(13, cp.uint64)
    run()
    prof = cp.asnumpy(engine.profile).astype(float)
    engine.profile = None
    steps = max(prof[6], 1)
    return {nm: round(prof[i] / steps / 1e3 / (1 if i == 0 else layers), 2) for i, nm in enumerate(PHASES) if prof[i]}


def partings(engine, prompts, want, got) -> list[dict]:
    """Where each slot's greedy tokens part between two builds: the step and how far both tokens sit below the
    best logit of `engine`'s teacher-forced row there, relative to the row's largest |logit| (a near tie, as the
    gpu tests' assert_tokens allows, is <= 2e-2; a broken build parts at O(1))."""
    out = []
    for b, (p, w, g) in enumerate(zip(prompts, want, got)):
        j = next((i for i in range(min(len(w), len(g))) if w[i] != g[i]), None)
        if j is None:
            continue
        row = engine.forward_logits(list(p) + list(w[:j]))[-1]
        gap = max(float((row.max() - row[t]) / abs(row).max()) for t in (w[j], g[j]))
        out.append({"slot": b, "step": j, "gap": round(gap, 5)})
    return out


def ab_variants(cp, config, tensors, b: int, variants: list[str], n_new: int, runs: int) -> list[dict]:
    """The B build at full occupancy: default vs each layout variant (bench/decode.py --ab syntax), same
    weights, alternating A B A B; per-request tok/s medians and whether every slot's tokens match."""
    from bench.decode import ab_options
    from replicas.engine import SamplingParams
    from replicas.monokernel_batched import BatchedMonokernelEngine

    ps = [[(100 + 37 * k + i) % config.vocab_size for i in range(32)] for k in range(b)]
    rows = []
    base = BatchedMonokernelEngine(config, tensors, batch=b, max_context=2048)
    for name in variants:
        var = BatchedMonokernelEngine(config, tensors, batch=b, max_context=2048, layout_options=ab_options(name))
        got = {"default": [], name: []}
        toks = {}
        for _ in range(runs):
            for label, eng in (("default", base), (name, var)):
                got[label].append(rates(run_together(eng, ps, n_new))[0])
        for label, eng in (("default", base), (name, var)):
            toks[label] = [list(g) for g in [eng.generate(p, SamplingParams(max_tokens=64, ignore_eos=True)) for p in ps]]
        row = {"batch": b, "variant": name, "default_tok_s": round(statistics.median(got["default"]), 1),
               "variant_tok_s": round(statistics.median(got[name]), 1), "same_tokens": toks["default"] == toks[name],
               "partings": partings(base, ps, toks["default"], toks[name])}
        row["delta"] = round(row["variant_tok_s"] / row["default_tok_s"] - 1, 4)
        print(json.dumps(row), flush=True)
        rows.append(row)
        var.close()
        del var
    base.close()
    return rows


def bench_preset(cp, preset: str, builds: list[int], n_new: int, runs: int, profile: bool = False,
                 variants: list[str] | None = None, sub_builds: bool = True, layout: str = "",
                 resident: bool = False, joins: int = 7) -> dict:
    from replicas.checkpoint import preset_config
    from replicas.monokernel import MonokernelEngine
    from replicas.monokernel_batched import BatchedMonokernelEngine

    config = preset_config(preset)
    tensors = random_tensors(cp, config)
    out = {"preset": preset}
    prompt = list(range(100, 132))
    one = MonokernelEngine(config, tensors, max_context=2048)
    time_generation(one, prompt, 32)
    r1 = [(c - 1) / dt for dt, c, _ in (time_generation(one, prompt, n_new) for _ in range(runs))]
    out["single_tok_s"] = round(statistics.median(r1), 1)
    if profile:
        out["single_phase_us"] = phase_profile(cp, one, lambda: time_generation(one, prompt, n_new), config.num_hidden_layers)
        print(json.dumps({"preset": preset, "single_phase_us": out["single_phase_us"]}), flush=True)
    del one
    cp.get_default_memory_pool().free_all_blocks()
    if variants:  # A/B only: skip the occupancy table
        out["ab"] = ab_variants(cp, config, tensors, max(builds), variants, n_new, runs)
        return out
    out["builds"] = []
    for b in builds:
        from bench.decode import ab_options
        eng = BatchedMonokernelEngine(config, tensors, batch=b, max_context=2048, sub_builds=sub_builds,
                                      layout_options=ab_options(layout) if layout else None, resident=resident)
        ps = [[(100 + 37 * k + i) % config.vocab_size for i in range(32)] for k in range(b)]
        run_together(eng, ps[:1], 32)  # warm-up
        row = {"batch": b, "compile_s": round(eng.gpu.compile_seconds, 1), "ring": eng.gpu.layout.ring_slots,
               "occupancy": {}}
        n = 1
        while n <= b:
            meas = [rates(run_together(eng, ps[:n], n_new)) for _ in range(runs)]
            per = statistics.median(m[0] for m in meas)
            agg = statistics.median(m[1] for m in meas)
            row["occupancy"][n] = {"per_request_tok_s": round(per, 1), "aggregate_tok_s": round(agg, 1),
                                   "per_request_vs_single": round(per / out["single_tok_s"], 3)}
            if profile:
                row["occupancy"][n]["phase_us"] = phase_profile(
                    cp, eng, lambda: run_together(eng, ps[:n], n_new), config.num_hidden_layers)
            print(json.dumps({"preset": preset, "batch": b, "n": n, **row["occupancy"][n]}), flush=True)
            n *= 2
        if b == max(builds) and not profile:
            # resident: b - 1 running on the full build, so the joiner has a free slot in the running launch
            running = ps[:b - 1] if resident else ps[:max(1, b // 2)]
            joins0, launches0 = getattr(eng, "resident_joins", 0), eng.launches
            row["join"] = join_cost(eng, ps[-1], running, 4 * n_new, joins)
            row["join"]["resident_joins"] = getattr(eng, "resident_joins", 0) - joins0
            row["join"]["relaunches"] = eng.launches - launches0
            joiner = getattr(eng, "_joiner", None)
            row["join"]["join_mode"] = joiner.mode if joiner is not None else None
            print(json.dumps({"preset": preset, "batch": b, "join": row["join"]}), flush=True)
        row["launches"] = eng.launches
        row["resident"] = resident
        free, total = cp.cuda.runtime.memGetInfo()  # the engine's whole footprint: weights, KV, builds, graphs
        row["device_used_gb"] = round((total - free) / 1e9, 2)
        eng.close()
        del eng
        cp.get_default_memory_pool().free_all_blocks()
        out["builds"].append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["llama-3.2-1b"])
    ap.add_argument("--builds", nargs="+", type=int, default=[8])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--profile", action="store_true", help="also record the kernel's phase times per occupancy")
    ap.add_argument("--no-sub-builds", dest="sub_builds", action="store_false",
                    help="batched engines without the smaller builds for partial occupancy (sub_builds, on by default)")
    ap.add_argument("--variants", nargs="+", default=[],
                    help="A/B the largest build at full occupancy against these layout variants (bench/decode.py "
                         "--ab syntax, e.g. ao_slots); skips the occupancy table")
    ap.add_argument("--layout", default="",
                    help="layout options of the batched engines in the occupancy table (--ab syntax, e.g. mma or "
                         "mma+ao_slots); the single-sequence row stays the default engine")
    ap.add_argument("--resident", action="store_true",
                    help="resident batched engines (requests join a running launch; batch builds on fewer SMs)")
    ap.add_argument("--peer", action="store_true",
                    help="also time the peer (HF transformers, static cache, batch 1) on each preset in the same run")
    ap.add_argument("--joins", type=int, default=7, help="joiners timed into the largest build (join_cost)")
    args = ap.parse_args()
    if args.joins < 1:
        ap.error("--joins: at least 1")
    if args.resident:  # as a resident replica runs (replicas/monokernel_resident.py): every kernel loaded at start
        from replicas.monokernel_resident import prefer_eager_module_loading
        prefer_eager_module_loading()
    import cupy as cp

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("replicas.prefill_graph").setLevel(logging.INFO)  # the graphs' count, time and pool size

    bw = copy_bandwidth(cp)
    results = {"copy_TBps": round(bw / 1e12, 3), "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
               "presets": []}
    print(json.dumps({"copy_TBps": results["copy_TBps"]}), flush=True)
    for preset in args.presets:
        results["presets"].append(bench_preset(cp, preset, args.builds, args.new_tokens, args.runs, args.profile,
                                               args.variants, args.sub_builds, args.layout, args.resident, args.joins))
        if args.peer:
            cp.get_default_memory_pool().free_all_blocks()
            results["presets"][-1]["peer"] = bench_peer(preset, args.new_tokens, args.runs)
    lines = [f"copy bandwidth {results['copy_TBps']} TB/s; {args.new_tokens} new greedy tokens per request, 32-token prompts"
             + (f"; batched engines with layout {args.layout}" if args.layout else "")
             + ("; resident batched engines" if args.resident else ""),
             "", "| model | build B | requests | per-request tok/s | vs B=1 engine | aggregate tok/s |",
             "|---|---|---|---|---|---|"]
    for pr in results["presets"]:
        lines.append(f"| {pr['preset']} | 1 (single-sequence engine) | 1 | {pr['single_tok_s']} | 1.000 | {pr['single_tok_s']} |")
        if "peer" in pr:
            lines.append(f"| {pr['preset']} | peer: {pr['peer']['peer']}, batch 1 | 1 | {pr['peer']['tok_s']} | | |")
        for ab in pr.get("ab", []):
            lines.append(f"| {pr['preset']} | {ab['batch']} default vs {ab['variant']} | {ab['batch']} | "
                         f"{ab['default_tok_s']} vs {ab['variant_tok_s']} ({ab['delta']:+.1%}, same tokens: "
                         f"{ab['same_tokens']}"
                         + "".join(f"; slot {q['slot']} parts at step {q['step']}, gap {q['gap']}" for q in ab["partings"])
                         + ") | | |")
        for row in pr.get("builds", []):
            for n, o in row["occupancy"].items():
                lines.append(f"| {pr['preset']} | {row['batch']} | {n} | {o['per_request_tok_s']} | "
                             f"{o['per_request_vs_single']} | {o['aggregate_tok_s']} |")
        for row in pr.get("builds", []):
            if "join" in row:
                j = row["join"]
                lines.append("")
                lines.append(f"joins ({pr['preset']}, B={row['batch']}, {j['running_slots']} running): TTFT idle "
                             f"{j['ttft_idle_ms']} ms, joining (median) {j['ttft_joining_ms']} ms (+{j['join_overhead_ms']}; "
                             f"beyond the request's own prefill, {j['prefill_idle_ms']} / {j['prefill_joining_ms']} ms: "
                             f"+{j['join_overhead_beyond_prefill_ms']}, worst "
                             f"+{j['join_overhead_beyond_prefill_max_ms']}; median of {j['joins']} joins, a step "
                             f"{j['step_ms']} ms, running throughout: {j['running_throughout']}), "
                             f"running slots' worst token gap {j['running_worst_gap_ms']} ms "
                             f"({j['running_worst_gap_burst']} tokens within 0.25 ms after it)"
                             + (f"; resident: {j['resident_joins']} joins into the running launch, "
                                f"{j['relaunches']} relaunches, join GEMMs {j.get('join_mode')}"
                                if row.get("resident") else ""))
    md = "\n".join(lines)
    print(md)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "batch.json").write_text(json.dumps(results, indent=1))
        (args.out / "batch.md").write_text(md + "\n")


if __name__ == "__main__":
    main()
