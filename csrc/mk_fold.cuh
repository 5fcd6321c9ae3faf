// Layout option fold_x (batch builds; replicas/layout.py): the residual stream lives in the int64 fixed-point
// accumulators themselves instead of an fp32 vector beside them. A batch prologue is bound by every block reading
// every slot's residual (fp32, 4 bytes) and accumulator (int64, 8 bytes) from L2 (~13 MB per prologue at B = 4 on
// 1B); with the residual folded in it reads the accumulator alone: 8 of 12 bytes per element and slot.
//   O accumulator    starts as the residual (+ the O bias) instead of zero: the QKV phase copies the last
//                    fused-MLP accumulator (layer 0: the token embeddings) into it, before the QKV barrier
//   fused-MLP acc.   gets the post-attention residual added once per element (after the O barrier, beside
//                    the down's atomics; integer adds commute, so the sum is exact in any order)
// The host's hidden state of a slot is then the accumulator alone (replicas/monokernel_batch.py slot_hidden).
#pragma once
#include "mk_common.cuh"
#include "mk_layout.cuh"
#include "mk_batch.cuh"
#include "mk_fused.cuh"
#include "mk_attn_o.cuh"

#ifndef MK_FOLD_X
#define MK_FOLD_X 0  // layout option fold_x (flag emitted only when on)
#endif
#if MK_FOLD_X
static_assert(MK_BATCH > 1 && MK_FUSED_MLP && MK_ATTN_O, "fold_x: batch builds (fused MLP and attention + O)");

MK_DEVICE long long fold_fixed(float v) { return __float2ll_rn(v * kFxScale); }

// Every block, in the QKV phase of `layer`: its grid-strided share of the O accumulator [B][Hp] set to each live
// slot's residual: `src` (the last fused-MLP accumulator, final since the MLP barrier) or, with src null (layer
// 0), the embedding of the slot's token; plus the layer's O bias. Nobody adds to it before the QKV barrier.
MK_DEVICE void ao_fold_init(const MkParams& p, const long long* src, const int* tok, unsigned live, int layer) {
  long long* acc = ao_acc(p);
#if MK_FX_PACK
  // (fx_pack: word k holds slots 2c and 2c + 1 of element i; each lane set as below, 0 for a slot not live)
  for (int k = blockIdx.x * MK_THREADS + threadIdx.x; k < kAccRows * MK_HP; k += gridDim.x * MK_THREADS) {
    const int c = k / MK_HP, i = k % MK_HP;
    int lane[2] = {0, 0};
    if (i < MK_H && row_on(live, c)) {
      const unsigned long long w = src ? (unsigned long long)__ldcg(src + k) : 0ull;
      const int bias = MK_O_BIAS ? to_lane(p.o_bias[(long long)layer * MK_H + i]) : 0;
#pragma unroll
      for (int j = 0; j < 2; j++) {
        const int b = 2 * c + j;
        if (!slot_on(live, b)) continue;
        lane[j] = (src ? (j ? lane_hi(w) : lane_lo(w)) : to_lane(bf16_to_f32(p.embed[(long long)tok[b] * MK_H + i]))) + bias;
      }
    }
    acc[k] = (long long)pack_lanes(lane[0], lane[1]);
  }
#else
  for (int k = blockIdx.x * MK_THREADS + threadIdx.x; k < kB * MK_HP; k += gridDim.x * MK_THREADS) {
    const int b = k / MK_HP, i = k % MK_HP;
    long long v = 0;
    if (i < MK_H && slot_on(live, b)) {
      v = src ? __ldcg(src + k) : fold_fixed(bf16_to_f32(p.embed[(long long)tok[b] * MK_H + i]));
      if (MK_O_BIAS) v += fold_fixed(p.o_bias[(long long)layer * MK_H + i]);
    }
    acc[k] = v;
  }
#endif
}

// Every block, after the O barrier: its share of the post-attention residual (the O accumulator, now final)
// added into the fused-MLP accumulator `dst` (zeroed a layer ago), whose down partials land beside it.
MK_DEVICE void fx_fold_add(const MkParams& p, long long* dst, unsigned live) {
  const long long* acc = ao_acc(p);
  for (int k = blockIdx.x * MK_THREADS + threadIdx.x; k < kAccRows * MK_HP; k += gridDim.x * MK_THREADS)
    if (k % MK_HP < MK_H && row_on(live, k / MK_HP))  // (fx_pack: a pair's word; lanes of slots not live are 0)
      atomicAdd(reinterpret_cast<unsigned long long*>(dst + k), (unsigned long long)__ldcg(acc + k));
}
#endif
