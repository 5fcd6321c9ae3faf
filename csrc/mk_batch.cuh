// Batch builds (MK_BATCH = B > 1, layout option `batch`): B sequences ("slots") decode together, and
// every weight chunk a warp streams is dotted with all B slots' inputs (one weight pass per step).
// A slot's sampling settings, position and budget come from the slot table `p.slots` (fixed for one
// launch); its buffers are slot-major. B = 1 builds read the scalar fields of MkParams instead and
// compile the single-sequence code they always had. This header is the one place that maps a slot
// to its settings and buffers (replicas/layout_params.py: BATCH_PARAM_FIELDS, SLOT_FIELDS; replicas/layout.py: buffer_sizes).
#pragma once
#include "mk_common.cuh"
#include "mk_layout.cuh"
#include "mk_stream.cuh"

#if MK_BATCH > 1
#define MK_SLOT(p, b, field) ((p).slots[b].field)
#define MK_SLOT_STEP0(p, b) ((int)(p).slots[b].step0)
#define MK_SLOT_ACTIVE(p, b) ((p).slots[b].active != 0)
#define MK_SLOT_STOPS(p, b) ((p).slot_stop + (b) * MK_MAX_STOP)
#else
#define MK_SLOT(p, b, field) ((p).field)
#define MK_SLOT_STEP0(p, b) ((int)(p).step0)
#define MK_SLOT_ACTIVE(p, b) true
#define MK_SLOT_STOPS(p, b) ((p).stop_ids)
#endif

// xbuf [2][B][Hp]: half xi of slot b
MK_DEVICE float* slot_x(const MkParams& p, int xi, int b) { return p.xbuf + (long long)(xi * kB + b) * MK_HP; }
MK_DEVICE float* slot_qkv(const MkParams& p, int b) { return p.qkv_part + (long long)b * kUnitsQKV; }
// KV cache [B][L][NKV][max_ctx][D]: first row of (slot, layer, kv head)
MK_DEVICE long long kv_head_base(int b, int layer, int g) {
  return (((long long)b * MK_L + layer) * MK_NKV + g) * MK_MAX_CTX;
}

MK_DEVICE bool slot_is_stop(const MkParams& p, int b, int tok) {
  const int* stops = MK_SLOT_STOPS(p, b);
  const int n = (int)MK_SLOT(p, b, n_stop);
  for (int i = 0; i < n; i++) if (stops[i] == tok) return true;
  return false;
}

// Position of the token slot b feeds through the layers at this launch's step `step`.
MK_DEVICE int slot_pos(const MkParams& p, int b, int step) {
  return (int)MK_SLOT(p, b, start_pos) + MK_SLOT_STEP0(p, b) + step;
}

#if MK_BATCH > 1
// The per-slot residual + RMSNorm prologue of a batch build, all live slots at once: x_b[i] = load(b, i)
// (the pre-norm residual), s_act + b * kActVec = RMSNorm(x_b) * w, block 0 stores x_b to xdst(b) (if
// not null). Two passes over the (L2-resident) inputs with one block reduction for every slot, instead
// of one reduction round trip per slot; the sums run in block_sum's order, so each slot's values equal
// the B = 1 kernel's bit for bit. Scratch: s_red[kWarps * kB + kB] (layout.red_floats).
template <class Load, class Dst>
MK_DEVICE void residual_norm_slots(unsigned live, Load load, Dst xdst, const float* w, float* s_act, float* s_red) {
  constexpr int kIt = (MK_HP + MK_THREADS - 1) / MK_THREADS;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  MK_NW_DECL
#pragma unroll
  for (int k = 0; k < kIt; k++) { MK_NW_LOAD(k, threadIdx.x + k * MK_THREADS) }
  float ss[kB];
#pragma unroll
  for (int b = 0; b < kB; b++) {
    ss[b] = 0.f;
    if (!((live >> b) & 1u)) continue;
#pragma unroll
    for (int k = 0; k < kIt; k++) {
      const int i = threadIdx.x + k * MK_THREADS;
      const float x = i < MK_H ? load(b, i) : 0.f;
      ss[b] += x * x;
    }
    ss[b] = warp_sum(ss[b]);
  }
  __syncthreads();  // s_red may still be read by the previous reduction
  if (lane == 0)
#pragma unroll
    for (int b = 0; b < kB; b++) s_red[warp * kB + b] = ss[b];
  __syncthreads();
  if (warp < kB) {  // warp b totals slot b exactly as block_sum would
    float t = lane < kWarps ? s_red[lane * kB + warp] : 0.f;
    t = warp_sum(t);
    if (lane == 0) s_red[kWarps * kB + warp] = rsqrtf(t / MK_H + MK_EPS);
  }
  __syncthreads();
#pragma unroll
  for (int b = 0; b < kB; b++) {
    if (!((live >> b) & 1u)) continue;
    const float r = s_red[kWarps * kB + b];
    float* dst = xdst(b);
#pragma unroll
    for (int k = 0; k < kIt; k++) {
      const int i = threadIdx.x + k * MK_THREADS;
      if (i < MK_HP) {
        const float x = i < MK_H ? load(b, i) : 0.f;
        if (i < MK_H && dst && blockIdx.x == 0) dst[i] = x;
        act_store(s_act, b, i, i < MK_H ? x * r * MK_NW(k, i) : 0.f);
      }
    }
  }
  __syncthreads();
}
static_assert(kB <= kWarps, "one warp per slot totals the batch prologue");
#endif
