"""Where a resident join's prefill time goes (llama-3.2-1b shape, random weights, B = 4 resident engine).

    python bench/resident_probe.py [--no-warm] [--lengths 40 300 77 1500] [--out DIR]

Three requests decode in the running launch; then requests of the given prompt lengths join one after
another (slot 3 each time). For each join: its prefill's time, its TTFT, and whether it entered the running
launch (resident_joins +1) or needed a relaunch. Also this process's CUDA module loading mode (run with
CUDA_MODULE_LOADING=EAGER for the eager arm) and the engine's build time. --no-warm skips the join
worker's warm-up and GEMM-mode check (Joiner.warm: joins then use cuBLAS's tensor cores) to show what they buy.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _dump_stacks(done, out: list) -> None:
    """After 300 ms (unless the join is done): every thread's stack, innermost frames last."""
    if done.wait(0.3):
        return
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        if ident != threading.get_ident():
            out.append(f"--- {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame)[-8:]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-warm", action="store_true")
    ap.add_argument("--lengths", type=int, nargs="+", default=[40, 300, 77, 1500])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import logging

    import cupy as cp

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    from bench.batch import _time_prefills
    from bench.decode import random_tensors
    from replicas import monokernel_resident
    from replicas.checkpoint import preset_config
    from replicas.engine import SamplingParams
    from replicas.monokernel_batched import BatchedMonokernelEngine

    if args.no_warm:
        monokernel_resident.Joiner.warm = lambda *a, **k: "tensor"  # no check, no warm-up: cuBLAS tensor cores
    config = preset_config("llama-3.2-1b")
    t0 = time.perf_counter()
    eng = BatchedMonokernelEngine(config, random_tensors(cp, config), batch=4, max_context=4096, resident=True)
    build_s = time.perf_counter() - t0
    prefills = _time_prefills(eng)
    rng = __import__("numpy").random.default_rng(5)
    prompt = lambda n: rng.integers(0, config.vocab_size, n).tolist()  # noqa: E731
    running = [eng.generate(prompt(32), SamplingParams(max_tokens=3500, ignore_eos=True)) for _ in range(3)]
    for g in running:
        next(g)
    rows = []
    stacks: list[str] = []
    for n in args.lengths:
        joins, launches = eng.resident_joins, eng.launches
        t = time.perf_counter()
        gen = eng.generate(prompt(n), SamplingParams(max_tokens=4, ignore_eos=True))
        done = threading.Event()
        if not stacks:  # where the threads are 300 ms into the first join (a join's prefill takes ~10-30 ms)
            threading.Thread(target=_dump_stacks, args=(done, stacks), daemon=True).start()
        next(gen)
        done.set()
        ttft = time.perf_counter() - t
        list(gen)
        pre = [d for s, d in prefills if s >= t]
        rows.append({"prompt": n, "ttft_ms": round(ttft * 1e3, 2), "prefill_ms": round(sum(pre) * 1e3, 2),
                     "joined": eng.resident_joins - joins, "relaunches": eng.launches - launches})
        print(json.dumps(rows[-1]), flush=True)
    for g in running:
        g.cancel()
    mode = eng._joiner.mode if eng._joiner is not None else None
    eng.close()
    out = {"module_loading": monokernel_resident.module_loading_mode(), "warm": not args.no_warm,
           "join_mode": mode,
           "build_s": round(build_s, 1), "joins": rows, "stacks_at_300ms": stacks}
    print(json.dumps({k: v for k, v in out.items() if k != "stacks_at_300ms"}))
    print("\n".join(stacks))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
