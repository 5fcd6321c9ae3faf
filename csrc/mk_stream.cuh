// The weight stream: each warp keeps MK_RING 16-byte-per-lane cp.async loads in flight through a
// ring in shared memory, walking its own contiguous share of every matrix in the order the phases
// consume them (LM head, then per layer QKV, O, GU, DN, then the next step's LM head...). Weights
// do not depend on activations, so the ring runs ahead across phase ends and grid barriers: while
// a warp waits at a barrier its next phase's weights are already arriving.
#pragma once
#include "mk_common.cuh"
#include "mk_layout.cuh"

MK_DEVICE void mat_info(const MkParams& p, int mat, int layer, const uint16_t*& base,
                        long long& units, int& len) {
  switch (mat) {
    case MAT_QKV: base = p.w_qkv + layer * kStrideQKV; units = kSUnitsQKV; len = kLenQKV * kRowsPerUnit; break;
    case MAT_O: base = p.w_o + layer * kStrideO; units = kSUnitsO; len = kLenO * kRowsPerUnit; break;
    case MAT_GU: base = p.w_gu + layer * kStrideGU; units = kSUnitsGU; len = kLenGU * kRowsPerUnit; break;
    case MAT_DN: base = p.w_dn + layer * kStrideDN; units = kSUnitsDN; len = kLenDN; break;
    default: base = p.w_lm; units = kSUnitsLM; len = kLenLM * kLmTile; break;
  }
}

// This warp's contiguous unit range [u0, u1) of a matrix with `units` units.
MK_DEVICE void warp_range(long long units, int gw, int nw, long long& u0, long long& u1) {
#if MK_DIV32
  // the same quotients in 32-bit arithmetic (units < 2^20, nw <= 4096: no product overflows); a
  // 64-bit division is a ~70-instruction call the profiler found on every run switch and phase start
  if (units < (1LL << 20) && nw <= 4096) {
    const unsigned u = (unsigned)units;
    u0 = (u * (unsigned)gw) / (unsigned)nw;
    u1 = (u * (unsigned)(gw + 1)) / (unsigned)nw;
    return;
  }
#endif
  u0 = units * gw / nw;
  u1 = units * (gw + 1) / nw;
}

#ifndef MK_O_ALIGN
#define MK_O_ALIGN 0  // layout option o_align (fused_attn_o; flag emitted only when on)
#endif
// This warp's unit range of matrix `mat`: warp_range, except that with MK_O_ALIGN the O units (kv-group
// major, fused_attn_o) are dealt per kv group to whole blocks, blocks [g*nb/NKV, (g+1)*nb/NKV) serving
// group g. Evenly dealt, the blocks straddling a group boundary waited for two groups' attention and
// staged both: the timeline probe found them last at the O barrier in 98% of layers (~2 µs late).
MK_DEVICE void mat_range(int mat, long long units, int gw, int nw, long long& u0, long long& u1) {
#if MK_O_ALIGN
  if (mat == MAT_O && (int)gridDim.x >= MK_NKV) {
    const int nb = (int)gridDim.x, b = gw / kStreamWarps, w = gw % kStreamWarps;
    int g = 0;
    while ((g + 1) * nb / MK_NKV <= b) g++;
    const int b0 = g * nb / MK_NKV, b1 = (g + 1) * nb / MK_NKV;
    const int per = (int)(units / MK_NKV), lw = (b - b0) * kStreamWarps + w, nlw = (b1 - b0) * kStreamWarps;
    u0 = (long long)g * per + per * lw / nlw;
    u1 = (long long)g * per + per * (lw + 1) / nlw;
    return;
  }
#endif
  (void)mat;
  warp_range(units, gw, nw, u0, u1);
}

// First gate/up row of block b: its warps' contiguous share of the gate/up units starts there
// (replicas/layout_fused.py block_rows).
// (mma and mma_mlp: whole 16-row tiles, replicas/layout_fused.py gu_tile)
template <class Int>  // (int or blockIdx.x's unsigned: the caller's type, so default builds compile as before)
MK_DEVICE long long gu_row0(Int b) {
#if MK_DIV32
  static_assert(kGuUnits < (1LL << 20), "32-bit gate/up row split");
  return (long long)((unsigned)kGuUnits * (unsigned)b / gridDim.x) * kGuTile;
#else
  return kGuUnits * b / gridDim.x * kGuTile;
#endif
}

#if MK_MMA_MLP || MK_MMA_QKV || MK_MMA_O
// Block-tiled tensor-core matvecs (mk_block_mma.cuh; replicas/layout_mma_mlp.py tile_share): block b owns the
// units [U b / nb, U (b + 1) / nb) of a matrix of U units (16-row tiles, or k-split parts of tiles), `steps` 16-k
// steps each; warp w of the block takes the (unit, step) pairs [q0, q1) of the block's, counted from its first
// unit v0 (a k-split within the block: the units' partial sums meet in shared memory).
struct TileShare { int v0, q0, q1; };
MK_DEVICE TileShare tile_share(int gw, int units, int steps) {
  const int b = gw / kStreamWarps, w = gw % kStreamWarps;
  const int v0 = (int)((unsigned)units * (unsigned)b / gridDim.x);
  const int n = ((int)((unsigned)units * (unsigned)(b + 1) / gridDim.x) - v0) * steps;
  return {v0, n * w / kStreamWarps, n * (w + 1) / kStreamWarps};
}
#endif
#if MK_MMA_O
// mma_o: as o_align deals O rows, blocks [g nb / NKV, (g + 1) nb / NKV) serve kv group g; within them each block
// owns whole tiles [v0, v1) of the group's (global unit g * kOTiles + t; layout_mma_mlp.o_block_units).
MK_DEVICE void o_block_units(int b, int& v0, int& v1) {
  const int nb = (int)gridDim.x;
  int g = 0;
  while ((g + 1) * nb / MK_NKV <= b) g++;
  const int b0 = g * nb / MK_NKV, n = (g + 1) * nb / MK_NKV - b0;
  v0 = g * kOTiles + kOTiles * (b - b0) / n;
  v1 = g * kOTiles + kOTiles * (b - b0 + 1) / n;
}
MK_DEVICE TileShare o_share(int gw) {
  const int w = gw % kStreamWarps;
  int v0, v1;
  o_block_units(gw / kStreamWarps, v0, v1);
  const int n = (v1 - v0) * kOSteps;
  return {v0, n * w / kStreamWarps, n * (w + 1) / kStreamWarps};
}
#endif
#if MK_MMA_MLP
// mma_mlp's gate/up: the units are the block's gate/up tiles (gu_row0 / 16), a step one gate and one up chunk.
MK_DEVICE TileShare gu_share(int gw) { return tile_share(gw, (int)(MK_I / 16), kKS); }
// The down of block b (layout_mma_mlp.dn_share): its h rows [js, js + 16 nt) are nt k-steps; warp w owns the
// output tiles [o0, o1) (16 hidden rows each) over all of them, stored (tile, k-step) in A-fragment order
// from element js * H of the layer's packed down.
// pair_dn: the h rows are the pair's (blocks b & ~1 and b | 1), and rank r owns half r of the output tiles.
struct DnShare { int js, nt, o0, o1; };
MK_DEVICE DnShare dn_share(int gw) {
  const int b = gw / kStreamWarps, w = gw % kStreamWarps;
#if MK_PAIR_DN
  const int js = (int)gu_row0(b & ~1), je = (int)gu_row0((b | 1) + 1), r = b & 1;
  const int a = (MK_H / 16) * r / 2, n = (MK_H / 16) * (r + 1) / 2 - a;
#else
  const int js = (int)gu_row0(b), je = (int)gu_row0(b + 1), a = 0, n = MK_H / 16;
#endif
  return {js, (je - js) / 16, a + n * w / kStreamWarps, a + n * (w + 1) / kStreamWarps};
}
#endif

#if MK_FUSED_MLP
// This warp's run of the fused down (mirror of replicas/layout_fused.py:warp_down_share): rows
// [a, a+n) of its block's h slice, chunk columns [col0, col0 + MK_FX_M), element offset `off`.
struct DownShare { int a, n, col0; long long off; };
MK_DEVICE DownShare down_share(int gw) {
  const int b = gw / kStreamWarps, w = gw % kStreamWarps;
  const int js = (int)gu_row0(b), je = (int)gu_row0(b + 1);
  const int nb = je - js, r = w / MK_FX_WC, cw = w % MK_FX_WC;
  DownShare s;
  s.a = nb * r / MK_FX_R;
  s.n = nb * (r + 1) / MK_FX_R - s.a;
  s.col0 = cw * MK_FX_M;
  s.off = (long long)(js + s.a) * MK_HP + (long long)s.col0 * s.n * kChunk;
  return s;
}
#endif

struct WeightStream {
  uint4* ring;     // this warp's MK_RING slots of 32 x 16 bytes
  int slot;        // next slot to consume (== next slot to refill)
  int lane, gw, nw;
  // producer cursor
  int mat, layer;
  const uint16_t* ptr;
  long long left;  // chunks left in the current run; 0 with mat < 0 => this warp streams nothing
  unsigned long long policy;  // L2 eviction policy of streamed weights (MK_EVICT_FIRST)

  MK_DEVICE void next_run(const MkParams& p) {
    for (int tries = 0; tries <= 4 * MK_L + 1; tries++) {
      if (mat == MAT_LM) { mat = MAT_QKV; layer = 0; }
      else if (mat == MAT_DN) { if (++layer == MK_L) mat = MAT_LM; else mat = MAT_QKV; }
      else mat++;
#if MK_MMA_O
      if (mat == MAT_O) {
        const TileShare s = o_share(gw);
        if (s.q1 > s.q0) { ptr = p.w_o + layer * kStrideO + ((long long)s.v0 * kOSteps + s.q0) * kChunk; left = s.q1 - s.q0; return; }
        continue;
      }
#endif
#if MK_MMA_QKV
      if (mat == MAT_QKV) {
        const TileShare s = tile_share(gw, kQkvTiles, kQkvSteps);
        if (s.q1 > s.q0) { ptr = p.w_qkv + layer * kStrideQKV + ((long long)s.v0 * kQkvSteps + s.q0) * kChunk; left = s.q1 - s.q0; return; }
        continue;
      }
#endif
#if MK_MMA_MLP
      if (mat == MAT_GU) {
        const TileShare s = gu_share(gw);
        if (s.q1 > s.q0) { ptr = p.w_gu + layer * kStrideGU + ((long long)s.v0 * kKS + s.q0) * 2 * kChunk; left = 2LL * (s.q1 - s.q0); return; }
        continue;
      }
      if (mat == MAT_DN) {
        const DnShare s = dn_share(gw);
        if (s.o1 > s.o0 && s.nt > 0) {
          ptr = p.w_dn + layer * kStrideDN + (long long)s.js * MK_H + (long long)s.o0 * s.nt * kChunk;
          left = (long long)(s.o1 - s.o0) * s.nt;
          return;
        }
        continue;
      }
#elif MK_FUSED_MLP
      if (mat == MAT_DN) {
        const DownShare s = down_share(gw);
        if (s.n > 0) { ptr = p.w_dn + layer * kStrideDN + s.off; left = (long long)s.n * MK_FX_M; return; }
        continue;
      }
#endif
      const uint16_t* base; long long units, u0, u1; int len;
      mat_info(p, mat, layer, base, units, len);
      mat_range(mat, units, gw, nw, u0, u1);
      if (u1 > u0) { ptr = base + u0 * len; left = (u1 - u0) * (len / kChunk); return; }
    }
    mat = -1; left = 0;  // no share anywhere (tiny models on a big grid)
  }

  MK_DEVICE void issue(const MkParams& p) {
    if (left > 0) {
      if (MK_EVICT_FIRST) cp_async16_hint(ring + slot * 32 + lane, ptr + lane * 8, policy);
      else cp_async16(ring + slot * 32 + lane, ptr + lane * 8);
      ptr += kChunk;
      if (--left == 0) next_run(p);
    }
    cp_async_commit();  // always one group per slot so wait_group counts stay exact
  }

  MK_DEVICE void init(const MkParams& p, uint4* warp_ring) {
    ring = warp_ring; lane = threadIdx.x & 31;
    policy = MK_EVICT_FIRST ? l2_evict_first_policy() : 0ull;
    nw = gridDim.x * kStreamWarps;
    if ((threadIdx.x >> 5) >= kStreamWarps) {  // the control warp: no share of any matrix
      gw = -1; mat = -1; left = 0; slot = 0;
      return;
    }
    gw = blockIdx.x * kStreamWarps + (threadIdx.x >> 5);
    mat = MAT_DN; layer = MK_L - 1;  // so the first run is the LM head
    next_run(p);
    for (slot = 0; slot < MK_RING; slot++) issue(p);
    slot = 0;
  }

  // Wait for the oldest chunk, hand this lane's 16 bytes to the caller.
  MK_DEVICE uint4 take() {
    cp_async_wait<MK_RING - 1>();
    return ring[slot * 32 + lane];
  }
  // The two oldest chunks at once (both slots stay held until two release() calls).
  MK_DEVICE void take2(uint4& w0, uint4& w1) {
    cp_async_wait<MK_RING - 2>();
    w0 = ring[slot * 32 + lane];
    w1 = ring[(slot + 1 == MK_RING ? 0 : slot + 1) * 32 + lane];
  }
  // After the taken value has been used: refill the slot with the chunk MK_RING ahead.
  MK_DEVICE void release(const MkParams& p) {
    issue(p);
    slot = (slot + 1 == MK_RING) ? 0 : slot + 1;
  }
};

// The uint16 index of slot b's element i in mma.m16n8k16 B-fragment order: per 16-element chunk c, lane
// 4b + t holds k = 2t, 2t+1 in its first 32-bit word and 2t+8, 2t+9 in its second (replicas/layout_mma.py
// act_word), so one 8-byte load per lane, uint2 index c * 4 * kB + lane, is every slot's fragment.
MK_DEVICE int frag_half(int b, int i) {
  const int c = i >> 4, r = i & 15;
  return ((c * 4 * kB + b * 4 + ((r & 7) >> 1)) * 2 + (r >> 3)) * 2 + (r & 1);
}

// Matvec input element i of slot b into shared memory, where run_phase reads it: fp32 at xpos(i) of
// the slot's vector, or (MK_MMA) bf16 in mma.m16n8k16 B-fragment order: per 16-element chunk c, lane
// 4b + t of the warp holds k = 2t, 2t+1 in its first 32-bit word and 2t+8, 2t+9 in its second
// (replicas/layout_mma.py act_word), so one 8-byte load per lane is every slot's fragment.
// `base` (a multiple of 256: a kv group's first element of the O input) + i is the element.
MK_DEVICE void act_store(float* s_act, int b, int i, float v, int base = 0) {
#if MK_MMA
  reinterpret_cast<uint16_t*>(s_act)[frag_half(b, i + base)] = f32_to_bf16(v);
#elif MK_ACT_BF16
  // batch builds with act_bf16: bf16 in element order from the slot vector's start (a lane's 8 inputs of a
  // chunk are then one 16-byte word, and a warp's loads of a chunk 512 contiguous bytes)
  reinterpret_cast<uint16_t*>(s_act)[2 * b * kActVec + base + i] = f32_to_bf16(v);
#else
  s_act[b * kActVec + base + xpos(i)] = v;
#endif
}

// One matvec phase: this warp's units of matrix MAT dotted with the activation vector in shared
// memory (batch builds: each slot's vector, kActVec floats apart: one weight pass for all slots);
// `epi(unit, acc0, acc1)` runs on lane 0 for every finished unit with one sum per slot (acc1: GU's up row).
// `live`: the slots to compute (batch builds skip finished ones; their sums are then left at 0).
MK_DEVICE bool slot_on(unsigned live, int b) { return kB == 1 || ((live >> b) & 1u); }

#if MK_MMA || MK_MMA_MLP || MK_MMA_LM || MK_MMA_QKV || MK_MMA_O
// d += a (16 x 16 weights, A fragment) * b (16 k x 8 slots, B fragment), fp32 accumulators.
MK_DEVICE void mma_16816(float (&d)[4], const uint4& a, const uint2& b) {
#ifdef MK_EMU
  mk_emu_mma_16816(d, a, b);
#else
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b.x), "r"(b.y));
#endif
}
#endif

#if MK_MMA || MK_MMA_LM
// Lane r < 16 collects row r of a 16 x 8 accumulator tile for every slot: row r's values sit in lanes
// 4(r & 7) + b/2 (c0/c1 for rows 0..7, c2/c3 for rows 8..15; even slots in c0/c2).
MK_DEVICE void tile_row(const float (&d)[4], int lane, float* out) {
  const int r = lane & 15;
#pragma unroll
  for (int b = 0; b < kB; b++) {
    const float lo = __shfl_sync(0xffffffffu, (b & 1) ? d[1] : d[0], 4 * (r & 7) + (b >> 1));
    const float hi = __shfl_sync(0xffffffffu, (b & 1) ? d[3] : d[2], 4 * (r & 7) + (b >> 1));
    out[b] = r < 8 ? lo : hi;
  }
}

// The tensor-core matvec (layout option mma, replicas/layout_mma.py): a unit is 16 rows over its k
// range; per 16-k step one weight chunk (gate/up: the gate chunk, then the up chunk) and every slot's
// input fragment, one mma. Then lanes 0..15 hand row r's sums to `epi` with the row-unit index the
// CUDA-core phase would use (QKV: row * S + split; O: group * H + row), so the epilogues are shared.
template <int MAT, class Epi>
MK_DEVICE void run_phase_mma(WeightStream& st, const MkParams& p, int layer, const float* s_act, Epi epi,
                             unsigned live = 1u) {
  (void)live;  // every slot column is computed; the epilogues skip finished slots
  if (st.gw < 0) return;
  const uint16_t* base; long long units, u0, u1; int len;
  mat_info(p, MAT, layer, base, units, len);
  mat_range(MAT, units, st.gw, st.nw, u0, u1);
  constexpr int kSplit = MAT == MAT_QKV ? MK_S_QKV : 1;
  constexpr int kSteps = (MAT == MAT_QKV ? kLenQKV : MAT == MAT_O ? kLenO : MAT == MAT_GU ? MK_HP : kLenLM) / 16;
  constexpr long long kTilesPerGroup = MK_H / 16;  // O units per kv group
  const uint2* frag = reinterpret_cast<const uint2*>(s_act);
  const bool has_slot = (st.lane >> 2) < kB;  // lanes 4b..4b+3 carry slot b's input fragment
  for (long long v = u0; v < u1; v++) {
    long long row0;  // the unit's first row-unit index
    int c0;          // its first input chunk (16 elements)
    if (MAT == MAT_O) {
      const long long g = v / kTilesPerGroup;
      row0 = g * MK_H + (v % kTilesPerGroup) * 16;
      c0 = (int)g * (kLenO / 16);
    } else {
      row0 = (v / kSplit) * 16;
      c0 = (int)(v % kSplit) * kSteps;
    }
    float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 2
    for (int c = 0; c < kSteps; c++) {
      const uint2 x = has_slot ? frag[(c0 + c) * 4 * kB + st.lane] : make_uint2(0u, 0u);
      const uint4 w = st.take();
      mma_16816(d0, w, x);
      st.release(p);
      if (MAT == MAT_GU) {
        const uint4 wu = st.take();
        mma_16816(d1, wu, x);
        st.release(p);
      }
    }
    float acc0[kB], acc1[kB];
    tile_row(d0, st.lane, acc0);
    if (MAT == MAT_GU) tile_row(d1, st.lane, acc1);
    const long long row = row0 + (st.lane & 15);
    if (st.lane < 16 && (MAT != MAT_LM || row < MK_V)) epi(MAT == MAT_QKV ? row * kSplit + v % kSplit : row, acc0, acc1);
  }
}
#endif
#if MK_MMA
template <int MAT, class Epi>
MK_DEVICE void run_phase(WeightStream& st, const MkParams& p, int layer, const float* s_act, Epi epi,
                         unsigned live = 1u) {
  run_phase_mma<MAT>(st, p, layer, s_act, epi, live);
}
#else
template <int MAT, class Epi>
MK_DEVICE void run_phase(WeightStream& st, const MkParams& p, int layer, const float* s_act, Epi epi,
                         unsigned live = 1u) {
#if MK_MMA_LM
  if constexpr (MAT == MAT_LM) {  // (mma_lm: the LM head's input is in B-fragment order, its units tiles)
    run_phase_mma<MAT>(st, p, layer, s_act, epi, live);
    return;
  }
#endif
  if (st.gw < 0) return;
  const uint16_t* base; long long units, u0, u1; int len;
  mat_info(p, MAT, layer, base, units, len);
  mat_range(MAT, units, st.gw, st.nw, u0, u1);
  constexpr int kSplit = MAT == MAT_QKV ? MK_S_QKV : MAT == MAT_O ? MK_S_O : MAT == MAT_DN ? MK_S_DN : 1;
  constexpr int kLen = MAT == MAT_QKV ? kLenQKV : MAT == MAT_O ? kLenO : MAT == MAT_DN ? kLenDN
                       : MAT == MAT_GU ? kLenGU : kLenLM;
  constexpr int kChunks = kLen / kChunk;
  const int lane8 = st.lane * kXLane;  // this lane's input offset in a chunk (mk_common.cuh xpos)
  for (long long u = u0; u < u1; u++) {
#if MK_ATTN_O
    // O units (group g, row): group g's staged attention output sits at s_act + g * kLenO
    const int xoff = MAT == MAT_O ? (int)(u / MK_H) * kLen : kSplit > 1 ? (int)(u % kSplit) * kLen : 0;
#else
    const int xoff = kSplit > 1 ? (int)(u % kSplit) * kLen : 0;
#endif
#if MK_ACT_BF16
    // slot b's 8 inputs of chunk c: one 16-byte load (act_store's bf16 layout)
    const uint16_t* xh16 = reinterpret_cast<const uint16_t*>(s_act) + xoff + st.lane * 8;
#define MK_XIN(b, c) (*reinterpret_cast<const uint4*>(xh16 + (b) * 2 * kActVec + (c) * kChunk))
#define MK_DOTX(w, b, c) dot8b(w, MK_XIN(b, c))
#else
    const float* x = s_act + xoff + lane8;
#define MK_DOTX(w, b, c) dot8(w, x + (b) * kActVec + (c) * kChunk)
#endif
    float acc0[kB], acc1[kB];
#pragma unroll
    for (int b = 0; b < kB; b++) { acc0[b] = 0.f; acc1[b] = 0.f; }
    if (MAT == MAT_GU && MK_GU_IL) {
#if MK_GU_IL
      // gate chunk c and up chunk c are adjacent in the stream (monokernel_weights.interleave_gate_up):
      // each slot's input is loaded once for both; the sums run in the same order as below
#pragma unroll 2
      for (int c = 0; c < kChunks / 2; c++) {
        uint4 wg, wu;
        st.take2(wg, wu);
#pragma unroll
        for (int b = 0; b < kB; b++) {
          if (!slot_on(live, b)) continue;
#if MK_ACT_BF16
          const uint4 xin = MK_XIN(b, c);
          acc0[b] += dot8b(wg, xin);
          acc1[b] += dot8b(wu, xin);
#else
          const float* xb = x + b * kActVec + c * kChunk;
          const float4 xa = *reinterpret_cast<const float4*>(xb);
          const float4 xh = *reinterpret_cast<const float4*>(xb + kXHi);
          acc0[b] += dot8v(wg, xa, xh);
          acc1[b] += dot8v(wu, xa, xh);
#endif
        }
        st.release(p);
        st.release(p);
      }
#endif
    } else if (MAT == MAT_GU) {
#pragma unroll 2
      for (int c = 0; c < kChunks / 2; c++) {
        const uint4 w = st.take();
#pragma unroll
        for (int b = 0; b < kB; b++) if (slot_on(live, b)) acc0[b] += MK_DOTX(w, b, c);
        st.release(p);
      }
#pragma unroll 2
      for (int c = 0; c < kChunks / 2; c++) {
        const uint4 w = st.take();
#pragma unroll
        for (int b = 0; b < kB; b++) if (slot_on(live, b)) acc1[b] += MK_DOTX(w, b, c);
        st.release(p);
      }
    } else {
#pragma unroll 2
      for (int c = 0; c < kChunks; c++) {
        const uint4 w = st.take();
#pragma unroll
        for (int b = 0; b < kB; b++) if (slot_on(live, b)) acc0[b] += MK_DOTX(w, b, c);
        st.release(p);
      }
    }
#undef MK_DOTX
#undef MK_XIN
#pragma unroll
    for (int b = 0; b < kB; b++) {
      if (!slot_on(live, b)) continue;
      acc0[b] = warp_sum(acc0[b]);
      if (MAT == MAT_GU) acc1[b] = warp_sum(acc1[b]);
    }
    if (st.lane == 0) epi(u, acc0, acc1);
  }
}
#endif  // MK_MMA

// Ask L2 to fetch the first `bytes` of this warp's share of matrix MAT (layer `layer`), without
// waiting: used while the latency-bound attention chain leaves HBM idle.
template <int MAT>
MK_DEVICE void l2_prefetch(const WeightStream& st, const MkParams& p, int layer, int bytes) {
  if (bytes <= 0 || st.gw < 0) return;
  const uint16_t* base; long long units, u0, u1; int len;
  mat_info(p, MAT, layer, base, units, len);
  mat_range(MAT, units, st.gw, st.nw, u0, u1);
  const long long n = min((long long)bytes, (u1 - u0) * len * 2);
  const long long piece = ((n + 31) / 32 + 15) & ~15LL;
  const long long off = st.lane * piece;
  if (off < n) {
    const unsigned size = (unsigned)min(piece, n - off);
    const char* src = reinterpret_cast<const char*>(base + u0 * len) + off;
#ifndef MK_EMU  // (a hint: nothing to emulate)
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(size) : "memory");
#endif
  }
}
