// Layout option mma_mlp (batch builds; replicas/layout_mma_mlp.py): the fused gate/up -> down of mk_fused.cuh
// on tensor cores. On CUDA cores every extra slot costs its own FMAs and shared-memory input reads for every
// weight (csrc/NOTES.md "Batch speed"); one mma.m16n8k16 serves all 8 slot columns for the price of one.
//
//   gate/up  block b's 16-row tiles of the packed gate/up (layout_mma.pack_gate_up), k-split over the block's
//            warps (mk_block_mma.cuh block_mma); h = SiLU(gate) * up, as bf16 in B-fragment order
//   down     warp w owns output tiles [o0, o1) (16 hidden rows) over the block's h slice (dn_share), and adds
//            each finished tile's 16 x B sums to the int64 accumulator straight from its registers
//   pair_dn  blocks 2p, 2p + 1 (one cluster) write their h into both blocks' shared memory; each then downs half
//            the output tiles over the pair's h rows: half the atomics, whose drain through the L2's atomic
//            units (not the issuing warps) is what the batch down costs (csrc/NOTES.md, session 14)
// Inputs: the post-attention RMSNorm writes every slot's normed x as bf16 in B-fragment order (frag_half), so
// each k-step is one 8-byte load per lane for all slots. Unlike the CUDA-core path, x and h are rounded to
// bf16 (tests compare within the transformers tolerance).
#pragma once
#include "mk_common.cuh"
#include "mk_layout.cuh"
#include "mk_stream.cuh"
#include "mk_fused.cuh"
#include "mk_block_mma.cuh"
#include "mk_timeline.cuh"

#if MK_MMA_MLP
// After the ln2 prologue stored the normed x in B-fragment order at s_act: this block's gate/up and down.
MK_DEVICE void fused_mlp_mma(WeightStream& st, const MkParams& p, float* s_act, unsigned turn, unsigned live
                             MK_TL_PARAM) {
  const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  uint16_t* s_hf = reinterpret_cast<uint16_t*>(s_act + kFxH);
  const int nt = block_units((int)(MK_I / 16));  // the block's gate/up tiles (gu_row0 / 16)
#if MK_PAIR_DN
  // The pair's h rows in both blocks' shared memory, rank 0's tiles first: rank 1's start after its peer's.
  static_assert(MK_CLUSTER == 2, "pair_dn: clusters of two blocks");
  const unsigned rank = __clusterRelativeBlockRank();
  uint16_t* peer_hf = static_cast<uint16_t*>(__cluster_map_shared_rank(s_hf, rank ^ 1u));
  const int koff = rank ? (int)((unsigned)(MK_I / 16) * blockIdx.x / gridDim.x)
                          - (int)((unsigned)(MK_I / 16) * (blockIdx.x - 1) / gridDim.x) : 0;
#else
  constexpr int koff = 0;
#endif
  block_mma<2, kKS>(st, p, s_act, st.gw >= 0 ? gu_share(st.gw) : TileShare{0, 0, 0}, nt,
                    [](int) { return 0; }, s_act + kPieceOff, [&](int t, int r, int b, const float* gu) {
    const float h = slot_on(live, b) ? gu[0] / (1.f + __expf(-gu[0])) * gu[1] : 0.f;
    const int i = frag_half(b, (koff + t) * 16 + r);
    s_hf[i] = f32_to_bf16(h);
#if MK_PAIR_DN
    peer_hf[i] = s_hf[i];
#endif
  });
#if MK_PAIR_DN
  cluster_sync();  // both blocks' h slices in both blocks (the peer is past the O barrier: its h region is free)
#endif
  MK_TL_AT(tl, 12);  // (the h slice is complete)
  if (st.gw >= 0) {
    const DnShare s = dn_share(st.gw);
    const bool has_slot = g < kB;
    const uint2* hf = reinterpret_cast<const uint2*>(s_hf);
#pragma unroll 1
    for (int o = s.o0; o < s.o1; o++) {
      float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 2
      for (int k = 0; k < s.nt; k++) {
        const uint2 x = has_slot ? hf[k * 4 * kB + lane] : make_uint2(0u, 0u);
        const uint4 a = st.take();
        mma_16816(d, a, x);
        st.release(p);
      }
      // lane (g, tq): hidden rows 16 o + g (d0, d1) and 16 o + g + 8 (d2, d3), slots 2 tq and 2 tq + 1
#if MK_FX_PACK
      if (2 * tq < kB && row_on(live, tq)) {  // (fx_pack: the pair's two sums in one atomic, accumulator row tq)
#pragma unroll
        for (int h = 0; h < 2; h++)
          atomicAdd(reinterpret_cast<unsigned long long*>(fx_acc(p, turn, tq) + 16 * o + g + 8 * h),
                    pack_slots(slot_on(live, 2 * tq) ? d[2 * h] : 0.f, slot_on(live, 2 * tq + 1) ? d[2 * h + 1] : 0.f));
      }
#else
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int b = 2 * tq + (e & 1);
        if (b < kB && slot_on(live, b))
          atomicAdd(reinterpret_cast<unsigned long long*>(fx_acc(p, turn, b) + 16 * o + g + 8 * (e >> 1)),
                    (unsigned long long)__float2ll_rn(d[e] * kFxScale));
      }
#endif
    }
  }
  MK_TL_AT(tl, 13);
}
#endif  // MK_MMA_MLP
