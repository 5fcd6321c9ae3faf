"""Where a prefill's time goes: the host issuing CuPy / cuBLAS operations, or the GPU running them.

    python3 bench/prefill_probe.py [--preset llama-3.2-1b] [--lengths 1 32 128 512] --out DIR

For each GEMM mode (tensor: cuBLAS bf16; mma: replicas/prefill_gemm.py) and prompt length it times
Prefill.run three ways: `wall` (call to synchronized end), `host` (the call's return, not waiting for the
GPU) and `gpu` (the stream's busy time: the call is issued behind a 40 ms spin kernel, so every operation
is queued before the GPU reaches them, and events time the queue from the spin's end). wall ≈ host ≫ gpu:
host-bound (launch overhead); wall ≈ gpu: GPU-bound. Then cProfile's top functions of one 32-token run,
the five GEMM shapes of a 40-token prompt alone per mode, and the mma mode's prefill beside a kernel
holding the resident build's SMs (what a join sees). Writes DIR/prefill_probe.json and prints a summary.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SPIN = r"""
extern "C" __global__ void spin(long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while ((long long)(t - t0) < ns);
}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1, 32, 128, 512])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import cupy as cp
    import numpy as np

    from bench.decode import random_tensors
    from replicas.checkpoint import preset_config
    from replicas.concurrency_check import runs_beside
    from replicas.monokernel import MonokernelEngine
    from replicas.monokernel_blas import Blas, load_gemm_mode, use_gemm_mode
    from replicas.monokernel_resident import PREFILL_SMS

    config = preset_config(args.preset)
    eng = MonokernelEngine(config, random_tensors(cp, config), max_context=4096)
    pre = eng._prefill
    spin = cp.RawKernel(SPIN, "spin")
    stream = cp.cuda.get_current_stream()
    rng = np.random.default_rng(7)
    res: dict = {"preset": args.preset, "prefill": [], "gemms": [], "beside": []}

    def timed(ids) -> dict:
        walls, hosts, gpus = [], [], []
        for _ in range(args.reps):
            stream.synchronize()
            t = time.perf_counter()
            pre.run(ids)
            stream.synchronize()
            walls.append((time.perf_counter() - t) * 1e3)
            spin((1,), (32,), (np.int64(40_000_000),))
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(stream)
            t = time.perf_counter()
            pre.run(ids)
            hosts.append((time.perf_counter() - t) * 1e3)
            e1.record(stream)
            e1.synchronize()
            gpus.append(cp.cuda.get_elapsed_time(e0, e1))
        return {"wall_ms": round(statistics.median(walls), 3), "host_ms": round(statistics.median(hosts), 3),
                "gpu_ms": round(statistics.median(gpus), 3)}

    for mode in ("tensor", "mma"):
        load_gemm_mode(cp, mode)
        use_gemm_mode(mode)
        for n in args.lengths:
            ids = rng.integers(0, config.vocab_size, n).tolist()
            pre.run(ids)
            row = {"mode": mode, "tokens": n, **timed(ids)}
            res["prefill"].append(row)
            print(json.dumps(row), flush=True)
    use_gemm_mode("tensor")

    ids = rng.integers(0, config.vocab_size, 32).tolist()
    prof = cProfile.Profile()
    stream.synchronize()
    prof.enable()
    for _ in range(3):
        pre.run(ids)
    stream.synchronize()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
    res["cprofile_32_tokens_x3"] = s.getvalue()
    print(res["cprofile_32_tokens_x3"], flush=True)

    # the five GEMMs of a 40-token prompt, alone (events around 20 launches)
    blas = Blas(cp)
    w = pre.m.weights
    H, I = config.hidden_size, config.intermediate_size
    shapes = {"qkv": (w["w_qkv"][0], H), "o": (w.get("w_o_prefill", w["w_o"])[0], config.q_dim),
              "gate_up": (w.get("w_gu_prefill", w["w_gu"])[0].reshape(2 * I, -1), H),
              "down": (w.get("w_dn_prefill", w["w_dn"])[0], I), "lm_head": (w.get("w_lm_prefill", w["w_lm"]), H)}
    for mode in ("tensor", "mma"):
        use_gemm_mode(mode)
        for name, (mat, k) in shapes.items():
            x = pre.narrow(cp.asarray(rng.standard_normal((40, k), dtype=np.float32)))
            blas.linear(x, mat, k)
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(stream)
            for _ in range(20):
                blas.linear(x, mat, k)
            e1.record(stream)
            e1.synchronize()
            ms = cp.cuda.get_elapsed_time(e0, e1) / 20
            mb = mat.shape[0] * k * 2 / 1e6
            row = {"mode": mode, "gemm": name, "n": int(mat.shape[0]), "k": k, "us": round(ms * 1e3, 1),
                   "weight_GBps": round(mb / ms, 1)}
            res["gemms"].append(row)
            print(json.dumps(row), flush=True)

    # what a join sees: the mma-mode prefill while a kernel holds the resident build's SMs
    use_gemm_mode("mma")
    busy = cp.cuda.Stream(non_blocking=True)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"] - PREFILL_SMS
    for n in (40, 300):
        ids = rng.integers(0, config.vocab_size, n).tolist()
        beside, secs = runs_beside(cp, sms, busy, lambda: (pre.run(ids), stream.synchronize()))
        row = {"mode": "mma", "tokens": n, "held_sms": sms, "beside": beside, "ms": round(secs * 1e3, 2)}
        res["beside"].append(row)
        print(json.dumps(row), flush=True)
    use_gemm_mode("tensor")

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefill_probe.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
