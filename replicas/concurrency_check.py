"""Does work on one stream run while a persistent kernel holds most of the SMs? (resident joins' premise)

A resident batch launch keeps `num_sms` SMs for as long as slots decode, and a joining request's prefill
must run beside it on the rest. Measured on the H200 (bench/concurrency_probe.py,
bench/gemm_concurrency_probe.py): elementwise kernels, copies, memsets and allocations do run beside a
kernel holding 116 SMs, but a kernel's first launch (its module loading) waits for it, and so do cuBLAS's
bf16 / TF32 tensor-core GEMMs of some shapes (not its fp32 SIMT ones). `runs_beside` tests the real work
once, at engine start, so the engine picks what runs beside its own launches instead of assuming it.
"""

from __future__ import annotations

import functools
import time

import numpy as np

_HOLD = r"""
extern "C" __global__ void mk_hold_sms(const volatile int* stop, long long max_ns) {
  // One block per SM (its dynamic shared memory fills the SM) spins until *stop or max_ns.
  extern __shared__ int pad[];
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (*stop == 0 && (long long)(t - t0) < max_ns);
  if (threadIdx.x == 0 && *stop < -1) pad[0] = 0;  // (keeps the shared memory allocated)
}
"""
@functools.cache
def _hold_kernel(cp):
    k = cp.RawKernel(_HOLD, "mk_hold_sms")
    smem = int(cp.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"])
    k.max_dynamic_shared_size_bytes = smem
    return k, smem


def runs_beside(cp, sms: int, busy_stream, work, max_s: float = 3.0) -> tuple[bool, float]:
    """Hold `sms` SMs (one block each) on `busy_stream`, call work() (which returns once its own stream
    is done), then release them. Returns (whether work finished while the hold still ran, its seconds).
    Call from the thread and stream the work will use later; its kernels should be loaded already."""
    kernel, smem = _hold_kernel(cp)
    stop = cp.ones(1, cp.int32)
    with busy_stream:  # load the hold kernel (a first launch is one of the things that wait)
        kernel((1,), (32,), (stop, np.int64(0)), shared_mem=smem)
    busy_stream.synchronize()
    stop.fill(0)
    cp.cuda.get_current_stream().synchronize()
    with busy_stream:
        kernel((int(sms),), (32,), (stop, np.int64(int(max_s * 1e9))), shared_mem=smem)
    time.sleep(0.005)  # the hold's blocks are on their SMs
    t = time.perf_counter()
    work()
    secs = time.perf_counter() - t
    beside = not busy_stream.done
    cp.cuda.runtime.memsetAsync(stop.data.ptr, 1, 4, cp.cuda.get_current_stream().ptr)
    busy_stream.synchronize()
    return beside, secs
