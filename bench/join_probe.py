"""Where a join's time goes on the batched engine: a timeline of one join (llama-3.2-1b shape, random weights).

    python bench/join_probe.py [--batch 8] [--running 4]

Wraps the engine's handover steps (yield request, launch end, hidden states, prefill, relaunch) with
timestamps and prints them relative to the joiner's submit, then the joiner's first token.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--running", type=int, default=4)
    args = ap.parse_args()
    import cupy as cp

    from bench.decode import random_tensors
    from replicas.checkpoint import preset_config
    from replicas.engine import SamplingParams
    from replicas.monokernel_batched import BatchedMonokernelEngine

    config = preset_config("llama-3.2-1b")
    eng = BatchedMonokernelEngine(config, random_tensors(cp, config), batch=args.batch, max_context=2048)
    log: list[tuple[float, str]] = []

    def wrap(obj, name):
        f = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            r = f(*a, **k)
            log.append((t, f"{name} ({1e3 * (time.perf_counter() - t):.2f} ms)"))
            return r
        setattr(obj, name, timed)

    for n in ("request_yield", "launch_slots", "launch_single", "synchronize", "hidden_state", "exit_state"):
        wrap(eng.gpu, n)
    for n in ("_admit", "_take_joins"):
        wrap(eng, n)
    for p in eng._prefill:
        wrap(p, "run")
    ps = [[(100 + 37 * k + i) % config.vocab_size for i in range(32)] for k in range(args.running + 1)]
    q = SamplingParams(max_tokens=1024, ignore_eos=True)
    for rep in range(2):
        gens = [eng.generate(p, q) for p in ps[:-1]]
        [next(g) for g in gens]
        threads = [threading.Thread(target=lambda g=g: [None for _ in g]) for g in gens]
        for t in threads:
            t.start()
        time.sleep(0.05)
        log.clear()
        t0 = time.perf_counter()
        g = eng.generate(ps[-1], SamplingParams(max_tokens=2, ignore_eos=True))
        next(g)
        t1 = time.perf_counter()
        list(g)
        for t in threads:
            t.join()
        print(json.dumps({"rep": rep, "ttft_ms": round(1e3 * (t1 - t0), 2),
                          "timeline_ms": [(round(1e3 * (t - t0), 2), what) for t, what in sorted(log) if t - t0 < 1.0],
                          "join_latency_ms": round(1e3 * eng.join_latencies[-1], 2)}), flush=True)
    eng.close()


if __name__ == "__main__":
    main()
