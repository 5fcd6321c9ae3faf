"""Can the monokernel's batch prologues and down atomics get cheaper with thread-block clusters? (issue 9;
csrc/NOTES.md "Batch speed after session 12"). A standalone probe, one GPU, ~1 min:

    python bench/cluster_probe.py [--out DIR]

1. Launch: whether a grid of one 512-thread block per SM (200 KB of shared memory each, as the monokernel) can
   be launched cooperatively *and* in clusters of 2 / 4 (cuLaunchKernelEx with both attributes), whether a
   kernel with `__cluster_dims__(2, 1, 1)` compiled in runs under CuPy's cooperative launch (the monokernel's
   launch path today), and how many clusters fit at once (cuOccupancyMaxActiveClusters): the kernel's grid
   barriers need every block resident.
2. Prologue pattern: every block reads the same n int64 accumulators from L2 (n = hidden x B: 8,192 at 1B B = 4,
   16,384 at B = 8), converts them and stores bf16 in shared memory, then a grid barrier; against clusters whose
   blocks each read 1/c of the vector and store it into every cluster block's shared memory (DSMEM), then a
   cluster barrier. Prediction (session 12's timeline: a B = 4 prologue is ~1.9 µs, bound by L2 bandwidth):
   pairs save ~0.7 µs per prologue at n = 8,192, quads ~1 µs.
3. Down pattern: every block adds n int64 partials to one accumulator (atomics), then a grid barrier; against
   pairs that first sum their partials over DSMEM and then issue n / 2 atomics each. Prediction: pairs save
   ~1.2 µs of the ~2.5 µs the atomics cost at n = 8,192 (session 11's dn_group saved 2.4 µs with 4x fewer
   atomics, then lost it waiting on L2 round trips that DSMEM does not have).
Each figure is block 0's %globaltimer over 200 iterations, less the same loop with the work left out (the
barriers alone). Writes cluster_probe.json under --out.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from replicas.cluster_launch import ExLaunch, function_handle, launch_config  # noqa: E402

THREADS = 512
SMEM = 200 * 1024
ITERS = 200

SOURCE = r"""
#include <cooperative_groups.h>
namespace cg = cooperative_groups;

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t;
}
// The monokernel's barrier shape: a monotonic arrival counter, thread 0 spins (csrc/mk_common.cuh).
__device__ __forceinline__ void grid_barrier(unsigned* count, unsigned& epoch) {
  __syncthreads();
  epoch += gridDim.x;
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(count, 1u);
    while (*(volatile unsigned*)count < epoch) {}
    __threadfence();
  }
  __syncthreads();
}

// mode 0: barriers only; 1: prologue, every block reads all n; 2: prologue, cluster blocks read 1/c each and
// share over DSMEM; 3: n atomics per block; 4: cluster blocks sum partials over DSMEM, then n / c atomics each.
// csize: blocks per cluster (1 = no cluster). out[0] = ns of the timed loop (block 0), out[1] = a checksum.
__device__ __forceinline__ void probe_body(const long long* __restrict__ acc, unsigned long long* __restrict__ sink,
                                           unsigned* count, unsigned long long* out, int n, int mode, int csize,
                                           int iters) {
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned short* s_vec = reinterpret_cast<unsigned short*>(smem);               // [n] bf16
  float* s_part = reinterpret_cast<float*>(smem + 2 * 16384 * sizeof(unsigned short));  // [n] fp32 partials
  __shared__ float s_red[32];
  unsigned epoch = 0;
  float check = 0.f;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = csize > 1 ? (int)cluster.block_rank() : 0;
  grid_barrier(count, epoch);
  const unsigned long long t0 = now_ns();
  for (int it = 0; it < iters; it++) {
    if (mode == 1 || mode == 2) {
      const int c = mode == 2 ? csize : 1, per = n / c, lo = rank * per;
      float ss = 0.f;
      for (int i = lo + threadIdx.x; i < lo + per; i += blockDim.x) {
        const float v = (float)__ldcg(acc + i) * 2.3283064e-10f;
        ss += v * v;
        const unsigned short h = (unsigned short)(__float_as_uint(v) >> 16);
        if (c == 1) s_vec[i] = h;
        else for (int r = 0; r < c; r++) cluster.map_shared_rank(s_vec, r)[i] = h;
      }
      for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      if ((threadIdx.x & 31) == 0) s_red[threadIdx.x >> 5] = ss;
      if (c > 1) cluster.sync(); else __syncthreads();
      check += s_red[0] + (float)s_vec[(it * 97) % n];
    } else if (mode == 3 || mode == 4) {
      const int c = mode == 4 ? csize : 1;
      for (int i = threadIdx.x; i < n; i += blockDim.x) s_part[i] = (float)((i * 31 + blockIdx.x + it) & 1023) * 1e-3f;
      if (c > 1) {
        cluster.sync();  // every block's partials stored
        const int per = n / c, lo = rank * per;
        for (int i = lo + threadIdx.x; i < lo + per; i += blockDim.x) {
          float v = 0.f;
          for (int r = 0; r < c; r++) v += cluster.map_shared_rank(s_part, r)[i];  // in rank order: deterministic
          atomicAdd(sink + i, (unsigned long long)__float2ll_rn(v * 4294967296.f));
        }
        cluster.sync();  // nobody overwrites partials a peer still reads
      } else {
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x)
          atomicAdd(sink + i, (unsigned long long)__float2ll_rn(s_part[i] * 4294967296.f));
      }
    }
    grid_barrier(count, epoch);
  }
  const unsigned long long t1 = now_ns();
  if (blockIdx.x == 0 && threadIdx.x == 0) { out[0] = t1 - t0; out[1] = (unsigned long long)check; }
}

extern "C" __global__ void __launch_bounds__(512, 1)
probe(const long long* __restrict__ acc, unsigned long long* __restrict__ sink, unsigned* count,
      unsigned long long* out, int n, int mode, int csize, int iters) {
  probe_body(acc, sink, count, out, n, mode, csize, iters);
}
// The same with its cluster shape compiled in: launched through CuPy's own cooperative launch (the way the
// monokernel is launched today), which would need no new launch path if the driver accepts it.
extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(512, 1)
probe_cd2(const long long* __restrict__ acc, unsigned long long* __restrict__ sink, unsigned* count,
          unsigned long long* out, int n, int mode, int csize, int iters) {
  probe_body(acc, sink, count, out, n, mode, 2, iters);
}
"""

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    opts = ap.parse_args()
    import cupy as cp
    import numpy as np

    cuda = ctypes.CDLL("libcuda.so.1")
    sms = cp.cuda.Device(0).attributes["MultiProcessorCount"]
    mod = cp.RawModule(code=SOURCE, options=("-std=c++17",), enable_cooperative_groups=True)
    fn = mod.get_function("probe")
    fn.max_dynamic_shared_size_bytes = SMEM
    # clusters of more than 8 blocks are "non-portable"; 2 and 4 need nothing more
    stream = cp.cuda.get_current_stream()
    acc = cp.asarray((cp.random.standard_normal(16384) * 2**32).astype(cp.int64))
    sink = cp.zeros(16384, cp.uint64)
    count = cp.zeros(1, cp.uint32)
    out = cp.zeros(2, cp.uint64)
    res: dict = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "sms": sms, "launch": {}, "us": {}}

    for csize in (2, 4):
        cfg, keep = launch_config(sms, THREADS, SMEM, stream.ptr, True, csize)
        n_clusters = ctypes.c_int(0)
        rc = cuda.cuOccupancyMaxActiveClusters(ctypes.byref(n_clusters), ctypes.c_void_p(function_handle(fn)), ctypes.byref(cfg))
        res["launch"][f"max_active_clusters_{csize}"] = n_clusters.value if rc == 0 else f"error {rc}"

    def args(n: int, mode: int, csize: int, iters: int) -> tuple:
        return (acc, sink, count, out, np.int32(n), np.int32(mode), np.int32(csize), np.int32(iters))

    def launch(n: int, mode: int, csize: int, grid: int, iters: int = ITERS) -> float | str:
        count.fill(0)
        try:
            ExLaunch(fn, cluster=csize)((grid,), (THREADS,), args(n, mode, csize, iters), shared_mem=SMEM)
        except RuntimeError as e:
            return str(e)
        stream.synchronize()
        return float(cp.asnumpy(out)[0]) / iters / 1e3  # us per iteration

    # a compile-time cluster shape through CuPy's cooperative launch (cuLaunchCooperativeKernel), then through
    # cuLaunchKernelEx with the cooperative attribute (MK_CLUSTER_LAUNCH=ex's path)
    cd2 = mod.get_function("probe_cd2")
    cd2.max_dynamic_shared_size_bytes = SMEM
    for name, kernel in (("cupy_cooperative_cluster_dims_2", cd2), ("ex_cooperative_cluster_dims_2", ExLaunch(cd2))):
        try:
            count.fill(0)
            kernel((sms,), (THREADS,), args(8192, 2, 2, 10), shared_mem=SMEM)
            stream.synchronize()
            res["launch"][name] = "ok"
        except Exception as e:  # noqa: BLE001 - the answer is the point
            res["launch"][name] = repr(e)[:300]
    print(json.dumps(res), flush=True)

    for csize in (1, 2, 4):
        grid = sms - sms % csize
        if isinstance(res["launch"].get(f"max_active_clusters_{csize}"), int):
            grid = min(grid, res["launch"][f"max_active_clusters_{csize}"] * csize)
        res["launch"][f"grid_{csize}"] = grid
        ok = launch(8192, 0, csize, grid, 10)
        res["launch"][f"cooperative_cluster_{csize}"] = "ok" if isinstance(ok, float) else ok
        if not isinstance(ok, float):
            continue
        for n in (8192, 16384):
            base = min(launch(n, 0, csize, grid) for _ in range(3))
            res["us"][f"barrier_only c={csize} grid={grid}"] = round(base, 3)
            for mode, name in ((1 if csize == 1 else 2, "prologue"), (3 if csize == 1 else 4, "atomics")):
                t = min(launch(n, mode, csize, grid) for _ in range(3))
                res["us"][f"{name} n={n} c={csize}"] = round(t - base, 3)
        print(json.dumps(res), flush=True)
    print(json.dumps(res, indent=1))
    if opts.out:
        opts.out.mkdir(parents=True, exist_ok=True)
        (opts.out / "cluster_probe.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    sys.exit(main())
