// O-proj fused into the attention phase (MK_ATTN_O, layout option `fused_attn_o`; see
// replicas/layout_attn_o.py). O is packed by kv group: unit (g, row) = the row's GDp columns of group
// g. Each attention split block bumps attn_cnt[g] after publishing its partial; a block then waits
// only for the groups its O units touch (one or two), combines those groups into s_act + g * GDp and
// streams its O units, adding each result as int64 fixed point into o_part (integer adds commute:
// deterministic whatever the arrival order). No grid barrier between attention and O.
#pragma once
#include "mk_common.cuh"
#include "mk_layout.cuh"
#include "mk_stream.cuh"
#include "mk_attention.cuh"

constexpr float kAoScale = 4294967296.f;  // 2^32, as fused_mlp's accumulators
constexpr float kAoInv = 1.f / 4294967296.f;
static_assert(MK_TP == 1, "fused_attn_o is single-GPU only (layout_attn_o.attn_o_error)");
static_assert(MK_NKV * MK_AO_GDP + 2 * kGroup * MK_MAX_SPLITS <= MK_ACT_FLOATS, "fused_attn_o staging");

MK_DEVICE long long* ao_acc(const MkParams& p) { return reinterpret_cast<long long*>(p.o_part); }

// combine_attention restricted to kv group g (same arithmetic, so the same values), staged at
// s_act + g * GDp (zero padded); split weights in scratch s_w.
MK_DEVICE void ao_combine_group(const MkParams& p, int nsplit, int g, float* s_act, float* s_w) {
  const int tid = threadIdx.x, cap = split_capacity();
  for (int i = tid; i < kGroup * nsplit; i += MK_THREADS) {
    const int h = i / nsplit, s = i % nsplit;
    const long long b = ((long long)g * cap + s) * kGroup + h;
    s_w[i] = __ldcg(p.attn_m + b);
    s_w[kGroup * nsplit + i] = __ldcg(p.attn_l + b);
  }
  __syncthreads();
  for (int h = tid; h < kGroup; h += MK_THREADS) {
    float M = -INFINITY, den = 0.f;
    for (int s = 0; s < nsplit; s++) M = fmaxf(M, s_w[h * nsplit + s]);
    for (int s = 0; s < nsplit; s++) den += __expf(s_w[h * nsplit + s] - M) * s_w[kGroup * nsplit + h * nsplit + s];
    for (int s = 0; s < nsplit; s++) s_w[h * nsplit + s] = __expf(s_w[h * nsplit + s] - M) / den;
  }
  __syncthreads();
  for (int i = tid; i < MK_AO_GDP; i += MK_THREADS) {
    float acc = 0.f;
    if (i < kGroup * MK_D) {
      const int h = i / MK_D, d = i % MK_D;
      const float* o = p.attn_o + ((long long)g * cap * kGroup + h) * MK_D + d;
#pragma unroll 4
      for (int s = 0; s < nsplit; s++) acc += s_w[h * nsplit + s] * __ldcg(o + (long long)s * kGroup * MK_D);
    }
    s_act[g * MK_AO_GDP + xpos(i)] = acc;
  }
  __syncthreads();
}

// Every block, after its own attention item: wait for and stage the groups of its O units.
// `target` = splits per group published so far in this launch (attn_cnt never resets in a launch).
MK_DEVICE void ao_stage(const MkParams& p, int pos, unsigned target, float* s_act) {
  const int nw = gridDim.x * kStreamWarps;
  long long u0, u1, t0, t1;
  warp_range(kUnitsO, blockIdx.x * kStreamWarps, nw, u0, t1);
  warp_range(kUnitsO, blockIdx.x * kStreamWarps + kStreamWarps - 1, nw, t0, u1);
  if (u1 <= u0) return;  // no O units in this block (uniform over the block)
  const int nsplit = num_splits(pos + 1);
  float* s_w = s_act + MK_NKV * MK_AO_GDP;
  for (int g = (int)(u0 / MK_H); g <= (int)((u1 - 1) / MK_H); g++) {
    if (threadIdx.x == 0) while ((int)(ld_acquire(p.attn_cnt + g) - target) < 0) { }
    __syncthreads();
    ao_combine_group(p, nsplit, g, s_act, s_w);
  }
}

// One O unit's result into the accumulator (lane 0 of the warp; `u` = g * H + row).
MK_DEVICE void ao_add(const MkParams& p, long long u, float acc) {
  atomicAdd(reinterpret_cast<unsigned long long*>(ao_acc(p) + u % MK_H), (unsigned long long)__float2ll_rn(acc * kAoScale));
}

// Block-strided zeroing of the accumulator (in the QKV phase: read before its barrier, added after).
MK_DEVICE void ao_zero(const MkParams& p) {
  long long* acc = ao_acc(p);
  for (int i = blockIdx.x * MK_THREADS + threadIdx.x; i < MK_HP; i += gridDim.x * MK_THREADS) acc[i] = 0;
}

// residual_norm<S> of monokernel.cu with the O accumulator (+ bias) as the partial source.
MK_DEVICE void residual_norm_ao(const MkParams& p, const float* xsrc, const float* bias, float* xdst, const float* w,
                                float* s_act, float* s_red) {
  const long long* acc = ao_acc(p);
  constexpr int kIt = (MK_HP + MK_THREADS - 1) / MK_THREADS;
  float v[kIt];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kIt; k++) {
    const int i = threadIdx.x + k * MK_THREADS;
    float x = 0.f;
    if (i < MK_H) {
      x = __ldcg(xsrc + i) + __ll2float_rn(__ldcg(acc + i)) * kAoInv;
      if (bias) x += bias[i];
    }
    v[k] = x;
    ss += x * x;
  }
  const float r = rsqrtf(block_sum(ss, s_red) / MK_H + MK_EPS);
#pragma unroll
  for (int k = 0; k < kIt; k++) {
    const int i = threadIdx.x + k * MK_THREADS;
    if (i < MK_HP) {
      if (i < MK_H && xdst && blockIdx.x == 0) xdst[i] = v[k];
      s_act[xpos(i)] = i < MK_H ? v[k] * r * w[i] : 0.f;
    }
  }
  __syncthreads();
}
