// Choosing the next token on the GPU. Greedy and plain temperature sampling (Gumbel-max with a
// Philox counter RNG) are argmax reductions over the per-warp bests the LM-head phase leaves
// behind, so every block computes the same token with no extra barrier. top-k / top-p run in
// block 0 over the stored logits: bisection on the logit threshold, then Gumbel-max.
#pragma once
#include "mk_common.cuh"
#include "mk_layout.cuh"
#include "mk_batch.cuh"

#ifndef MK_V_ALL
#define MK_V_ALL MK_V  // the whole vocabulary (tensor-parallel builds: MK_V is one GPU's slice)
#endif

// Every block: the winning token over all warps' (value, index) bests.
// (slot b's bests: [B][warps])
MK_DEVICE int reduce_best(const MkParams& p, float* s_red, int b = 0) {
  const int nw = gridDim.x * kStreamWarps;
  const float* bv = p.best_val + (long long)b * nw;
  const int* bi = p.best_idx + (long long)b * nw;
  float v = -INFINITY; int i = 0x7fffffff;
  for (int w = threadIdx.x; w < nw; w += MK_THREADS) argmax_merge(v, i, __ldcg(bv + w), __ldcg(bi + w));
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

// One block: temperature + top-k + top-p + Gumbel-max over slot b's logits of this step
// (`step`: the slot's token index, the RNG counter).
MK_DEVICE int sample_topkp(const MkParams& p, const float* logits, int step, float M, float* s_red, int b = 0) {
  const float invT = (float)MK_SLOT(p, b, inv_temperature);  // M: the step's largest raw logit
  const long long top_k = MK_SLOT(p, b, top_k);
  const double top_p = MK_SLOT(p, b, top_p);
  const unsigned long long seed = MK_SLOT(p, b, seed);
  // Lowest z worth considering: exp(-80) is below any fp32 probability mass that matters.
  const float zmin = -80.f;
  float cnt, mass;
  float tk = zmin;
  if (top_k > 0 && top_k < MK_V_ALL) {
    float lo = zmin, hi = 0.f;
    for (int it = 0; it < 28; it++) {
      float mid = 0.5f * (lo + hi);
      mass_above(logits, M, invT, mid, zmin, s_red, cnt, mass);
      if (cnt >= (float)top_k) lo = mid; else hi = mid;
    }
    tk = lo;
  }
  float tp = tk;
  if (top_p < 1.0) {
    float total;
    mass_above(logits, M, invT, tk, zmin, s_red, cnt, total);
    float lo = tk, hi = 0.f;
    for (int it = 0; it < 28; it++) {
      float mid = 0.5f * (lo + hi);
      mass_above(logits, M, invT, mid, tk, s_red, cnt, mass);
      if (mass >= (float)top_p * total) lo = mid; else hi = mid;
    }
    tp = lo;
  }
  float v = -INFINITY; int idx = 0x7fffffff;
  for (int i = threadIdx.x; i < MK_V_ALL; i += MK_THREADS) {
    float z = (__ldcg(logits + i) - M) * invT;
    if (z >= tp) argmax_merge(v, idx, z + gumbel(seed, step, i), i);
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
