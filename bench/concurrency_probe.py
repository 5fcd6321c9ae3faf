"""Which operations on a second stream wait for a running persistent kernel (issue 9's resident joins).

    python bench/concurrency_probe.py [--out DIR]

A spinning kernel holds `132 - 16` SMs (one block each, like a resident batch build) for SPIN_MS, launched
plainly or cooperatively (as the monokernel is). Meanwhile each operation below is issued on a non-blocking
stream and timed until that stream is done: a time near the spin's remainder means the operation (and
everything after it on that stream) waited for the kernel.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

SPIN_MS = 400
_SPIN = r"""
extern "C" __global__ void spin(long long ns) {
  extern __shared__ float pad[];
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while ((long long)(t - t0) < ns);
  if (threadIdx.x == 9999) pad[0] = 1.f;
}
extern "C" __global__ void smem_user(float* y) {
  extern __shared__ float buf[];
  buf[threadIdx.x] = threadIdx.x;
  __syncthreads();
  y[threadIdx.x] = buf[255 - threadIdx.x];
}
"""


def time_beside(spin, blocks: int, smem: int, busy, stream, op, spin_ms: int = SPIN_MS) -> float:
    """ms from issuing op() on `stream` until that stream is done, while `spin` holds `blocks` SMs (one block
    each: `smem` bytes of shared memory) on the `busy` stream for spin_ms."""
    import numpy as np

    with busy:
        spin((blocks,), (256,), (np.int64(spin_ms * 1_000_000),), shared_mem=smem)
    time.sleep(0.02)  # the spin's blocks are on their SMs
    t = time.perf_counter()
    with stream:
        op()
    stream.synchronize()
    ms = (time.perf_counter() - t) * 1e3
    busy.synchronize()
    return ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import cupy as cp

    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    smem = 200 * 1024
    kernels = {}
    for coop in (False, True):
        k = cp.RawModule(code=_SPIN, enable_cooperative_groups=coop).get_function("spin")
        k.max_dynamic_shared_size_bytes = smem
        kernels[coop] = k
    smem_user = cp.RawModule(code=_SPIN).get_function("smem_user")
    smem_user.max_dynamic_shared_size_bytes = 160 * 1024
    a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    x = cp.random.standard_normal((1024, 1024), dtype=cp.float32)
    y = cp.empty_like(x)
    m1, m2 = cp.random.standard_normal((512, 2048), dtype=cp.float32), cp.random.standard_normal((2048, 512),
                                                                                                   dtype=cp.float32)
    with b:  # load every kernel once before timing
        cp.multiply(x, 2, out=y)
        cp.matmul(m1, m2)
        smem_user((1,), (256,), (y,), shared_mem=160 * 1024)
        cp.asarray(list(range(40)), dtype=cp.int64)
    b.synchronize()
    held = []

    def new_alloc():
        held.append(cp.cuda.runtime.malloc(1 << 28))
        cp.multiply(x, 2, out=y)

    def pinned_alloc():
        held.append(("host", cp.cuda.runtime.hostAlloc(1 << 22, 0)))
        cp.multiply(x, 2, out=y)

    ops = {
        "elementwise kernel": lambda: cp.multiply(x, 2, out=y),
        "memsetAsync": lambda: cp.cuda.runtime.memsetAsync(y.data.ptr, 0, y.nbytes, b.ptr),
        "memcpyAsync D2D": lambda: cp.cuda.runtime.memcpyAsync(y.data.ptr, x.data.ptr, x.nbytes, 3, b.ptr),
        "cupy copy (contiguous)": lambda: x.copy(),
        "cp.asarray(list) H2D": lambda: cp.asarray(list(range(40)), dtype=cp.int64),
        "cublas sgemm": lambda: cp.matmul(m1, m2),
        "kernel with 160 KB smem": lambda: smem_user((1,), (256,), (y,), shared_mem=160 * 1024),
        "cudaMalloc then kernel": new_alloc,
        "cudaHostAlloc then kernel": pinned_alloc,
        "cupy pool empty (new size)": lambda: cp.empty(37_000_003, cp.uint8),
    }
    rows = []

    def record(coop: bool, name: str, op) -> None:
        waited = time_beside(kernels[coop], sms - 16, smem, a, b, op)
        rows.append({"launch": "cooperative" if coop else "plain", "op": name, "ms": round(waited, 2),
                     "waited_for_kernel": waited > SPIN_MS / 2})
        print(json.dumps(rows[-1]), flush=True)

    for coop in (False, True):
        for name, op in ops.items():
            record(coop, name, op)
    # the real prefill (llama-3.2-1b shape, random weights, 40 and 300 tokens) under the same spin
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.decode import random_tensors
    from replicas.checkpoint import preset_config
    from replicas.monokernel import MonokernelEngine

    config = preset_config("llama-3.2-1b")
    eng = MonokernelEngine(config, random_tensors(cp, config), max_context=2048)
    for n in (40, 300):
        with b:
            eng._prefill.run(list(range(n)))
        b.synchronize()
        for coop in (False, True):
            record(coop, f"Prefill.run({n} tokens)", lambda n=n: eng._prefill.run(list(range(n))))
    for h in held:
        if isinstance(h, tuple):
            cp.cuda.runtime.freeHost(h[1])
        else:
            cp.cuda.runtime.free(h)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "concurrency.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
