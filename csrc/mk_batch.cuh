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

#ifndef MK_RESIDENT
#define MK_RESIDENT 0  // layout option resident (batch builds; flag emitted only when on)
#endif
#ifndef MK_NORM_ONCE
#define MK_NORM_ONCE 0  // layout option norm_once (batch builds; flag emitted only when on)
#endif
#if MK_BATCH > 1 && MK_RESIDENT
// Resident builds: requests join the running launch at a step boundary, so the host rewrites a free
// slot's table row and stop ids while the kernel runs. Each block keeps its own copy in shared memory
// (after the reduction scratch; layout.resident_bytes), read from L2 at launch and at the slot's
// admission: an L1 line cached for the slot's previous request would be stale.
constexpr int kResidentOff = (kStreamWarps * MK_RING * 512 + 4 * (MK_ACT_FLOATS + MK_RED_FLOATS) + 7) & ~7;
MK_DEVICE MkSlot* resident_slots() {
  extern __shared__ __align__(16) unsigned char smem[];
  return reinterpret_cast<MkSlot*>(smem + kResidentOff);
}
MK_DEVICE int* resident_stops() { return reinterpret_cast<int*>(resident_slots() + kB); }
#define MK_SLOT(p, b, field) (resident_slots()[b].field)
#define MK_SLOT_STEP0(p, b) ((int)resident_slots()[b].step0)
#define MK_SLOT_ACTIVE(p, b) (resident_slots()[b].active != 0)
#define MK_SLOT_STOPS(p, b) (resident_stops() + (b) * MK_MAX_STOP)
#elif MK_BATCH > 1
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

#if MK_BATCH > 1 && MK_RESIDENT
// The block's copy of slot b's row and stop ids (every thread calls; ends with __syncthreads), at launch
// and when it joins. The slot's
// token 0 is sampled at this launch step `step`, so its step0 (tokens emitted before) becomes step0 - step:
// token index, position and RNG counter then run exactly as in a launch that started the slot.
MK_DEVICE void resident_load_slot(const MkParams& p, int b, int step, bool join) {
  constexpr int kWords = (int)(sizeof(MkSlot) / 8);
  const int t = threadIdx.x;
  if (t < kWords)
    reinterpret_cast<unsigned long long*>(resident_slots() + b)[t] =
        __ldcg(reinterpret_cast<const unsigned long long*>(p.slots + b) + t);
  else if (t < kWords + MK_MAX_STOP)
    resident_stops()[b * MK_MAX_STOP + t - kWords] = __ldcg(p.slot_stop + b * MK_MAX_STOP + t - kWords);
  __syncthreads();
  if (t == 0 && join) {
    resident_slots()[b].step0 -= step;
    resident_slots()[b].active = 1;  // (a row written for a join says 0: a launch starting meanwhile must not take it)
  }
  __syncthreads();
}

// Block 0's thread 0, once a step (the last layer's MLP phase) or while idle: the host's yield request and
// any admission it published since `seen` (layout_params.py KCTL_*), into cancel_step[kB .. kB + 2] for
// every block to read after the next grid barrier. Returns whether there is something to act on.
MK_DEVICE bool resident_poll(const MkParams& p, unsigned seen) {
  static_assert(MK_KCTL_YIELD == 0 && MK_KCTL_ADMIT_SEQ == 1, "YIELD and ADMIT_SEQ are read in one 8-byte load");
  // one host round trip a step, as the non-resident builds' yield read (host_kctl is page-aligned pinned memory)
  const unsigned long long w = *reinterpret_cast<volatile unsigned long long*>(p.host_kctl);
  const int yield = (int)(unsigned)(w & 0xffffffffull);
  const unsigned seq = (unsigned)(w >> 32);
  unsigned mask = 0;
  if (seq != seen) {
    __threadfence_system();  // the mask the host wrote before this sequence number, not an older one
    mask = (unsigned)p.host_kctl[MK_KCTL_ADMIT_MASK];
  }
  p.cancel_step[kB] = yield;
  p.cancel_step[kB + 1] = (int)mask;
  p.cancel_step[kB + 2] = (int)seq;
  return yield != 0 || seq != seen;
}

MK_DEVICE unsigned long long idle_clock_ns() {
#ifdef MK_EMU
  return mk_emu_real_ns();  // (the emulation's global_ns is a step counter)
#else
  return global_ns();
#endif
}

// Every block at a step boundary of a resident launch. With no slot decoding, block 0 first waits (up to
// p.idle_ns) for the host to admit one or ask for the GPU back, then a grid barrier shares its answer.
// Returns the slots that join now (their rows copied) or ~0u when the launch must end. Block 0
// acknowledges a consumed admission to the host (KCTL_ADMIT_ACK) only when the launch goes on, so the
// host knows that slots it published to a launch that ended never joined it.
MK_DEVICE unsigned resident_boundary(const MkParams& p, unsigned live, int step, unsigned& epoch, unsigned& seen) {
  if (live == 0) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      const unsigned long long t0 = idle_clock_ns();
      while (!resident_poll(p, seen)) {
        if (idle_clock_ns() - t0 >= (unsigned long long)p.idle_ns) { p.cancel_step[kB] = 1; break; }
        __nanosleep(2000);
      }
    }
    grid_barrier<kBarrierThread>(p.bar_count, epoch);
  }
  if (__ldcg(p.cancel_step + kB) != 0) return ~0u;
  const unsigned seq = (unsigned)__ldcg(p.cancel_step + kB + 2);
  const unsigned joins = (unsigned)__ldcg(p.cancel_step + kB + 1) & ~live & ((1u << kB) - 1);
  if (blockIdx.x == 0 && threadIdx.x == 0 && seq != seen) p.host_kctl[MK_KCTL_ADMIT_ACK] = (int)seq;
  seen = seq;
  for (int b = 0; b < kB; b++)
    if ((joins >> b) & 1u) resident_load_slot(p, b, step, true);
  return joins;
}
#endif

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
// A batch prologue's input loader: load(b, i) -> slot b's element i. PairLoad wraps f(c, i) -> float2, slots 2c and
// 2c + 1's element i from one load (fx_pack's packed accumulator words, mk_fx_pack.cuh).
template <class F>
struct PairLoad {
  F f;
  MK_DEVICE float operator()(int b, int i) const { const float2 v = f(b >> 1, i); return b & 1 ? v.y : v.x; }
};
template <class F>
MK_DEVICE PairLoad<F> pair_load(F f) { return PairLoad<F>{f}; }
template <class T>
struct IsPairLoad { static constexpr bool value = false; };
template <class F>
struct IsPairLoad<PairLoad<F>> { static constexpr bool value = true; };

// Every slot's elements index(k), k < kN, into x[b][k] (0 past MK_H and for the slots not live); a PairLoad issues
// one load per pair of slots.
template <int kN, class Load, class Index>
MK_DEVICE void load_slot_rows(const Load& load, unsigned live, Index index, float (&x)[kB][kN]) {
  if constexpr (IsPairLoad<Load>::value) {
#pragma unroll
    for (int k = 0; k < kN; k++) {
      const int i = index(k);
#pragma unroll
      for (int c = 0; c < (kB + 1) / 2; c++) {
        const unsigned two = i < MK_H ? (live >> (2 * c)) & 3u : 0u;
        const float2 v = two ? load.f(c, i) : make_float2(0.f, 0.f);
        x[2 * c][k] = two & 1u ? v.x : 0.f;
        if (2 * c + 1 < kB) x[2 * c + 1][k] = two & 2u ? v.y : 0.f;
      }
    }
  } else {  // (slot-major, the order the builds without fx_pack were tuned in)
#pragma unroll
    for (int b = 0; b < kB; b++)
#pragma unroll
      for (int k = 0; k < kN; k++) {
        const int i = index(k);
        x[b][k] = i < MK_H && ((live >> b) & 1u) ? load(b, i) : 0.f;
      }
  }
}

// The per-slot residual + RMSNorm prologue of a batch build, all live slots at once: x_b[i] = load(b, i)
// (the pre-norm residual), s_act + b * kActVec = RMSNorm(x_b) * w, block 0 stores x_b to xdst(b) (if
// not null). Two passes over the (L2-resident) inputs with one block reduction for every slot, instead
// of one reduction round trip per slot; the sums run in block_sum's order, so each slot's values equal
// the B = 1 kernel's bit for bit. Scratch: s_red[kWarps * kB + kB] (layout.red_floats).
// kFrag (mma_mlp's gate/up input): bf16 in mma B-fragment order (frag_half) instead of act_store's layout.
#if MK_PAIR_NORM
// Layout option pair_norm: the batch prologues are bound by L2 bandwidth, every block reading every slot's whole
// residual (session 12: fold_x's third fewer bytes gave +5.5% at B = 4). Blocks run in clusters of two (one TPC);
// each loads half of every slot's elements (its rank's half of the kIt strides), the pair adds its two halves'
// sums of squares in rank order (the same in every pair, so every block stages the same values), and each block
// stores its half of the normed vectors into both blocks' shared memory. Three cluster barriers: the first
// keeps a block from writing into its peer's s_red / s_act while the peer still reads them (the embed prologue
// follows sample + emit without a grid barrier). Sums run in another order than residual_norm_slots' below:
// fp32-level differences, not bit-equal.
template <bool kFrag = false, class Load, class Dst>
MK_DEVICE void residual_norm_slots(unsigned live, Load load, Dst xdst, const float* w, float* s_act, float* s_red) {
  static_assert(MK_CLUSTER == 2, "pair_norm: clusters of two blocks");
  constexpr int kIt = (MK_HP + MK_THREADS - 1) / MK_THREADS, kHalf = (kIt + 1) / 2;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned rank = __clusterRelativeBlockRank();
  float* peer_act = static_cast<float*>(__cluster_map_shared_rank(s_act, rank ^ 1u));
  float* peer_red = static_cast<float*>(__cluster_map_shared_rank(s_red, rank ^ 1u));
  float xv[kB][kHalf], nw[kHalf];
#pragma unroll
  for (int kk = 0; kk < kHalf; kk++) {
    const int k = (int)rank * kHalf + kk, i = threadIdx.x + k * MK_THREADS;
    nw[kk] = k < kIt && i < MK_H ? w[i] : 0.f;
  }
  load_slot_rows<kHalf>(load, live, [&](int kk) {
    const int k = (int)rank * kHalf + kk;
    return k < kIt ? threadIdx.x + k * MK_THREADS : MK_H;
  }, xv);
  float ss[kB];
#pragma unroll
  for (int b = 0; b < kB; b++) {
    ss[b] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kHalf; kk++) ss[b] += xv[b][kk] * xv[b][kk];
    ss[b] = warp_sum(ss[b]);
  }
  cluster_sync();  // the peer is done with its s_red / s_act of the phase before
  if (lane == 0)
#pragma unroll
    for (int b = 0; b < kB; b++) s_red[warp * kB + b] = ss[b];
  __syncthreads();
  if (warp < kB) {  // warp b totals this block's half of slot b, into both blocks' s_red
    float t = lane < kWarps ? s_red[lane * kB + warp] : 0.f;
    t = warp_sum(t);
    if (lane == 0) s_red[kWarps * kB + rank * kB + warp] = peer_red[kWarps * kB + rank * kB + warp] = t;
  }
  cluster_sync();  // both halves' sums in both blocks
#pragma unroll
  for (int b = 0; b < kB; b++) {
    if (!((live >> b) & 1u)) continue;
    const float r = rsqrtf((s_red[kWarps * kB + b] + s_red[kWarps * kB + kB + b]) / MK_H + MK_EPS);
    float* dst = xdst(b);
#pragma unroll
    for (int kk = 0; kk < kHalf; kk++) {
      const int k = (int)rank * kHalf + kk, i = threadIdx.x + k * MK_THREADS;
      if (k < kIt && i < MK_HP) {
        const float x = xv[b][kk];
        if (i < MK_H && dst && blockIdx.x < 2) dst[i] = x;  // (cluster 0: each block its half)
        const float v = i < MK_H ? x * r * nw[kk] : 0.f;
        if constexpr (kFrag) {
          const uint16_t h = f32_to_bf16(v);
          reinterpret_cast<uint16_t*>(s_act)[frag_half(b, i)] = h;
          reinterpret_cast<uint16_t*>(peer_act)[frag_half(b, i)] = h;
        } else {
          act_store(s_act, b, i, v);
          act_store(peer_act, b, i, v);
        }
      }
    }
  }
  cluster_sync();  // both halves staged in both blocks
}
#else
template <bool kFrag = false, class Load, class Dst>
MK_DEVICE void residual_norm_slots(unsigned live, Load load, Dst xdst, const float* w, float* s_act, float* s_red) {
  constexpr int kIt = (MK_HP + MK_THREADS - 1) / MK_THREADS;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  MK_NW_DECL
#pragma unroll
  for (int k = 0; k < kIt; k++) { MK_NW_LOAD(k, threadIdx.x + k * MK_THREADS) }
  float ss[kB];
#if MK_NORM_ONCE
  // every live slot's inputs loaded once, all in flight together (one L2 round trip, not one per slot and
  // pass: the timeline probe measured 7-8 us per B = 4 prologue against 1 us at B = 1)
  float xv[kB][kIt];
  load_slot_rows<kIt>(load, live, [&](int k) { return threadIdx.x + k * MK_THREADS; }, xv);
#pragma unroll
  for (int b = 0; b < kB; b++) {
    ss[b] = 0.f;
#pragma unroll
    for (int k = 0; k < kIt; k++) ss[b] += xv[b][k] * xv[b][k];
  }
#pragma unroll
  for (int b = 0; b < kB; b++) ss[b] = warp_sum(ss[b]);
#define MK_NORM_X(b, k, i) xv[b][k]
#else
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
#define MK_NORM_X(b, k, i) (i < MK_H ? load(b, i) : 0.f)
#endif
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
        const float x = MK_NORM_X(b, k, i);
        if (i < MK_H && dst && blockIdx.x == 0) dst[i] = x;
        const float v = i < MK_H ? x * r * MK_NW(k, i) : 0.f;
        if constexpr (kFrag) reinterpret_cast<uint16_t*>(s_act)[frag_half(b, i)] = f32_to_bf16(v);
        else act_store(s_act, b, i, v);
      }
    }
  }
  __syncthreads();
#undef MK_NORM_X
}
#endif  // MK_PAIR_NORM
static_assert(kB <= kWarps, "one warp per slot totals the batch prologue");
#endif
