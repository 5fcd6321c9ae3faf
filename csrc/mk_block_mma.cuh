// Block-tiled k-split tensor-core matvec of the batch builds (layout options mma_mlp's gate/up and mma_qkv;
// replicas/layout_mma_mlp.py). A matrix is packed in mma.m16n8k16 A-fragment chunks (layout_mma.pack_rows /
// pack_gate_up): units of 16 rows over `kSteps` 16-k steps, kMats chunks per step (gate/up: the gate chunk, then
// the up chunk). Block b owns units [v0, v1) (tile_share); its warps split the (unit, step) pairs evenly, and
// each stores one partial tile ("piece" w + v, v relative to v0: injective and increasing in w and v) per unit
// it touched. The block then adds each unit's pieces in warp order (deterministic) and hands every (unit, row,
// slot) sum to the epilogue. Unlike a whole-k tile per warp (layout option mma: -29% at B = 1, 512 gate/up tiles
// for 2,112 warps), every warp streams an equal share, as on CUDA cores.
#pragma once
#include "mk_common.cuh"
#include "mk_layout.cuh"
#include "mk_stream.cuh"
#include "mk_batch.cuh"
#include "mk_fused.cuh"

#if MK_MMA_MLP || MK_MMA_QKV || MK_MMA_O
constexpr int kBc = (kB + 1) & ~1;  // slot columns a piece keeps (even: float2 stores)
// The pieces sit after the h slices (bf16 with mma_mlp; pair_dn: the pair's two), which no phase but the MLP uses
// (layout.act_floats).
constexpr int kPieceOff = kFxH + kB * MK_FX_SLICE / (MK_MMA_MLP && !MK_PAIR_DN ? 2 : 1);
static_assert(kPieceOff % 2 == 0 && MK_FX_SLICE % 4 == 0, "pieces: 8-byte aligned float2 stores");
static_assert(MK_MMLP_PIECES >= 1, "pieces: streaming warps + most units per block - 1 (layout_mma_mlp.pieces)");

// Whether warp v's pairs [n v / W, n (v + 1) / W) of the block's n pairs touch unit u (kSteps pairs each).
template <int kSteps>
MK_DEVICE bool piece_of(int n, int v, int u) {
  const int q0 = n * v / kStreamWarps, q1 = n * (v + 1) / kStreamWarps;
  return q1 > q0 && q0 < (u + 1) * kSteps && q1 > u * kSteps;
}

// This warp's share s (tile_share) of the block's units, nunits of them. Inputs: every slot's vector as bf16 in
// B-fragment order at s_in (frag_half), unit v's first 16-k chunk chunk0(v0 + v). Pieces in s_piece
// ([MK_MMLP_PIECES][kMats][16][kBc] floats). epi(v, r, c, sums) with v relative to v0 and sums[kMats * kCols]
// (matrix m, slot c * kCols + j at m * kCols + j), for every row r < 16 and slot group c of kCols slots (finished
// slots too: the epilogue skips them; kCols = 2: fx_pack's slot pairs). Ends with the block synchronized.
template <int kMats, int kSteps, int kCols = 1, class Chunk0, class Epi>
MK_DEVICE void block_mma(WeightStream& st, const MkParams& p, const float* s_in, const TileShare& s, int nunits,
                         Chunk0 chunk0, float* s_piece, Epi epi) {
  constexpr int kPiece = kMats * 16 * kBc;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
  if (st.gw >= 0 && s.q1 > s.q0) {
    const bool has_slot = g < kB;  // lanes 4b..4b+3 carry slot b's fragment; the others multiply zeros
    const uint2* xf = reinterpret_cast<const uint2*>(s_in);
    int v = s.q0 / kSteps, c = s.q0 % kSteps, c0 = chunk0(s.v0 + v);
    float d[kMats][4];
#pragma unroll
    for (int m = 0; m < kMats; m++)
#pragma unroll
      for (int e = 0; e < 4; e++) d[m][e] = 0.f;
#pragma unroll 2
    for (int q = s.q0; q < s.q1; q++) {
      const uint2 x = has_slot ? xf[(c0 + c) * 4 * kB + lane] : make_uint2(0u, 0u);
      if (kMats == 2) {
        uint4 wa, wb;
        st.take2(wa, wb);
        mma_16816(d[0], wa, x);
        mma_16816(d[kMats - 1], wb, x);
        st.release(p);
        st.release(p);
      } else {
        const uint4 wa = st.take();
        mma_16816(d[0], wa, x);
        st.release(p);
      }
      if (++c == kSteps || q + 1 == s.q1) {  // this unit's part is done: its piece, lane (g, tq) rows g, g + 8
        float* P = s_piece + (w + v) * kPiece;
        if (2 * tq < kBc)
#pragma unroll
          for (int m = 0; m < kMats; m++) {
            *reinterpret_cast<float2*>(P + (16 * m + g) * kBc + 2 * tq) = make_float2(d[m][0], d[m][1]);
            *reinterpret_cast<float2*>(P + (16 * m + g + 8) * kBc + 2 * tq) = make_float2(d[m][2], d[m][3]);
          }
#pragma unroll
        for (int m = 0; m < kMats; m++)
#pragma unroll
          for (int e = 0; e < 4; e++) d[m][e] = 0.f;
        v++;
        c = 0;
        c0 = chunk0(s.v0 + v);
      }
    }
  }
  __syncthreads();  // every piece stored
  const int n = nunits * kSteps;
  constexpr int kGroups = (kB + kCols - 1) / kCols;
  static_assert(kGroups * kCols <= kBc, "slot groups within a piece's columns");
  for (int idx = threadIdx.x; idx < nunits * 16 * kGroups; idx += MK_THREADS) {
    const int v = idx / (16 * kGroups), r = idx / kGroups % 16, c = idx % kGroups;
    float sums[kMats * kCols];
#pragma unroll
    for (int m = 0; m < kMats * kCols; m++) sums[m] = 0.f;
    for (int u = 0; u < kStreamWarps; u++)  // in warp order: deterministic
      if (piece_of<kSteps>(n, u, v)) {
        const float* P = s_piece + (u + v) * kPiece;
#pragma unroll
        for (int m = 0; m < kMats; m++)
#pragma unroll
          for (int j = 0; j < kCols; j++) sums[m * kCols + j] += P[(16 * m + r) * kBc + c * kCols + j];
      }
    epi(v, r, c, sums);
  }
  __syncthreads();
}

// The block's unit count of a matrix of `units` (tile_share's v1 - v0).
MK_DEVICE int block_units(int units) {
  return (int)((unsigned)units * (blockIdx.x + 1) / gridDim.x) - (int)((unsigned)units * blockIdx.x / gridDim.x);
}

#if MK_MMA_QKV
// mma_qkv: this block's QKV units (tile t, k-split part k: unit t * S + k, layout_mma.pack_rows) on the
// normed x in B-fragment order; unit sums go to qkv_part[row * S + k] as the CUDA-core phase's do.
MK_DEVICE void qkv_mma(WeightStream& st, const MkParams& p, float* s_act, unsigned live) {
  const int v0 = (int)((unsigned)kQkvTiles * blockIdx.x / gridDim.x);
  block_mma<1, kQkvSteps>(st, p, s_act, st.gw >= 0 ? tile_share(st.gw, kQkvTiles, kQkvSteps) : TileShare{0, 0, 0},
                          block_units(kQkvTiles), [](int v) { return v % MK_S_QKV * kQkvSteps; },
                          s_act + kPieceOff, [&](int v, int r, int b, const float* sum) {
    const int u = v0 + v, row = u / MK_S_QKV * 16 + r;
    if (slot_on(live, b)) slot_qkv(p, b)[(long long)row * MK_S_QKV + u % MK_S_QKV] = sum[0];
  });
}
#endif
#endif
