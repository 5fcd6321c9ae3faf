"""Weight-stream shares per block, by measured SM speed (layout option `sm_shares`).

On the H200 the timeline probe (bench/timeline_probe.py) found 24 of the 132 SMs streaming ~25% faster
than the rest under full load (LM head 86 vs 111 µs per step; gate/up + down 16.0 vs 19.8 µs per layer),
the same SMs in every phase and launch. With equal shares those blocks wait at every barrier. With
`sm_shares` the LM head rows and the fused MLP's gate/up units (and so each block's h slice and down
columns) are dealt in proportion to integer weights w_b, one per block:

    share_w = prefix sums of the weights, rescaled to [0, ..., TOTAL]   (int32, num_sms + 1; p.share_w)
    block b's units of a matrix with U units: [U * share_w[b] // TOTAL, U * share_w[b + 1] // TOTAL)

(csrc/mk_stream.cuh mat_range / block_units mirror `block_units` here). The weights come from
`measure_block_times`, a short streaming kernel run at engine start, snapped to two classes (fast /
the rest) with the speed ratio rounded to 1/8, so the shares do not follow measurement noise.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

TOTAL = 65536    # the table's last entry (csrc/mk_stream.cuh kShareTotal: the kernel divides by a constant)
UNIT = 32        # the weight of a block of median speed
MAX_RATIO = 1.5  # no block gets more than 1.5x the mean share (the h slice's shared memory is sized for it)
FAST = 0.92      # a block at most this fraction of the median time is in the fast class


class ShareError(ValueError):
    """A share table that does not fit the layout."""


def normalised(weights: Sequence[int]) -> tuple[int, ...]:
    """The prefix table of integer weights, rescaled so that it ends at TOTAL."""
    cum = np.concatenate([[0], np.cumsum(np.asarray(weights, np.int64))])
    return tuple(int(v) for v in (cum * TOTAL + cum[-1] // 2) // cum[-1])


def uniform(num_sms: int) -> tuple[int, ...]:
    return normalised([1] * num_sms)


def block_units(units: int, prefix: Sequence[int], b: int) -> tuple[int, int]:
    """Block b's unit range [u0, u1) of a matrix with `units` units (the kernel's formula)."""
    return units * prefix[b] // TOTAL, units * prefix[b + 1] // TOTAL


def max_slice(units: int, num_sms: int) -> int:
    """The most units one block may own under any accepted table (sizes the h slice in shared memory)."""
    return -(-units * 3 // (2 * num_sms)) + 1


def check(prefix: Sequence[int], num_sms: int, units: int | None = None) -> tuple[int, ...]:
    """`prefix` as a tuple, or ShareError saying what is wrong with it."""
    p = tuple(int(v) for v in prefix)
    if len(p) != num_sms + 1 or p[0] != 0 or p[-1] != TOTAL:
        raise ShareError(f"share_prefix needs {num_sms + 1} entries from 0 to {TOTAL} (one weight per block of the "
                         f"{num_sms}-block grid; sm_shares.normalised), got {len(p)}"
                         + ("" if not p else f" from {p[0]} to {p[-1]}"))
    w = np.diff(p)
    if (w <= 0).any():
        raise ShareError(f"share_prefix must grow strictly (every block streams something); block {int(np.argmin(w))} "
                         f"has weight {int(w.min())}")
    if w.max() * num_sms > MAX_RATIO * p[-1]:
        raise ShareError(f"block {int(np.argmax(w))} has {w.max() * num_sms / p[-1]:.2f}x the mean share; at most "
                         f"{MAX_RATIO}x fits the shared memory sized for it")
    if units is not None:
        big = max(block_units(units, p, b)[1] - block_units(units, p, b)[0] for b in range(num_sms))
        if big > max_slice(units, num_sms):
            raise ShareError(f"a block would own {big} of {units} units, more than {max_slice(units, num_sms)}")
    return p


def weights_from_times(times: Sequence[float]) -> tuple[int, ...]:
    """Prefix table from per-block streaming times: blocks faster than FAST x the median form one class
    whose weight is UNIT x (median time of the rest / median time of the class), rounded to UNIT/8."""
    t = np.asarray(times, np.float64)
    if t.ndim != 1 or len(t) == 0 or not np.isfinite(t).all() or (t <= 0).any():
        raise ShareError(f"need one positive time per block, got {t!r}")
    med = float(np.median(t))
    fast = t <= FAST * med
    w = np.full(len(t), UNIT, np.int64)
    if fast.any() and (~fast).any():
        ratio = float(np.median(t[~fast]) / np.median(t[fast]))
        w[fast] = int(round(UNIT * min(ratio, MAX_RATIO) * 8 / UNIT)) * UNIT // 8
    while w.max() * len(w) > MAX_RATIO * w.sum():  # (many fast blocks: the mean rises, so this rarely runs)
        w[w == w.max()] -= UNIT // 8
    return normalised(w)


_PROBE = r"""
extern "C" __global__ void __launch_bounds__(%(threads)d, 1)
sm_probe(const uint4* __restrict__ src, long long per_block, unsigned long long* out) {
  extern __shared__ uint4 smem_probe[];
  const uint4* base = src + (long long)blockIdx.x * per_block;
  unsigned x = 0;
  __syncthreads();
  unsigned long long t0, t1;
  asm volatile("mov.u64 %%0, %%%%globaltimer;" : "=l"(t0));
  for (long long i = threadIdx.x; i < per_block; i += %(threads)d * 8) {
    uint4 v[8];
#pragma unroll
    for (int k = 0; k < 8; k++) {
      const long long j = i + (long long)k * %(threads)d;
      v[k] = j < per_block ? __ldcs(base + j) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int k = 0; k < 8; k++) x ^= v[k].x + v[k].w;
  }
  __syncthreads();
  asm volatile("mov.u64 %%0, %%%%globaltimer;" : "=l"(t1));
  if (threadIdx.x == 0) out[blockIdx.x] = t1 - t0;
  if (x == 0x9e3779b9u) smem_probe[0].x = x;  // keeps the loads
}
"""


# The weight stream's own pattern (csrc/mk_stream.cuh): each warp walks its contiguous run through a ring of
# `ring` 512-byte slots of cp.async loads in shared memory (~200 KB in flight per SM). The plain-load probe
# above (64 KB in flight per SM) did not see the monokernel's fast SMs on the H200: it found every second
# block faster instead, so the weights followed the wrong blocks (RESULTS.md, session 6).
_RING_PROBE = r"""
extern "C" __global__ void __launch_bounds__(%(threads)d, 1)
sm_ring_probe(const uint4* __restrict__ src, long long per_warp, unsigned long long* out) {
  extern __shared__ uint4 ring_all[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint4* ring = ring_all + warp * %(ring)d * 32;
  const uint4* p = src + ((long long)blockIdx.x * %(warps)d + warp) * per_warp * 32 + lane;
  __syncthreads();
  unsigned long long t0, t1;
  asm volatile("mov.u64 %%0, %%%%globaltimer;" : "=l"(t0));
  for (int s = 0; s < %(ring)d; s++) {
    unsigned d = (unsigned)__cvta_generic_to_shared(ring + s * 32 + lane);
    asm volatile("cp.async.cg.shared.global [%%0], [%%1], 16;\n" ::"r"(d), "l"(p + (long long)s * 32) : "memory");
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  }
  unsigned x = 0;
  int slot = 0;
  for (long long c = 0; c < per_warp; c++) {
    asm volatile("cp.async.wait_group %%0;\n" ::"n"(%(ring)d - 1) : "memory");
    x ^= ring[slot * 32 + lane].x;
    const long long nc = c + %(ring)d;
    if (nc < per_warp) {
      unsigned d = (unsigned)__cvta_generic_to_shared(ring + slot * 32 + lane);
      asm volatile("cp.async.cg.shared.global [%%0], [%%1], 16;\n" ::"r"(d), "l"(p + nc * 32) : "memory");
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    slot = slot + 1 == %(ring)d ? 0 : slot + 1;
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  __syncthreads();
  asm volatile("mov.u64 %%0, %%%%globaltimer;" : "=l"(t1));
  if (threadIdx.x == 0) out[blockIdx.x] = t1 - t0;
  if (x == 0x9e3779b9u) ring_all[0].y = x;  // keeps the loads
}
"""


def measure_block_times(cp, num_sms: int, threads: int, smem_bytes: int, per_block_bytes: int = 4 << 20,
                        reps: int = 7, ring: int = 24, kind: str = "ring") -> np.ndarray:
    """Median ns each block of a `num_sms`-block grid (one block per SM: `smem_bytes` of shared memory
    each, as the monokernel) takes to stream its own `per_block_bytes` while every other block does the
    same: the per-SM bandwidth under full load, by block index (block -> SM placement was the same
    across launches on the H200: bench/timeline_probe.py). kind "ring": the weight stream's cp.async
    ring of `ring` slots per warp; "loads": plain 16-byte loads, 8 per thread in flight."""
    warps = threads // 32
    per_warp = per_block_bytes // (512 * warps)  # 512-byte chunks per warp
    per_block = per_warp * warps * 32  # uint4 per block
    if kind == "ring":
        ring = max(1, min(ring, smem_bytes // (512 * warps)))
        kernel = cp.RawKernel(_RING_PROBE % {"threads": threads, "ring": ring, "warps": warps}, "sm_ring_probe",
                              options=("-std=c++17",))
        arg = per_warp
    elif kind == "loads":
        kernel = cp.RawKernel(_PROBE % {"threads": threads}, "sm_probe", options=("-std=c++17",))
        arg = per_block
    else:
        raise ValueError(f"kind={kind!r}: 'ring' or 'loads'")
    kernel.max_dynamic_shared_size_bytes = smem_bytes
    src = cp.ones(num_sms * per_block * 4, cp.uint32)
    out = cp.zeros((reps, num_sms), cp.uint64)
    for r in range(-1, reps):  # one warm-up launch
        kernel((num_sms,), (threads,), (src, np.int64(arg), out[max(r, 0)]), shared_mem=smem_bytes)
    cp.cuda.Device().synchronize()
    times = np.median(cp.asnumpy(out).astype(np.float64), axis=0)
    del src, out
    return times


def with_measured_shares(cp, lay):
    """`lay` with its share table measured on the current device (sm_shares layouts without one), or with
    equal shares (and a warning) if the measurement gives no usable table."""
    import dataclasses
    import warnings

    if not lay.sm_shares or lay.share_prefix:
        return lay
    try:
        times = measure_block_times(cp, lay.num_sms, lay.threads, lay.smem_bytes, ring=lay.ring_slots)
        prefix = check(weights_from_times(times), lay.num_sms, lay.inter)
    except (ShareError, cp.cuda.runtime.CUDARuntimeError) as e:  # pragma: no cover - device-specific
        warnings.warn(f"sm_shares: no usable per-SM speed measurement ({e}); streaming with equal shares")
        prefix = uniform(lay.num_sms)
    return dataclasses.replace(lay, share_prefix=prefix)
