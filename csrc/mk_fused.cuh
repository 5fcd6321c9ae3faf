// Fused gate/up -> down (MK_FUSED_MLP, layout option `fused_mlp`; see replicas/layout_fused.py):
// each block turns its gate/up units into its slice of h in shared memory, multiplies it by the
// matching columns of down (its own packed run per warp), and adds the block's partial hidden
// vector as int64 fixed point into one of two accumulators (integer adds commute: deterministic
// whatever the arrival order). The next phase's prologue reads the accumulator after the barrier;
// the O phase of the following layer zeroes it again. One grid barrier per layer fewer.
#pragma once
#include "mk_common.cuh"
#include "mk_layout.cuh"
#include "mk_stream.cuh"
#include "mk_timeline.cuh"
#include "mk_fx_pack.cuh"

// s_act offset of the h slice (batch builds: slot b's slice at kFxH + b * MK_FX_SLICE, after every
// slot's input vector)
#if MK_BATCH > 1
constexpr int kFxH = MK_FX_PART > kVecFloats ? MK_FX_PART : kVecFloats;
static_assert(MK_FX_M == 1, "batch builds: one chunk column per warp in the fused down (layout._batch_error)");
#else
constexpr int kFxH = MK_FX_PART > MK_HP ? MK_FX_PART : MK_HP;
#endif
constexpr float kFxScale = 4294967296.f;                        // 2^MK_FX_SHIFT
constexpr float kFxInv = 1.f / 4294967296.f;
static_assert(MK_FX_SHIFT == 32, "kFxScale assumes 32 fraction bits");
static_assert(MK_TP == 1, "fused_mlp is single-GPU only (layout_fused.fused_error)");

// The two accumulators live in dn_part (long long [2][kAccRows][MK_HP]); `turn` counts fused phases. Row c is
// slot c's (fx_pack: slots 2c and 2c + 1's, mk_fx_pack.cuh).
MK_DEVICE long long* fx_acc(const MkParams& p, unsigned turn, int c = 0) {
  return reinterpret_cast<long long*>(p.dn_part) + ((turn & 1u) * kAccRows + c) * MK_HP;
}

// residual_norm<S> of monokernel.cu with the fixed-point accumulator as the partial source.
MK_DEVICE void residual_norm_fx(const float* xsrc, const long long* acc, float* xdst, const float* w,
                                float* s_act, float* s_red) {
  constexpr int kIt = (MK_HP + MK_THREADS - 1) / MK_THREADS;
  float v[kIt];
  MK_NW_DECL
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kIt; k++) {
    const int i = threadIdx.x + k * MK_THREADS;
    MK_NW_LOAD(k, i)
    float x = 0.f;
    if (i < MK_H) x = __ldcg(xsrc + i) + __ll2float_rn(__ldcg(acc + i)) * kFxInv;
    v[k] = x;
    ss += x * x;
  }
  const float r = rsqrtf(block_sum(ss, s_red) / MK_H + MK_EPS);
#pragma unroll
  for (int k = 0; k < kIt; k++) {
    const int i = threadIdx.x + k * MK_THREADS;
    if (i < MK_HP) {
      if (i < MK_H && xdst && blockIdx.x == 0) xdst[i] = v[k];
      act_store(s_act, 0, i, i < MK_H ? v[k] * r * MK_NW(k, i) : 0.f);
    }
  }
  __syncthreads();
}

// Slot b's pre-norm residual element i: x + the accumulator of fused turn `turn` (batch prologue).
// (layout option fold_x: the accumulator holds the whole residual, mk_fold.cuh; xsrc is not read)
MK_DEVICE float fx_load(const MkParams& p, const float* xsrc, unsigned turn, int b, int i) {
#if MK_FX_PACK
  const float2 v = unpack_slots((unsigned long long)__ldcg(fx_acc(p, turn, b >> 1) + i));
  return b & 1 ? v.y : v.x;
#elif defined(MK_FOLD_X) && MK_FOLD_X
  return __ll2float_rn(__ldcg(fx_acc(p, turn, b) + i)) * kFxInv;
#else
  return __ldcg(xsrc + i) + __ll2float_rn(__ldcg(fx_acc(p, turn, b) + i)) * kFxInv;
#endif
}
#if MK_FX_PACK
// fx_pack: slots 2c and 2c + 1's elements i from one word (the batch prologues' pair loads, mk_batch.cuh)
MK_DEVICE float2 fx_load2(const MkParams& p, unsigned turn, int c, int i) {
  return unpack_slots((unsigned long long)__ldcg(fx_acc(p, turn, c) + i));
}
#endif

// Block-strided zeroing of an accumulator nobody reads or adds to before the next grid barrier.
// (every slot's: they are contiguous within a turn)
MK_DEVICE void fx_zero(long long* acc) {
  zero_acc(acc, kAccRows * MK_HP);
}

// The block's row-group partials in shared memory ([R][Hp], summed in group order) added to the
// accumulator as int64 fixed point.
MK_DEVICE void fx_add_partials(long long* acc, const float* s_act) {
  for (int i = threadIdx.x; i < MK_H; i += MK_THREADS) {
    float v = 0.f;
#pragma unroll
    for (int r = 0; r < MK_FX_R; r++) v += s_act[r * MK_HP + i];  // row groups in order
    atomicAdd(reinterpret_cast<unsigned long long*>(acc + i), (unsigned long long)__float2ll_rn(v * kFxScale));
  }
}

#if MK_BATCH > 1
// Batch build: one pass over the down run with 8 accumulators per slot, then each live slot's row-group
// partials through shared memory in turn (one partial buffer, slots one after another).
MK_DEVICE void fused_down(WeightStream& st, const MkParams& p, float* s_act, unsigned turn, unsigned live
                          MK_TL_PARAM) {
  const float* s_h = s_act + kFxH;
  __syncthreads();  // h slices complete; the normed inputs under the partials are dead
  MK_TL_AT(tl, 12);
  float a[kB][8];
#pragma unroll
  for (int b = 0; b < kB; b++)
#pragma unroll
    for (int e = 0; e < 8; e++) a[b][e] = 0.f;
  float* part = nullptr;
  if (st.gw >= 0) {
    const DownShare s = down_share(st.gw);
    part = s_act + ((threadIdx.x >> 5) / MK_FX_WC) * MK_HP + s.col0 * kChunk + st.lane * 8;
#pragma unroll 1
    for (int j = 0; j < s.n; j++) {
      const uint4 w = st.take();
      const float wf[8] = {__uint_as_float(w.x << 16), __uint_as_float(w.x & 0xffff0000u),
                           __uint_as_float(w.y << 16), __uint_as_float(w.y & 0xffff0000u),
                           __uint_as_float(w.z << 16), __uint_as_float(w.z & 0xffff0000u),
                           __uint_as_float(w.w << 16), __uint_as_float(w.w & 0xffff0000u)};
#pragma unroll
      for (int b = 0; b < kB; b++) {
        if (!((live >> b) & 1u)) continue;
        const float h = s_h[b * MK_FX_SLICE + s.a + j];
#pragma unroll
        for (int e = 0; e < 8; e++) a[b][e] = fmaf(h, wf[e], a[b][e]);
      }
      st.release(p);
    }
  }
  MK_TL_AT(tl, 13);  // (thread 0's warp done with its rows; the slots' partials and atomics follow)
#pragma unroll
  for (int b = 0; b < kB; b++) {
    if (!((live >> b) & 1u)) continue;  // the same for every thread of the block
    if (part) {
      *reinterpret_cast<float4*>(part) = make_float4(a[b][0], a[b][1], a[b][2], a[b][3]);
      *reinterpret_cast<float4*>(part + 4) = make_float4(a[b][4], a[b][5], a[b][6], a[b][7]);
    }
    __syncthreads();
    long long* acc = fx_acc(p, turn, b);
    fx_add_partials(acc, s_act);
    __syncthreads();
  }
}
#else
// a[e] += h * (bf16 element e of the 16-byte chunk w), in element order
MK_DEVICE void fma8(float (&a)[8], const uint4& w, float h) {
  a[0] = fmaf(h, __uint_as_float(w.x << 16), a[0]);
  a[1] = fmaf(h, __uint_as_float(w.x & 0xffff0000u), a[1]);
  a[2] = fmaf(h, __uint_as_float(w.y << 16), a[2]);
  a[3] = fmaf(h, __uint_as_float(w.y & 0xffff0000u), a[3]);
  a[4] = fmaf(h, __uint_as_float(w.z << 16), a[4]);
  a[5] = fmaf(h, __uint_as_float(w.z & 0xffff0000u), a[5]);
  a[6] = fmaf(h, __uint_as_float(w.w << 16), a[6]);
  a[7] = fmaf(h, __uint_as_float(w.w & 0xffff0000u), a[7]);
}

#ifndef MK_DN_PASSES
#define MK_DN_PASSES 1  // layout option dn_passes (flag emitted only when > 1)
#endif
#if MK_DN_PASSES > 1
static_assert(MK_FX_M == 1, "dn_passes: one chunk column per warp, so a warp's down run is its rows in order");
// dn_passes: the block's down rows in MK_DN_PASSES parts, each part's partial vector added to the accumulator
// as soon as it is done, so the int64 atomics of the early parts drain while the later parts stream. With one
// pass the 2,048 x 132 atomics of a layer all land at the phase's end: the timeline probe measured 2.9 µs from
// the last block's arrival at the MLP barrier to the first exit (0.76 µs without them: fx_group, RESULTS.md).
MK_DEVICE void fused_down(WeightStream& st, const MkParams& p, float* s_act, unsigned turn, unsigned MK_TL_PARAM) {
  long long* acc = fx_acc(p, turn);
  const float* s_h = s_act + kFxH;
  __syncthreads();  // h slice complete; the normed x under the partials is dead
  MK_TL_AT(tl, 12);
  const bool streams = st.gw >= 0;
  DownShare s{0, 0, 0, 0};
  if (streams) s = down_share(st.gw);
  float* part = s_act + ((threadIdx.x >> 5) / MK_FX_WC) * MK_HP + s.col0 * kChunk + st.lane * 8;
#pragma unroll 1
  for (int q = 0; q < MK_DN_PASSES; q++) {
    if (streams) {
      float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
      for (int j = s.n * q / MK_DN_PASSES; j < s.n * (q + 1) / MK_DN_PASSES; j++) {
        const uint4 w = st.take();
        const float h = s_h[s.a + j];
        fma8(a, w, h);
        st.release(p);
      }
      *reinterpret_cast<float4*>(part) = make_float4(a[0], a[1], a[2], a[3]);
      *reinterpret_cast<float4*>(part + 4) = make_float4(a[4], a[5], a[6], a[7]);
    }
    __syncthreads();
    if (q == MK_DN_PASSES - 1) MK_TL_AT(tl, 13);
    fx_add_partials(acc, s_act);
    if (q + 1 < MK_DN_PASSES) __syncthreads();  // (read before the next part overwrites them)
  }
}
#else
// After run_phase<MAT_GU> stored this block's h slice at s_act + kFxH: the down half.
MK_DEVICE void fused_down(WeightStream& st, const MkParams& p, float* s_act, unsigned turn, unsigned MK_TL_PARAM) {
  long long* acc = fx_acc(p, turn);
  const float* s_h = s_act + kFxH;
  __syncthreads();  // h slice complete; the normed x under the partials is dead
  MK_TL_AT(tl, 12);
  if (st.gw >= 0) {
    const DownShare s = down_share(st.gw);
    float* part = s_act + ((threadIdx.x >> 5) / MK_FX_WC) * MK_HP + st.lane * 8;
    for (int k = 0; k < MK_FX_M; k++) {
      float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 1  // (unroll 2: 132 vs 84 bytes of spills on llama-3.2-1b)
      for (int j = 0; j < s.n; j++) {
        const uint4 w = st.take();
        const float h = s_h[s.a + j];
        fma8(a, w, h);
        st.release(p);
      }
      float* dst = part + (s.col0 + k) * kChunk;
      *reinterpret_cast<float4*>(dst) = make_float4(a[0], a[1], a[2], a[3]);
      *reinterpret_cast<float4*>(dst + 4) = make_float4(a[4], a[5], a[6], a[7]);
    }
  }
  __syncthreads();
  MK_TL_AT(tl, 13);
  fx_add_partials(acc, s_act);
}
#endif  // MK_DN_PASSES
#endif  // MK_BATCH
