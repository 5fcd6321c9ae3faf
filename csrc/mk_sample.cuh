// Choosing the next token on the GPU. Greedy and plain temperature sampling (Gumbel-max with a
// Philox counter RNG) are argmax reductions over the per-warp bests the LM-head phase leaves
// behind, so every block computes the same token with no extra barrier. top-k / top-p run in
// block 0 over the stored logits: bisection on the logit threshold, then Gumbel-max.
#pragma once
#include "mk_common.cuh"
#include "mk_layout.cuh"

#ifndef MK_V_ALL
#define MK_V_ALL MK_V  // the whole vocabulary (tensor-parallel builds: MK_V is one GPU's slice)
#endif

// Every block: the winning token over all warps' (value, index) bests.
MK_DEVICE int reduce_best(const MkParams& p, float* s_red) {
  const int nw = gridDim.x * kStreamWarps;
  float v = -INFINITY; int i = 0x7fffffff;
  for (int w = threadIdx.x; w < nw; w += MK_THREADS) argmax_merge(v, i, __ldcg(p.best_val + w), __ldcg(p.best_idx + w));
  warp_argmax(v, i);
  int* s_idx = reinterpret_cast<int*>(s_red + 32);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) { s_red[threadIdx.x >> 5] = v; s_idx[threadIdx.x >> 5] = i; }
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < kWarps ? s_red[threadIdx.x] : -INFINITY;
    i = threadIdx.x < kWarps ? s_idx[threadIdx.x] : 0x7fffffff;
    warp_argmax(v, i);
    if (threadIdx.x == 0) s_idx[32] = i;
  }
  __syncthreads();
  int tok = s_idx[32];
  __syncthreads();
  return tok;
}

// Block-wide: count of z >= t and sum of exp(z) over z >= t, z = (logit - M) * invT.
MK_DEVICE void mass_above(const float* logits, float M, float invT, float t, float floor_t,
                          float* s_red, float& count, float& mass) {
  float c = 0.f, m = 0.f;
  for (int i = threadIdx.x; i < MK_V_ALL; i += MK_THREADS) {
    float z = (__ldcg(logits + i) - M) * invT;
    if (z >= t && z >= floor_t) { c += 1.f; m += __expf(z); }
  }
  count = block_sum(c, s_red);
  mass = block_sum(m, s_red);
}

// Block 0 only: temperature + top-k + top-p + Gumbel-max over the step's logits.
MK_DEVICE int sample_topkp(const MkParams& p, const float* logits, int step, float M, float* s_red) {
  const float invT = (float)p.inv_temperature;  // M: the step's largest raw logit
  // Lowest z worth considering: exp(-80) is below any fp32 probability mass that matters.
  const float zmin = -80.f;
  float cnt, mass;
  float tk = zmin;
  if (p.top_k > 0 && p.top_k < MK_V_ALL) {
    float lo = zmin, hi = 0.f;
    for (int it = 0; it < 28; it++) {
      float mid = 0.5f * (lo + hi);
      mass_above(logits, M, invT, mid, zmin, s_red, cnt, mass);
      if (cnt >= (float)p.top_k) lo = mid; else hi = mid;
    }
    tk = lo;
  }
  float tp = tk;
  if (p.top_p < 1.0) {
    float total;
    mass_above(logits, M, invT, tk, zmin, s_red, cnt, total);
    float lo = tk, hi = 0.f;
    for (int it = 0; it < 28; it++) {
      float mid = 0.5f * (lo + hi);
      mass_above(logits, M, invT, mid, tk, s_red, cnt, mass);
      if (mass >= (float)p.top_p * total) lo = mid; else hi = mid;
    }
    tp = lo;
  }
  float v = -INFINITY; int idx = 0x7fffffff;
  for (int i = threadIdx.x; i < MK_V_ALL; i += MK_THREADS) {
    float z = (__ldcg(logits + i) - M) * invT;
    if (z >= tp) argmax_merge(v, idx, z + gumbel(p.seed, step, i), i);
  }
  warp_argmax(v, idx);
  int* s_idx = reinterpret_cast<int*>(s_red + 32);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) { s_red[threadIdx.x >> 5] = v; s_idx[threadIdx.x >> 5] = idx; }
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < kWarps ? s_red[threadIdx.x] : -INFINITY;
    idx = threadIdx.x < kWarps ? s_idx[threadIdx.x] : 0x7fffffff;
    warp_argmax(v, idx);
    if (threadIdx.x == 0) s_idx[32] = idx;
  }
  __syncthreads();
  int tok = s_idx[32];
  __syncthreads();
  return tok;
}
