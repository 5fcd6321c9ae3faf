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
    case MAT_QKV: base = p.w_qkv + layer * kStrideQKV; units = kUnitsQKV; len = kLenQKV; break;
    case MAT_O: base = p.w_o + layer * kStrideO; units = kUnitsO; len = kLenO; break;
    case MAT_GU: base = p.w_gu + layer * kStrideGU; units = kUnitsGU; len = kLenGU; break;
    case MAT_DN: base = p.w_dn + layer * kStrideDN; units = kUnitsDN; len = kLenDN; break;
    default: base = p.w_lm; units = kUnitsLM; len = kLenLM; break;
  }
}

// This warp's contiguous unit range [u0, u1) of a matrix with `units` units.
MK_DEVICE void warp_range(long long units, int gw, int nw, long long& u0, long long& u1) {
  u0 = units * gw / nw;
  u1 = units * (gw + 1) / nw;
}

// MK_DYN: the layer matrices (QKV, O, GU, DN) are dealt out dynamically in granules of
// MK_G_<mat> units: each warp claims granule tickets from one global counter per matrix, one
// claim ahead, so SMs that stream faster take more of the phase (the phase ends when the work
// runs out, not when the slowest SM finishes a fixed share). Ticket t belongs to instance
// (layer-step) t / tickets-per-instance; the one ticket that overshoots an instance is kept for
// the next instance of that matrix. The producer tells the consumer which granule comes next
// through a small FIFO in shared memory, with -1 marking the end of an instance.
constexpr int kFifo = 64;
constexpr int kFifoStride = kFifo + 8;  // + per-matrix instance counters
MK_DEVICE int dyn_granule(int mat) {
  return mat == MAT_QKV ? MK_G_QKV : mat == MAT_O ? MK_G_O : mat == MAT_GU ? MK_G_GU : MK_G_DN;
}
MK_DEVICE bool is_dyn(int mat) { return MK_DYN && mat != MAT_LM; }

struct WeightStream {
  uint4* ring;     // this warp's MK_RING slots of 32 x 16 bytes
  int slot;        // next slot to consume (== next slot to refill)
  int lane, gw, nw;
  // producer cursor
  int mat, layer;
  const uint16_t* ptr;
  long long left;  // chunks left in the current run; 0 with mat < 0 => this warp streams nothing
  unsigned long long policy;  // L2 eviction policy of streamed weights (MK_EVICT_FIRST)
  // dynamic dealing (MK_DYN)
  int* fifo; int fifo_w, fifo_r;
  bool in_dyn;
  unsigned tk0, tk1, tk2, tk3;        // lane 0: claimed, not yet used ticket per layer matrix

  MK_DEVICE void claim(const MkParams& p, int d) {
    if (lane == 0) {
      unsigned* c = p.tickets + d;
      if (d == 0) tk0 = atomicAdd(c, 1u); else if (d == 1) tk1 = atomicAdd(c, 1u);
      else if (d == 2) tk2 = atomicAdd(c, 1u); else tk3 = atomicAdd(c, 1u);
    }
  }
  MK_DEVICE unsigned ticket(int d) const {
    unsigned t = d == 0 ? tk0 : d == 1 ? tk1 : d == 2 ? tk2 : tk3;
    return __shfl_sync(0xffffffffu, t, 0);
  }
  // instance (layer-step) the producer is in, per matrix: 4 ints after the FIFO entries
  MK_DEVICE unsigned instance(int d) const { return (unsigned)fifo[kFifo + d]; }
  MK_DEVICE void next_instance(int d) {
    if (lane == 0) fifo[kFifo + d]++;
    __syncwarp();
  }
  MK_DEVICE void push(int v) {
    if (lane == 0) fifo[fifo_w & (kFifo - 1)] = v;
    __syncwarp();
    fifo_w++;
  }
  MK_DEVICE int pop() {
    const int v = fifo[fifo_r & (kFifo - 1)];
    fifo_r++;
    __syncwarp();
    return v;
  }
  // Inside a dynamic instance: take the next granule (true) or close the instance (false).
  MK_DEVICE bool next_granule(const MkParams& p) {
    const int d = mat - 1;
    const uint16_t* base; long long units; int len;
    mat_info(p, mat, layer, base, units, len);
    const int G = dyn_granule(mat);
    const unsigned per = (unsigned)((units + G - 1) / G);
    const unsigned t = ticket(d);
    const unsigned k = instance(d);
    if (t - k * per < per) {  // a granule of this instance
      const long long u0 = (long long)(t - k * per) * G, u1 = min(units, u0 + G);
      claim(p, d);  // the next ticket, in flight while this granule streams
      ptr = base + u0 * len; left = (u1 - u0) * (len / kChunk);
      push((int)u0);
      return true;
    }
    next_instance(d);  // instance exhausted; ticket t is a granule of the next one, kept
    push(-1);
    in_dyn = false;
    return false;
  }

  MK_DEVICE void next_run(const MkParams& p) {
    if (in_dyn && next_granule(p)) return;
    for (int tries = 0; tries <= 4 * MK_L + 1; tries++) {
      if (mat == MAT_LM) { mat = MAT_QKV; layer = 0; }
      else if (mat == MAT_DN) { if (++layer == MK_L) mat = MAT_LM; else mat = MAT_QKV; }
      else mat++;
      if (is_dyn(mat)) {
        in_dyn = true;
        if (next_granule(p)) return;
        continue;
      }
      const uint16_t* base; long long units, u0, u1; int len;
      mat_info(p, mat, layer, base, units, len);
      warp_range(units, gw, nw, u0, u1);
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

  MK_DEVICE void init(const MkParams& p, uint4* warp_ring, int* warp_fifo) {
    ring = warp_ring; lane = threadIdx.x & 31;
    fifo = warp_fifo; fifo_w = fifo_r = 0; in_dyn = false;
    tk0 = tk1 = tk2 = tk3 = 0;
    if (MK_DYN) {  // the FIFO exists in shared memory only for dynamic builds
      if (lane < 4) fifo[kFifo + lane] = 0;
      __syncwarp();
    }
    policy = MK_EVICT_FIRST ? l2_evict_first_policy() : 0ull;
    nw = gridDim.x * kStreamWarps;
    if ((threadIdx.x >> 5) >= kStreamWarps) {  // the control warp: no share of any matrix
      gw = -1; mat = -1; left = 0; slot = 0;
      return;
    }
    gw = blockIdx.x * kStreamWarps + (threadIdx.x >> 5);
    if (MK_DYN) for (int d = 0; d < 4; d++) claim(p, d);
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
  // After the taken value has been used: refill the slot with the chunk MK_RING ahead.
  MK_DEVICE void release(const MkParams& p) {
    issue(p);
    slot = (slot + 1 == MK_RING) ? 0 : slot + 1;
  }
};

template <int MAT, class Epi>
MK_DEVICE void run_units(WeightStream& st, const MkParams& p, const float* s_act, long long u0, long long u1,
                         Epi& epi);

// One matvec phase: this warp's units of matrix MAT dotted with the activation vector in shared
// memory; `epi(unit, acc0, acc1)` runs on lane 0 for every finished unit (acc1: GU's up row).
template <int MAT, class Epi>
MK_DEVICE void run_phase(WeightStream& st, const MkParams& p, int layer, const float* s_act, Epi epi) {
  if (st.gw < 0) return;
  const uint16_t* base; long long units, u0, u1; int len;
  mat_info(p, MAT, layer, base, units, len);
  if (is_dyn(MAT)) {  // granules as the producer dealt them, until the end marker
    for (;;) {
      const int g0 = st.pop();
      if (g0 < 0) return;
      run_units<MAT>(st, p, s_act, g0, min(units, (long long)g0 + dyn_granule(MAT)), epi);
    }
  }
  warp_range(units, st.gw, st.nw, u0, u1);
  run_units<MAT>(st, p, s_act, u0, u1, epi);
}

template <int MAT, class Epi>
MK_DEVICE void run_units(WeightStream& st, const MkParams& p, const float* s_act, long long u0, long long u1,
                         Epi& epi) {
  constexpr int kSplit = MAT == MAT_QKV ? MK_S_QKV : MAT == MAT_O ? MK_S_O : MAT == MAT_DN ? MK_S_DN : 1;
  constexpr int kLen = MAT == MAT_QKV ? kLenQKV : MAT == MAT_O ? kLenO : MAT == MAT_DN ? kLenDN
                       : MAT == MAT_GU ? kLenGU : kLenLM;
  constexpr int kChunks = kLen / kChunk;
  const int lane8 = st.lane * 8;
  for (long long u = u0; u < u1; u++) {
    const float* x = s_act + (kSplit > 1 ? (int)(u % kSplit) * kLen : 0) + lane8;
    float acc0 = 0.f, acc1 = 0.f;
    if (MAT == MAT_GU) {
#pragma unroll 2
      for (int c = 0; c < kChunks / 2; c++) { acc0 += dot8(st.take(), x + c * kChunk); st.release(p); }
#pragma unroll 2
      for (int c = 0; c < kChunks / 2; c++) { acc1 += dot8(st.take(), x + c * kChunk); st.release(p); }
    } else {
#pragma unroll 2
      for (int c = 0; c < kChunks; c++) { acc0 += dot8(st.take(), x + c * kChunk); st.release(p); }
    }
    acc0 = warp_sum(acc0);
    if (MAT == MAT_GU) acc1 = warp_sum(acc1);
    if (st.lane == 0) epi(u, acc0, acc1);
  }
}

// Ask L2 to fetch the first `bytes` of this warp's share of matrix MAT (layer `layer`), without
// waiting: used while the latency-bound attention chain leaves HBM idle.
template <int MAT>
MK_DEVICE void l2_prefetch(const WeightStream& st, const MkParams& p, int layer, int bytes) {
  if (bytes <= 0 || st.gw < 0) return;
  const uint16_t* base; long long units, u0, u1; int len;
  mat_info(p, MAT, layer, base, units, len);
  warp_range(units, st.gw, st.nw, u0, u1);
  const long long n = min((long long)bytes, (u1 - u0) * len * 2);
  const long long piece = ((n + 31) / 32 + 15) & ~15LL;
  const long long off = st.lane * piece;
  if (off < n) {
    const unsigned size = (unsigned)min(piece, n - off);
    const char* src = reinterpret_cast<const char*>(base + u0 * len) + off;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(size) : "memory");
  }
}
