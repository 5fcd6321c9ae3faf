"""Probe for the batch redesign (issue 9): how fast can one weight pass serve B = 1..8 slots?

The batch builds read each slot's fp32 input from shared memory for every 512-byte weight chunk
(csrc/mk_stream.cuh run_phase), so B > 1 is bound by shared-memory bandwidth (bench/RESULTS.md,
session 3). The candidate fix packs weights in the A-fragment order of `mma.m16n8k16` (one 512-byte
chunk = 16 rows x 16 k; a lane's 16 bytes are its a0..a3) and feeds the slots as the bf16 B operand.
This probe streams one LM-head-sized matrix (default 128,256 x 2,048 bf16, 525 MB) through both
designs on the whole GPU, no barriers, and reports GB/s and correctness per B:

    python bench/mma_probe.py [--rows 128256 --k 2048] [--out DIR]

  cc:  CUDA cores, rows dealt to warps, per chunk B fp32 dot8 from shared memory (today's design)
  mma: tensor cores, 16-row groups dealt to warps, per chunk one mma over 8 slot columns (B <= 8)

Prediction (before measuring): cc at B = 1 near the copy rate (~3.7 TB/s, device-numbers.md), falling
~1/B past B = 2 (8 shared-memory wavefronts per chunk per slot); mma flat at ~3.7 TB/s for B = 1..8.
`pack_mma` is the packing the CPU test (tests/test_mma_probe_cpu.py) checks against the documented
fragment layout with a numpy model of the instruction.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Fragment layout of mma.m16n8k16 with bf16 inputs (PTX ISA, "Matrix Fragments for mma.m16n8k16"):
# lane l: group g = l >> 2, t = l & 3. A (16 x 16, row-major) regs a0..a3, two elements each
# (lower k in the low half): a0 (row g, k 2t..2t+1), a1 (row g+8, k 2t..), a2 (row g, k 2t+8..),
# a3 (row g+8, k 2t+8..). B (16 x 8): b0 (k 2t..2t+1, col g), b1 (k 2t+8.., col g).
# C (16 x 8 fp32): c0, c1 (row g, cols 2t, 2t+1), c2, c3 (row g+8, cols 2t, 2t+1).
A_PIECES = ((0, 0), (8, 0), (0, 8), (8, 8))  # (row offset, k offset) of a0..a3


def pack_mma(w: np.ndarray) -> np.ndarray:
    """w [R, K] (any dtype; R % 16 == K % 16 == 0) -> [R/16, K/16, 32 lanes, 8]: chunk (row group,
    k group) holds lane l's a0..a3 elements in order, so one 16-byte load per lane is its A fragment."""
    r, k = w.shape
    if r % 16 or k % 16:
        raise ValueError(f"rows {r} and k {k} must be multiples of 16")
    t = w.reshape(r // 16, 16, k // 16, 16)  # [rg, row in group, kg, k in group]
    lanes = np.arange(32)
    g, q = lanes >> 2, lanes & 3
    out = np.empty((r // 16, k // 16, 32, 8), w.dtype)
    for j, (dr, dk) in enumerate(A_PIECES):
        for e in range(2):
            out[:, :, :, 2 * j + e] = t[:, g + dr, :, 2 * q + dk + e].transpose(1, 2, 0)  # (lanes first)
    return out


def mma_model(packed: np.ndarray, x: np.ndarray) -> np.ndarray:
    """numpy model of the probe's mma kernel: packed [RG, KG, 32, 8] weights, x [B <= 8, K] ->
    y [B, R] (fp32 math), reading every operand through its fragment position as the hardware does."""
    rg_n, kg_n = packed.shape[:2]
    b_n = x.shape[0]
    xb = np.zeros((8, kg_n * 16), np.float64)
    xb[:b_n] = x
    y = np.zeros((8, rg_n * 16), np.float64)
    lanes = np.arange(32)
    g, q = lanes >> 2, lanes & 3
    for rg in range(rg_n):
        c = np.zeros((32, 4))
        for kg in range(kg_n):
            a = packed[rg, kg].astype(np.float64)  # [32, 8]
            # rebuild the 16 x 16 A tile and the 16 x 8 B tile from the lanes' fragments
            tile = np.zeros((16, 16))
            for j, (dr, dk) in enumerate(A_PIECES):
                for e in range(2):
                    tile[g + dr, 2 * q + dk + e] = a[:, 2 * j + e]
            bt = np.zeros((16, 8))
            for e in range(2):
                bt[2 * q + e, g] = xb[g, kg * 16 + 2 * q + e]
                bt[2 * q + 8 + e, g] = xb[g, kg * 16 + 2 * q + 8 + e]
            d = tile @ bt  # [16 rows, 8 cols]
            c[:, 0] += d[g, 2 * q]
            c[:, 1] += d[g, 2 * q + 1]
            c[:, 2] += d[g + 8, 2 * q]
            c[:, 3] += d[g + 8, 2 * q + 1]
        for j, (dr, dc) in enumerate(((0, 0), (0, 1), (8, 0), (8, 1))):
            y[2 * q + dc, rg * 16 + g + dr] = c[:, j]
    return y[:b_n].astype(np.float32)


KERNELS = r"""
typedef unsigned int u32;
// PB slots; x_cc fp32 [PB][K] and x_mma bf16 [8][K + 8] staged in shared memory by every block.
__device__ __forceinline__ float bf_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf_hi(u32 v) { return __uint_as_float(v & 0xffff0000u); }

extern "C" __global__ void __launch_bounds__(512, 1)
cc_matvec(const uint4* __restrict__ w, const float* __restrict__ x, float* __restrict__ y, int rows, int K) {
  extern __shared__ float xs[];  // [PB][K]
  for (int i = threadIdx.x; i < PB * K; i += blockDim.x) xs[i] = x[i];
  __syncthreads();
  const int lane = threadIdx.x & 31, nw = gridDim.x * (blockDim.x >> 5);
  const int gw = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int r0 = (int)((long long)rows * gw / nw), r1 = (int)((long long)rows * (gw + 1) / nw);
  const int chunks = K / 256;
  for (int r = r0; r < r1; r++) {
    float acc[PB];
#pragma unroll
    for (int b = 0; b < PB; b++) acc[b] = 0.f;
    const uint4* wr = w + (long long)r * (K / 8) + lane;
#pragma unroll 8
    for (int c = 0; c < chunks; c++) {
      const uint4 v = __ldcs(wr + c * 32);
      const float wf[8] = {bf_lo(v.x), bf_hi(v.x), bf_lo(v.y), bf_hi(v.y), bf_lo(v.z), bf_hi(v.z), bf_lo(v.w), bf_hi(v.w)};
#pragma unroll
      for (int b = 0; b < PB; b++) {
        const float4 p = *reinterpret_cast<const float4*>(xs + b * K + c * 256 + lane * 8);
        const float4 q = *reinterpret_cast<const float4*>(xs + b * K + c * 256 + lane * 8 + 4);
        acc[b] += wf[0] * p.x + wf[1] * p.y + wf[2] * p.z + wf[3] * p.w + wf[4] * q.x + wf[5] * q.y + wf[6] * q.z + wf[7] * q.w;
      }
    }
#pragma unroll
    for (int b = 0; b < PB; b++) {
      float v = acc[b];
      for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0) y[(long long)b * rows + r] = v;
    }
  }
}

extern "C" __global__ void __launch_bounds__(512, 1)
mma_matvec(const uint4* __restrict__ w, const unsigned short* __restrict__ xb, float* __restrict__ y, int rows, int K) {
  extern __shared__ unsigned short xh[];  // [8][K + 8] bf16 (row pad: conflict-free B-fragment loads)
  const int ld = K + 8;
  for (int i = threadIdx.x; i < 8 * ld; i += blockDim.x) {
    const int n = i / ld, k = i % ld;
    xh[i] = (n < PB && k < K) ? xb[n * K + k] : 0;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, nw = gridDim.x * (blockDim.x >> 5);
  const int gw = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int groups = rows / 16, kg = K / 16;
  const int q0 = (int)((long long)groups * gw / nw), q1 = (int)((long long)groups * (gw + 1) / nw);
  const u32* xr = reinterpret_cast<const u32*>(xh + g * ld) + t;
  for (int q = q0; q < q1; q++) {
    float c0 = 0.f, c1 = 0.f, c2 = 0.f, c3 = 0.f;
    const uint4* wq = w + (long long)q * kg * 32 + lane;
#pragma unroll 8
    for (int c = 0; c < kg; c++) {
      const uint4 a = __ldcs(wq + c * 32);
      const u32 b0 = xr[c * 8], b1 = xr[c * 8 + 4];
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                   : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
                   : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
    }
    const int row = q * 16 + g, n = 2 * t;
    if (n < PB) { y[(long long)n * rows + row] = c0; y[(long long)n * rows + row + 8] = c2; }
    if (n + 1 < PB) { y[(long long)(n + 1) * rows + row] = c1; y[(long long)(n + 1) * rows + row + 8] = c3; }
  }
}
"""


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit patterns (round to nearest even), as uint16."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=128256)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import cupy as cp

    from bench.decode import copy_bandwidth

    rows, k = args.rows, args.k
    rng = np.random.default_rng(0)
    w32 = rng.standard_normal((rows, k), np.float32) * (1 / k) ** 0.5
    wb = bf16_bits(w32)
    w_row = cp.asarray(wb)  # [rows, K] bf16 bits, row-major (cc)
    w_mma = cp.asarray(pack_mma(wb))  # fragment order (mma)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    res = {"rows": rows, "k": k, "weight_MB": round(wb.nbytes / 1e6, 1), "copy_TBps": round(copy_bandwidth(cp) / 1e12, 3),
           "runs": []}
    print(json.dumps({k_: v for k_, v in res.items() if k_ != "runs"}), flush=True)
    wf = (wb.astype(np.uint32) << 16).view(np.float32).T.astype(np.float64)  # the bf16 weights, [K, rows]
    for b in args.batches:
        mod = cp.RawModule(code=KERNELS, options=("-std=c++17", f"-DPB={b}"))
        x = rng.standard_normal((b, k), np.float32)
        xb = bf16_bits(x)
        want = x.astype(np.float64) @ wf  # [B, rows]
        want_b = (xb.astype(np.uint32) << 16).view(np.float32).astype(np.float64) @ wf
        for name in ("cc", "mma"):
            if name == "mma" and b > 8:
                continue
            fn = mod.get_function(f"{name}_matvec")
            y = cp.zeros((b, rows), cp.float32)
            if name == "cc":
                smem, argv = 4 * b * k, (w_row, cp.asarray(x), y, np.int32(rows), np.int32(k))
            else:
                smem, argv = 2 * 8 * (k + 8), (w_mma, cp.asarray(xb), y, np.int32(rows), np.int32(k))
            fn.max_dynamic_shared_size_bytes = smem
            times = []
            for it in range(8):
                s, e = cp.cuda.Event(), cp.cuda.Event()
                s.record()
                fn((sms,), (512,), argv, shared_mem=smem)
                e.record()
                e.synchronize()
                if it >= 2:
                    times.append(cp.cuda.get_elapsed_time(s, e) / 1e3)
            got = cp.asnumpy(y)
            ref = want if name == "cc" else want_b  # mma rounds the slots' inputs to bf16 by design
            rel = float(np.abs(got - ref).max() / np.abs(ref).max())
            t = statistics.median(times)
            row = {"design": name, "batch": b, "us": round(t * 1e6, 1), "GBps": round(wb.nbytes / t / 1e9, 1),
                   "rel_err": rel, "ok": rel < 1e-3}
            res["runs"].append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "mma_probe.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
