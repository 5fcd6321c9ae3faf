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

#ifndef MK_BLOCK_BEST
#define MK_BLOCK_BEST 0  // layout option block_best (batch builds; flag emitted only when on)
#endif
#if MK_BATCH > 1
// Every block: lane 0 of each warp holds that warp's best (v[b], i[b]) of every slot; returns in lane 0 of warp
// b < kB the block's best of slot b (argmax_merge's total order: the same whatever the order). Scratch: s_act,
// [kWarps][kB] values then indices; ends before anyone reuses it, so the caller synchronizes after.
MK_DEVICE void block_merge_bests(float* s_act, const float* v, const int* i, float& bv, int& bi) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* s_v = s_act;
  int* s_i = reinterpret_cast<int*>(s_act + kWarps * kB);
  if (lane == 0)
#pragma unroll
    for (int b = 0; b < kB; b++) { s_v[warp * kB + b] = v[b]; s_i[warp * kB + b] = i[b]; }
  __syncthreads();
  if (warp < kB) {  // warp b merges slot b's kWarps bests
    bv = lane < kWarps ? s_v[lane * kB + warp] : -INFINITY;
    bi = lane < kWarps ? s_i[lane * kB + warp] : 0x7fffffff;
    warp_argmax(bv, bi);
  }
}
#endif

#if MK_BLOCK_BEST
static_assert(MK_BATCH > 1, "block_best: batch builds");
// block_best, at the LM phase's end: the block's warps' bests (lane 0 of each streaming warp holds its warp's)
// merged into one per slot before they go to memory, so reduce_best_slots reads gridDim.x per slot instead of
// gridDim.x * kStreamWarps (every block reads every slot's: ~67 KB per block at B = 4). Same tokens: the merge is
// argmax_merge's total order. The grid barrier after the LM phase synchronizes the block anyway.
MK_DEVICE void block_best_slots(const MkParams& p, float* s_act, const WeightStream& st, const float* best,
                                const int* best_i) {
  float v[kB]; int i[kB];
#pragma unroll
  for (int b = 0; b < kB; b++) {  // (a control warp streams nothing)
    v[b] = st.gw >= 0 ? best[b] : -INFINITY;
    i[b] = st.gw >= 0 ? best_i[b] : 0x7fffffff;
  }
  __syncthreads();  // every warp done reading s_act (the LM input)
  float bv; int bi;
  block_merge_bests(s_act, v, i, bv, bi);
  const int warp = threadIdx.x >> 5;
  if (warp < kB && (threadIdx.x & 31) == 0) {
    p.best_val[warp * gridDim.x + blockIdx.x] = bv;
    p.best_idx[warp * gridDim.x + blockIdx.x] = bi;
  }
}
#endif

#ifndef MK_BEST_MAX
#define MK_BEST_MAX 0  // layout option best_max (batch builds; flag emitted only when on)
#endif
#if MK_BEST_MAX
static_assert(MK_BATCH > 1 && !MK_BLOCK_BEST, "best_max: batch builds, instead of block_best");
// best_max: each warp's best (value, id) of a slot as one 64-bit key that orders as argmax_merge does (a larger
// value first, then the lower id), so the warps merge with one atomicMax per slot at the LM phase's end and every
// block reads each slot's answer in one load after the barrier, instead of reducing all warps' bests itself (6.85 us
// per B = 4 step in the timeline: ~67 KB per block in three dependent load rounds). The float's bits map to an
// unsigned order (negatives complemented); the one difference from argmax_merge: +0.0 beats -0.0 (equal as floats).
MK_DEVICE unsigned long long best_key(float v, int i) {
  const unsigned u = __float_as_uint(v);
  const unsigned ord = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ((unsigned long long)ord << 32) | (unsigned)(0x7fffffff - i);  // (-inf's key > 0, the reset value)
}
// Step `step`'s keys, one per slot, in the first words of best_val (unused otherwise in these builds): two sets by
// step parity. Set (step + 1) & 1 was last read in step - 1's sampling, which every block finished before the LM
// barrier of `step`; block 0 clears it after that barrier (best_keys_take), long before step + 1's LM phase. The
// host zeroes both sets before each launch (BatchGpuModel.launch_slots).
MK_DEVICE unsigned long long* best_keys(const MkParams& p, int step) {
  return reinterpret_cast<unsigned long long*>(p.best_val) + (step & 1) * kB;
}
MK_DEVICE void best_keys_put(const MkParams& p, int step, unsigned live, const float* best, const int* best_i) {
#pragma unroll
  for (int b = 0; b < kB; b++)
    if ((live >> b) & 1u) atomicMax(best_keys(p, step) + b, best_key(best[b], best_i[b]));
}
// Every block, after the LM barrier: each live slot's token from its key (0 for a slot not live), as
// reduce_best_slots gives it; block 0 then clears the next step's keys.
MK_DEVICE void best_keys_take(const MkParams& p, int step, unsigned live, int* tok) {
  const unsigned long long* keys = best_keys(p, step);
#pragma unroll
  for (int b = 0; b < kB; b++)
    tok[b] = ((live >> b) & 1u) ? 0x7fffffff - (int)(unsigned)__ldcg(keys + b) : 0;
  if (blockIdx.x == 0 && threadIdx.x < kB) best_keys(p, step + 1)[threadIdx.x] = 0ull;
}
#endif

#if MK_BATCH > 1
// Every block: reduce_best for every live slot at once (tok[b]; 0 for a slot not live). All slots' loads are in
// flight together and one block exchange serves the batch (the timeline probe measured sample + emit at 14.3 us
// per B = 4 step against 2.4 at B = 1: one dependent L2 round trip and three __syncthreads per slot). Same
// tokens as reduce_best: argmax_merge is a total order (ties: the lowest id), so the merge order does not matter.
// Scratch: s_act (free between the LM phase and the next prologue).
MK_DEVICE void reduce_best_slots(const MkParams& p, float* s_act, unsigned live, int* tok) {
  const int nw = MK_BLOCK_BEST ? (int)gridDim.x : (int)gridDim.x * kStreamWarps;  // (block_best: one per block)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float v[kB]; int i[kB];
#pragma unroll
  for (int b = 0; b < kB; b++) { v[b] = -INFINITY; i[b] = 0x7fffffff; }
#pragma unroll 2
  for (int w = threadIdx.x; w < nw; w += MK_THREADS)
#pragma unroll
    for (int b = 0; b < kB; b++)
      if ((live >> b) & 1u) argmax_merge(v[b], i[b], __ldcg(p.best_val + (long long)b * nw + w), __ldcg(p.best_idx + (long long)b * nw + w));
#pragma unroll
  for (int b = 0; b < kB; b++) warp_argmax(v[b], i[b]);
  float bv; int bi;
  block_merge_bests(s_act, v, i, bv, bi);
  int* s_tok = reinterpret_cast<int*>(s_act + 2 * kWarps * kB);
  if (warp < kB && lane == 0) s_tok[warp] = bi;
  __syncthreads();
#pragma unroll
  for (int b = 0; b < kB; b++) tok[b] = ((live >> b) & 1u) ? s_tok[b] : 0;
  __syncthreads();  // s_act is the next prologue's
}
static_assert(kB <= kWarps && 2 * kWarps * kB + kB <= MK_ACT_FLOATS, "reduce_best_slots' scratch in s_act");
#endif

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
