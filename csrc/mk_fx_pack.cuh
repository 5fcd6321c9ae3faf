// Layout option fx_pack (batch builds with fold_x, mma_mlp and mma_o; replicas/layout_fused.py FX_PACK_SHIFT): two
// slots share every int64 word of the O and fused-MLP accumulators, as 32-bit fixed-point lanes (slot 2c in the low
// lane of row c, slot 2c + 1 in the high lane; units of 2^-MK_FX_PACK_SHIFT).
// Why: at B = 4 the batch layer is bound by L2 traffic B = 1 does not have (csrc/NOTES.md "Batch speed after session
// 13"): one int64 atomic per block, row and slot from the down and the O tiles, and every block's prologue reading
// every slot's 8-byte accumulator. Packed, one atomic carries two slots and a prologue reads 4 bytes per element
// and slot.
// Still exact and order-free: a word is hi * 2^32 + lo in 64-bit two's complement, so a sum of words is
// (sum of hi) * 2^32 + (sum of lo) mod 2^64, and unpacking returns each lane's total exactly whenever that total
// fits in 32 bits, however the partial sums carried between the lanes on the way.
// Range +-2^(31 - F) (+-32,768 at F = 16), step 2^-F (1.5e-5): finer than a bf16 residual (transformers' own) from
// magnitude 0.004 up.
#pragma once
#include "mk_common.cuh"
#include "mk_layout.cuh"

#ifndef MK_FX_PACK
#define MK_FX_PACK 0  // layout option fx_pack (flag emitted only when on)
#endif

#if MK_FX_PACK && !(defined(MK_MMA_MLP) && MK_MMA_MLP && defined(MK_MMA_O) && MK_MMA_O && defined(MK_FOLD_X) && MK_FOLD_X)
#error "fx_pack packs the tensor-core down's and O's sums and the folded residual: it needs mma_mlp, mma_o and fold_x"
#endif
#if MK_FX_PACK
static_assert(MK_BATCH > 1 && MK_FX_PACK_SHIFT >= 8 && MK_FX_PACK_SHIFT <= 24, "fx_pack: batch builds, 8..24 fraction bits");
constexpr int kAccRows = (kB + 1) / 2;  // accumulator rows of MK_HP words: one per pair of slots
constexpr float kPackScale = (float)(1u << MK_FX_PACK_SHIFT);
constexpr float kPackInv = 1.f / kPackScale;

MK_DEVICE int to_lane(float v) { return __float2int_rn(v * kPackScale); }
MK_DEVICE float from_lane(int v) { return __int2float_rn(v) * kPackInv; }
MK_DEVICE unsigned long long pack_lanes(int lo, int hi) {
  return ((unsigned long long)(unsigned)hi << 32) + (unsigned long long)(long long)lo;
}
MK_DEVICE int lane_lo(unsigned long long w) { return (int)(unsigned)w; }
// (w minus its sign-extended low lane leaves exactly hi * 2^32: the low lane's carries are undone)
MK_DEVICE int lane_hi(unsigned long long w) {
  return (int)(unsigned)((w - (unsigned long long)(long long)lane_lo(w)) >> 32);
}
MK_DEVICE float2 unpack_slots(unsigned long long w) { return make_float2(from_lane(lane_lo(w)), from_lane(lane_hi(w))); }
MK_DEVICE unsigned long long pack_slots(float lo, float hi) { return pack_lanes(to_lane(lo), to_lane(hi)); }
// Whether accumulator row c holds a live slot.
MK_DEVICE bool row_on(unsigned live, int c) { return ((live >> (2 * c)) & 3u) != 0; }
#else
constexpr int kAccRows = kB;  // one row per slot
MK_DEVICE bool row_on(unsigned live, int c) { return kB == 1 || ((live >> c) & 1u); }
#endif
