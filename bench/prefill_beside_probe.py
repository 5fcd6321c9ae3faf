"""Where a join's prefill spends its time beside a running resident launch, op by op (issue 9: a joiner's TTFT).

    python bench/prefill_beside_probe.py [--tokens 32] [--reps 5] [--out DIR]
    MK_PREFILL_FUSED=0 python bench/prefill_beside_probe.py ...  (the unfused norm / RoPE / KV-store passes)

Session 17 measured a 32-token join prefill at ~9 ms beside a resident B = 8 launch of llama-3.2-1b (7 running)
against 1.65 ms on an idle GPU, and split-K for its narrow GEMMs won only ~0.8 ms of that. The hypothesis
(csrc/NOTES.md "Joins after session 17"): with the launch keeping ~26 MB in flight, every small kernel pays several
~6 us memory round trips, and the prefill is ~450 kernels. This probe tells which ops hold it: one free slot's
Prefill.forward runs eagerly in the joins' GEMM mode on the prefill stream, with CUDA events around each of its
ops (inclusive times: a linear includes its input's narrowing), beside 7 running requests and then on the idle GPU;
also the whole forward and the captured graph's replay, both ways. Random bf16 weights (bench/decode.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

OPS = ("_linear", "_linear_add", "_rms", "_rms_bits", "_attention", "_rope_at", "_rope_bits", "_store_kv",
       "_store_kv_f32", "_silu_up", "narrow", "_f32")


def instrument(cp, pre, spans: list) -> None:
    """Wrap pre's ops (instance attributes) so each call records (name, begin event, end event) on the
    current stream."""
    for name in OPS:
        f = getattr(pre, name, None)
        if f is None:
            continue

        def timed(*a, _f=f, _name=name, **k):
            begin, end = cp.cuda.Event(), cp.cuda.Event()
            begin.record()
            out = _f(*a, **k)
            end.record()
            spans.append((_name, begin, end))
            return out
        setattr(pre, name, timed)


def forward_once(cp, pre, ids, spans: list) -> float:
    """One eager forward of ids at position 0 (rows = len(ids)); returns its GPU ms, spans filled."""
    from replicas.monokernel_prefill import Positions

    begin, end = cp.cuda.Event(), cp.cuda.Event()
    ids_d = cp.asarray(ids, dtype=cp.int64)
    begin.record()
    pre.forward(ids_d, Positions(0, len(ids), len(ids)))
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(begin, end)


def per_op(cp, spans) -> dict:
    """{op: [calls, total ms]} from finished spans."""
    out = defaultdict(lambda: [0, 0.0])
    for name, b, e in spans:
        out[name][0] += 1
        out[name][1] += cp.cuda.get_elapsed_time(b, e)
    return {k: [v[0], round(v[1], 3)] for k, v in sorted(out.items(), key=lambda kv: -kv[1][1])}


def measure(cp, eng, slot: int, ids, reps: int, tokens_seen=None) -> dict:
    """In a thread of its own (the joins' GEMM mode is per thread), on the prefill stream: per-op times of
    `reps` eager forwards (the median rep's), the forward's and the graph replay's GPU ms. tokens_seen (a
    callable: the running requests' tokens so far): also their tokens/s over a quiet window and over a
    window of back-to-back replays (what a join's prefill costs the requests already running)."""
    from replicas.monokernel_blas import use_gemm_mode

    pre, gpu, res = eng._prefill[slot], eng.gpu, {}

    def run():
        use_gemm_mode(eng._joiner.mode or "tensor")
        with cp.cuda.Device(gpu.device), gpu.prefill_stream:
            reps_out = []
            saved = {name: pre.__dict__[name] for name in OPS if name in pre.__dict__}  # (narrow: an attribute)
            for _ in range(reps):
                spans: list = []
                instrument(cp, pre, spans)
                total = forward_once(cp, pre, ids, spans)
                for name in OPS:  # back to what they were
                    pre.__dict__.pop(name, None)
                pre.__dict__.update(saved)
                reps_out.append((total, spans))
            reps_out.sort(key=lambda r: r[0])
            total, spans = reps_out[len(reps_out) // 2]
            res["forward_ms"] = round(total, 3)
            res["kernels_wrapped"] = len(spans)
            res["ops"] = per_op(cp, spans)
            graph_ms = []
            for _ in range(reps):
                b, e = cp.cuda.Event(), cp.cuda.Event()
                b.record()
                pre.run(ids)
                e.record()
                e.synchronize()
                graph_ms.append(cp.cuda.get_elapsed_time(b, e))
            res["graph_replay_ms"] = round(statistics.median(graph_ms), 3)
            if tokens_seen is not None:
                t0, n0 = time.perf_counter(), tokens_seen()
                time.sleep(0.2)
                t1, n1 = time.perf_counter(), tokens_seen()
                for _ in range(20):
                    pre.run(ids)
                cp.cuda.get_current_stream().synchronize()
                t2, n2 = time.perf_counter(), tokens_seen()
                res["running_tok_s_quiet"] = round((n1 - n0) / (t1 - t0), 1)
                res["running_tok_s_during_replays"] = round((n2 - n1) / (t2 - t1), 1)
    t = threading.Thread(target=run)
    t.start()
    t.join()
    return res


class Running:
    """llama-3.2-1b (random weights) in a resident B = 8 engine with `n` requests decoding (slots 0..n-1), each drained
    by a thread of its own; seen() counts their tokens so far, stop() cancels them."""

    def __init__(self, cp, n: int = 7, max_tokens: int = 8192):
        from bench.decode import random_tensors
        from replicas.checkpoint import preset_config
        from replicas.engine import SamplingParams
        from replicas.monokernel_batched import BatchedMonokernelEngine

        self.config = config = preset_config("llama-3.2-1b")
        self.eng = BatchedMonokernelEngine(config, random_tensors(cp, config), batch=8, max_context=2048,
                                           resident=True)
        prompts = [[(100 + 37 * k + i) % config.vocab_size for i in range(32)] for k in range(n)]
        self.gens = [self.eng.generate(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
        for g in self.gens:
            next(g)
        self.tokens = [0] * n  # per request (one writer each)
        self.threads = [threading.Thread(target=self._drain, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()
        time.sleep(0.05)

    def _drain(self, i: int) -> None:
        for _ in self.gens[i]:
            self.tokens[i] += 1

    def seen(self) -> int:
        return sum(self.tokens)

    def stop(self) -> None:
        for g in self.gens:
            g.cancel()
        for t in self.threads:
            t.join(10)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import cupy as cp

    run = Running(cp, max_tokens=4096)
    eng = run.eng
    ids = [(7 + 13 * i) % run.config.vocab_size for i in range(args.tokens)]
    out = {"tokens": args.tokens, "join_mode": eng._joiner.mode if eng._joiner else None, "running": len(run.gens),
           "fused": eng._prefill[7].fused}
    launches = eng.launches
    out["beside"] = measure(cp, eng, 7, ids, args.reps, run.seen)  # slot 7: free while 0..6 decode
    # the same launch ran throughout (no relaunch) and still runs
    out["beside"]["one_launch_throughout"] = eng.launches == launches and bool(eng._resident_launch)
    run.stop()
    time.sleep(0.1)
    out["idle"] = measure(cp, eng, 7, ids, args.reps)
    print(json.dumps(out, indent=1), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "prefill_beside.json").write_text(json.dumps(out, indent=1))
    eng.close()


if __name__ == "__main__":
    main()
