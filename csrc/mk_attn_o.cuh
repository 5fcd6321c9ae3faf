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
#include "mk_batch.cuh"
#include "mk_block_mma.cuh"
#include "mk_fx_pack.cuh"

constexpr float kAoScale = 4294967296.f;  // 2^32, as fused_mlp's accumulators
constexpr float kAoInv = 1.f / 4294967296.f;
static_assert(MK_TP == 1, "fused_attn_o is single-GPU only (layout_attn_o.attn_o_error)");
// split-weight scratch after the staged O inputs (batch builds: after every slot's)
constexpr int kAoW = MK_BATCH > 1 ? kVecFloats : MK_NKV * MK_AO_GDP;
static_assert(kAoW + 2 * kGroup * MK_MAX_SPLITS <= MK_ACT_FLOATS, "fused_attn_o staging");
static_assert(MK_BATCH == 1 || MK_NKV * MK_AO_GDP <= kActVec, "a slot's O input fits its vector");

// o_part: one int64 [Hp] accumulator row per slot (fx_pack: per pair of slots, mk_fx_pack.cuh)
MK_DEVICE long long* ao_acc(const MkParams& p, int c = 0) { return reinterpret_cast<long long*>(p.o_part) + (long long)c * MK_HP; }

// Group g's split weights into s_w[h * nsplit + s] (softmax over the splits' maxima and sums; partials from
// index sb on), through shared memory; ends with a block barrier.
MK_DEVICE void ao_split_weights(const MkParams& p, int nsplit, int g, long long sb, float* s_w) {
  const int tid = threadIdx.x, cap = split_capacity();
  for (int i = tid; i < kGroup * nsplit; i += MK_THREADS) {
    const int h = i / nsplit, s = i % nsplit;
    const long long b = sb + ((long long)g * cap + s) * kGroup + h;
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
}

// combine_attention restricted to kv group g (same arithmetic, so the same values), staged as slot
// `slot`'s matvec input elements [g * GDp, (g + 1) * GDp) (zero padded; act_store); split weights in scratch s_w.
MK_DEVICE void ao_combine_group(const MkParams& p, int nsplit, int g, float* s_act, float* s_w, int slot = 0) {
  const int tid = threadIdx.x, cap = split_capacity();
  const long long sb = (long long)slot * MK_NKV * cap * kGroup;  // the slot's first partial
  ao_split_weights(p, nsplit, g, sb, s_w);
  for (int i = tid; i < MK_AO_GDP; i += MK_THREADS) {
    float acc = 0.f;
    if (i < kGroup * MK_D) {
      const int h = i / MK_D, d = i % MK_D;
      const float* o = p.attn_o + (sb + (long long)g * cap * kGroup + h) * MK_D + d;
#pragma unroll 4
      for (int s = 0; s < nsplit; s++) acc += s_w[h * nsplit + s] * __ldcg(o + (long long)s * kGroup * MK_D);
    }
    act_store(s_act, slot, i, acc, g * MK_AO_GDP);
  }
  __syncthreads();
}

#ifndef MK_AO_PRELOAD
#define MK_AO_PRELOAD 0  // layout option ao_preload (single-sequence builds; flag emitted only when on)
#endif
#if MK_AO_PRELOAD
static_assert(MK_BATCH == 1, "ao_preload: single-sequence builds (batch builds stage slots with ao_slots)");
// ao_combine_group with the split outputs loaded before the split statistics' round trip instead of after it
// (both are L2 reads of what the attention blocks published; the timeline probe measured the O stage at 2.5 µs
// per layer). kParts threads share an output element (even / odd splits when the block has 2 per element),
// each holding up to kPre splits in registers; their sums are added in part order (deterministic; with one part
// the same order as ao_combine_group).
constexpr int kAoParts = MK_THREADS >= 2 * MK_AO_GDP ? 2 : 1;
constexpr int kAoPre = 16 / kAoParts;
static_assert(kAoW + 2 * kGroup * MK_MAX_SPLITS + MK_AO_GDP <= MK_ACT_FLOATS, "ao_preload scratch");
MK_DEVICE void ao_combine_group_pre(const MkParams& p, int nsplit, int g, float* s_act, float* s_w) {
  const int tid = threadIdx.x, cap = split_capacity();
  const int i = tid % MK_AO_GDP, part = tid / MK_AO_GDP, h = i / MK_D, d = i % MK_D;
  const bool mine = part < kAoParts && i < kGroup * MK_D;
  const float* o = p.attn_o + ((long long)g * cap * kGroup + h) * MK_D + d;
  float pre[kAoPre];
#pragma unroll
  for (int k = 0; k < kAoPre; k++) {
    const int s = part + k * kAoParts;
    pre[k] = mine && s < nsplit ? __ldcg(o + (long long)s * kGroup * MK_D) : 0.f;
  }
  ao_split_weights(p, nsplit, g, 0, s_w);
  float acc = 0.f;
  if (mine) {
#pragma unroll
    for (int k = 0; k < kAoPre; k++) {
      const int s = part + k * kAoParts;
      if (s < nsplit) acc += s_w[h * nsplit + s] * pre[k];
    }
    for (int s = part + kAoPre * kAoParts; s < nsplit; s += kAoParts)  // (more splits than registers)
      acc += s_w[h * nsplit + s] * __ldcg(o + (long long)s * kGroup * MK_D);
  }
  float* s_part = s_w + 2 * kGroup * MK_MAX_SPLITS;  // [GDp] the other parts' sums
  if (kAoParts > 1) {
    if (part == 1) s_part[i] = acc;
    __syncthreads();
    if (part == 0) acc += s_part[i];
  }
  if (part == 0) act_store(s_act, 0, i, acc, g * MK_AO_GDP);
  __syncthreads();
}
#endif

// Slot b's combined attention output element i of kv group g into its staged O input.
MK_DEVICE void ao_put(float* s_act, int b, int g, int i, float v) {
#if MK_MMA_O
  reinterpret_cast<uint16_t*>(s_act)[frag_half(b, g * MK_AO_GDP + i)] = f32_to_bf16(v);  // (o_mma's B operand)
#else
  act_store(s_act, b, i, v, g * MK_AO_GDP);
#endif
}

#ifndef MK_AO_SLOTS
#define MK_AO_SLOTS 0  // layout option ao_slots (batch builds; flag emitted only when on)
#endif
#if MK_BATCH > 1 && MK_AO_SLOTS
// ao_combine_group for every live slot at once (the same arithmetic per slot, so the same values): one
// round trip for all slots' split statistics and one for their partial outputs, instead of two per
// slot. Slot rank r (its place among the live slots) uses s_w[r * 2 * kGroup * S ..], S = cap / nlive
// (the most splits a slot has at this occupancy), so all fit the single-slot scratch.
MK_DEVICE void ao_combine_group_slots(const MkParams& p, int step, unsigned live, int g, float* s_act, float* s_w) {
  // (nl = 0 while a resident launch idles through empty layers: no slot to combine)
  const int tid = threadIdx.x, cap = split_capacity(), nl = __popc(live), S = max(1, cap / max(nl, 1));
  const long long per_slot = (long long)MK_NKV * cap * kGroup;  // partials of one slot
  for (int i = tid; i < nl * kGroup * S; i += MK_THREADS) {
    const int r = i / (kGroup * S), rem = i % (kGroup * S), h = rem / S, s = rem % S;
    const int b = __fns(live, 0, r + 1);  // the r-th live slot
    if (s >= num_splits(slot_pos(p, b, step) + 1, nl)) continue;
    const long long k = b * per_slot + ((long long)g * cap + s) * kGroup + h;
    float* w = s_w + r * 2 * kGroup * S;
    w[h * S + s] = __ldcg(p.attn_m + k);
    w[kGroup * S + h * S + s] = __ldcg(p.attn_l + k);
  }
  __syncthreads();
  for (int i = tid; i < nl * kGroup; i += MK_THREADS) {
    const int r = i / kGroup, h = i % kGroup, b = __fns(live, 0, r + 1);
    const int ns = num_splits(slot_pos(p, b, step) + 1, nl);
    float* w = s_w + r * 2 * kGroup * S;
    float M = -INFINITY, den = 0.f;
    for (int s = 0; s < ns; s++) M = fmaxf(M, w[h * S + s]);
    for (int s = 0; s < ns; s++) den += __expf(w[h * S + s] - M) * w[kGroup * S + h * S + s];
    for (int s = 0; s < ns; s++) w[h * S + s] = __expf(w[h * S + s] - M) / den;
  }
  __syncthreads();
  for (int j = tid; j < nl * MK_AO_GDP; j += MK_THREADS) {
    const int r = j / MK_AO_GDP, i = j % MK_AO_GDP, b = __fns(live, 0, r + 1);
    float acc = 0.f;
    if (i < kGroup * MK_D) {
      const int h = i / MK_D, d = i % MK_D, ns = num_splits(slot_pos(p, b, step) + 1, nl);
      const float* w = s_w + r * 2 * kGroup * S;
      const float* o = p.attn_o + (b * per_slot + (long long)g * cap * kGroup + h) * MK_D + d;
#pragma unroll 4
      for (int s = 0; s < ns; s++) acc += w[h * S + s] * __ldcg(o + (long long)s * kGroup * MK_D);
    }
    ao_put(s_act, b, g, i, acc);
  }
  __syncthreads();
}
#endif

#ifndef MK_AO_ONEPASS
#define MK_AO_ONEPASS 0  // layout option ao_onepass (ao_slots builds; flag emitted only when on)
#endif
#if MK_BATCH > 1 && MK_AO_SLOTS && MK_AO_ONEPASS
// ao_combine_group_slots in one dependent L2 round trip instead of two: each thread loads its element's split
// outputs together with its head's split maxima and sums (one address per warp and split: broadcast loads), four
// splits at a time, and merges them as an online softmax (running maximum, sums rescaled when it rises). With at
// most four splits (a B = 4 build at 4 slots) the maximum is the exact one of the two-pass form and only the fp32
// summation order differs. No shared scratch and no block barrier before the staged values.
MK_DEVICE void ao_combine_group_onepass(const MkParams& p, int step, unsigned live, int g, float* s_act) {
  const int tid = threadIdx.x, cap = split_capacity(), nl = __popc(live);
  const long long per_slot = (long long)MK_NKV * cap * kGroup;  // partials of one slot
  for (int j = tid; j < nl * MK_AO_GDP; j += MK_THREADS) {
    const int r = j / MK_AO_GDP, i = j % MK_AO_GDP, b = __fns(live, 0, r + 1);
    float acc = 0.f;
    if (i < kGroup * MK_D) {
      const int h = i / MK_D, d = i % MK_D, ns = num_splits(slot_pos(p, b, step) + 1, nl);
      const long long k0 = b * per_slot + (long long)g * cap * kGroup + h;  // split s's statistics at k0 + s * kGroup
      const float* o = p.attn_o + k0 * MK_D + d;                             // its output at o + s * kGroup * D
      float M = -INFINITY, den = 0.f;
      for (int s0 = 0; s0 < ns; s0 += 4) {
        float m[4], l[4], v[4];
#pragma unroll
        for (int t = 0; t < 4; t++) {
          const bool on = s0 + t < ns;
          const long long k = k0 + (long long)(s0 + t) * kGroup;
          m[t] = on ? __ldcg(p.attn_m + k) : -INFINITY;
          l[t] = on ? __ldcg(p.attn_l + k) : 0.f;
          v[t] = on ? __ldcg(o + (long long)(s0 + t) * kGroup * MK_D) : 0.f;
        }
        const float Mn = fmaxf(fmaxf(fmaxf(M, m[0]), fmaxf(m[1], m[2])), m[3]);  // finite: split s0 is on
        const float c = __expf(M - Mn);  // (0 on the first pass: M = -inf)
        den *= c;
        acc *= c;
#pragma unroll
        for (int t = 0; t < 4; t++) {
          const float e = __expf(m[t] - Mn);  // (0 for a split past ns)
          den += e * l[t];
          acc += e * v[t];
        }
        M = Mn;
      }
      acc /= den;
    }
    ao_put(s_act, b, g, i, acc);
  }
  __syncthreads();
}
#endif

// Every block, after its own attention items: wait for and stage the groups of its O units, for every
// live slot (slot b's at s_act + b * kActVec).
// `target` = splits per group published so far in this launch over all slots (attn_cnt never resets).
MK_DEVICE void ao_stage(const MkParams& p, int step, unsigned live, unsigned target, float* s_act) {
  long long u0, u1;
#if MK_MMA_O
  constexpr long long kPerGroup = kOTiles;  // (mma_o: the block's tiles, all of one group)
  {
    int v0, v1;
    o_block_units((int)blockIdx.x, v0, v1);
    u0 = v0, u1 = v1;
  }
#else
  const int nw = gridDim.x * kStreamWarps;
  long long t0, t1;
  constexpr long long kPerGroup = kSUnitsO / MK_NKV;  // stream units of one kv group (rows, or mma tiles)
  mat_range(MAT_O, kSUnitsO, blockIdx.x * kStreamWarps, nw, u0, t1);
  mat_range(MAT_O, kSUnitsO, blockIdx.x * kStreamWarps + kStreamWarps - 1, nw, t0, u1);
#endif
  if (u1 <= u0) return;  // no O units in this block (uniform over the block)
  float* s_w = s_act + kAoW;
  for (int g = (int)(u0 / kPerGroup); g <= (int)((u1 - 1) / kPerGroup); g++) {
    if (threadIdx.x == 0) wait_reach(p.attn_cnt + g, target);
    __syncthreads();
#if MK_BATCH > 1 && MK_AO_SLOTS && MK_AO_ONEPASS
    ao_combine_group_onepass(p, step, live, g, s_act);
#elif MK_BATCH > 1 && MK_AO_SLOTS
    ao_combine_group_slots(p, step, live, g, s_act, s_w);  // (a finished slot's dots are skipped: nothing staged)
#elif MK_AO_PRELOAD
    ao_combine_group_pre(p, num_splits(slot_pos(p, 0, step) + 1), g, s_act, s_w);
#else
#pragma unroll 1
    for (int b = 0; b < kB; b++) {
      if ((live >> b) & 1u)  // (a finished slot's dots are skipped: nothing to stage)
        ao_combine_group(p, num_splits(slot_pos(p, b, step) + 1, __popc(live)), g, s_act, s_w, b);
    }
#endif
  }
}

// One O unit's results into the live slots' accumulators (lane 0 of the warp; `u` = g * H + row).
MK_DEVICE void ao_add(const MkParams& p, long long u, const float* acc, unsigned live) {
#pragma unroll
  for (int b = 0; b < kB; b++)
    if ((live >> b) & 1u)
      atomicAdd(reinterpret_cast<unsigned long long*>(ao_acc(p, b) + u % MK_H), (unsigned long long)__float2ll_rn(acc[b] * kAoScale));
}

#if MK_MMA_O
// mma_o: this block's O tiles (one kv group's, o_block_units) on the group's staged attention output in B-fragment
// order (ao_combine_group_slots); each (row, slot) sum into the slot's int64 O accumulator, as ao_add does.
MK_DEVICE void o_mma(WeightStream& st, const MkParams& p, float* s_act, unsigned live) {
  int v0, v1;
  o_block_units((int)blockIdx.x, v0, v1);
#if MK_FX_PACK
  // (fx_pack: one atomic per row and pair of slots; the sums of slots not live are zeros)
  block_mma<1, kOSteps, 2>(st, p, s_act, st.gw >= 0 ? o_share(st.gw) : TileShare{0, 0, 0}, v1 - v0,
                           [](int v) { return v / kOTiles * kOSteps; }, s_act + kPieceOff,
                           [&](int v, int r, int c, const float* sum) {
    if (row_on(live, c))
      atomicAdd(reinterpret_cast<unsigned long long*>(ao_acc(p, c) + (v0 + v) % kOTiles * 16 + r),
                pack_slots(slot_on(live, 2 * c) ? sum[0] : 0.f, slot_on(live, 2 * c + 1) ? sum[1] : 0.f));
  });
#else
  block_mma<1, kOSteps>(st, p, s_act, st.gw >= 0 ? o_share(st.gw) : TileShare{0, 0, 0}, v1 - v0,
                        [](int v) { return v / kOTiles * kOSteps; }, s_act + kPieceOff,
                        [&](int v, int r, int b, const float* sum) {
    if (slot_on(live, b))
      atomicAdd(reinterpret_cast<unsigned long long*>(ao_acc(p, b) + (v0 + v) % kOTiles * 16 + r),
                (unsigned long long)__float2ll_rn(sum[0] * kAoScale));
  });
#endif
}
#endif
// Zeroing of every slot's accumulator (in the QKV phase: read before its barrier, added after).
MK_DEVICE void ao_zero(const MkParams& p) {
  zero_acc(ao_acc(p), kAccRows * MK_HP);
}

// Slot b's pre-norm residual element i after O: x + its accumulator (+ bias) (batch prologue).
// (layout option fold_x: the accumulator holds the whole residual and the bias, mk_fold.cuh; xsrc, bias not read)
MK_DEVICE float ao_load(const MkParams& p, const float* xsrc, const float* bias, int b, int i) {
#if MK_FX_PACK
  const float2 v = unpack_slots((unsigned long long)__ldcg(ao_acc(p, b >> 1) + i));
  return b & 1 ? v.y : v.x;
#elif defined(MK_FOLD_X) && MK_FOLD_X
  return __ll2float_rn(__ldcg(ao_acc(p, b) + i)) * kAoInv;
#else
  float x = __ldcg(xsrc + i) + __ll2float_rn(__ldcg(ao_acc(p, b) + i)) * kAoInv;
  if (bias) x += bias[i];
  return x;
#endif
}

#if MK_FX_PACK
// fx_pack: slots 2c and 2c + 1's elements i from one word (the batch prologues' pair loads, mk_batch.cuh)
MK_DEVICE float2 ao_load2(const MkParams& p, int c, int i) {
  return unpack_slots((unsigned long long)__ldcg(ao_acc(p, c) + i));
}
#endif

// residual_norm<S> of monokernel.cu with the O accumulator (+ bias) as the partial source.
MK_DEVICE void residual_norm_ao(const MkParams& p, const float* xsrc, const float* bias, float* xdst, const float* w,
                                float* s_act, float* s_red, int slot = 0) {
  const long long* acc = ao_acc(p, slot);
  constexpr int kIt = (MK_HP + MK_THREADS - 1) / MK_THREADS;
  float v[kIt];
  MK_NW_DECL
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kIt; k++) {
    const int i = threadIdx.x + k * MK_THREADS;
    MK_NW_LOAD(k, i)
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
      act_store(s_act, slot, i, i < MK_H ? v[k] * r * MK_NW(k, i) : 0.f);
    }
  }
  __syncthreads();
}
