// Small device helpers shared by every phase: bf16, async copies, reductions, grid barrier, RNG.
#pragma once
#ifndef MK_EMU  // (MK_EMU: the CPU emulation, csrc/emu/cuda_on_cpu.h, defines the built-ins; tests only)
#include <cuda_bf16.h>
#endif
#ifdef __CUDACC_RTC__
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
#else
#include <stdint.h>
#endif

#define MK_DEVICE __device__ __forceinline__
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

// %globaltimer in ns (phase profile, timeline probe)
MK_DEVICE unsigned long long global_ns() {
#ifdef MK_EMU
  return mk_emu_globaltimer();
#else
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#endif
}

MK_DEVICE float bf16_to_f32(uint16_t b) { return __uint_as_float(((uint32_t)b) << 16); }
MK_DEVICE uint16_t f32_to_bf16(float f) {
  __nv_bfloat16 h = __float2bfloat16_rn(f);
  return *reinterpret_cast<uint16_t*>(&h);
}
MK_DEVICE float bf16_round(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#ifndef MK_XPERM
#define MK_XPERM 0  // layout option x_perm (flag emitted only when on)
#endif
// Shared-memory position of matvec-input element i. With MK_XPERM, inside each 256-element chunk
// lane l's elements [8l, 8l+8) sit as two float4 at 4l and 128 + 4l: a warp's float4 loads of a
// chunk are then contiguous (4 wavefronts each) instead of 32-byte strided (8 wavefronts each).
MK_DEVICE int xpos(int i) {
#if MK_XPERM
  const int r = i & 255;
  return (i & ~255) + ((r & 4) << 5) + ((r >> 3) << 2) + (r & 3);
#else
  return i;
#endif
}
// Offset of a lane's first input element inside a chunk (see xpos), and of its second float4.
constexpr int kXLane = MK_XPERM ? 4 : 8;
constexpr int kXHi = MK_XPERM ? 128 : 4;

// 8 packed bf16 (one 16-byte word) w dotted with 8 fp32 (float4 a = x[0..3], b = x[kXHi..]).
#define MK_DOT8_BODY(w, a, b)                                   \
  float s;                                                      \
  s = __uint_as_float(w.x << 16) * a.x;                         \
  s = fmaf(__uint_as_float(w.x & 0xffff0000u), a.y, s);         \
  s = fmaf(__uint_as_float(w.y << 16), a.z, s);                 \
  s = fmaf(__uint_as_float(w.y & 0xffff0000u), a.w, s);         \
  s = fmaf(__uint_as_float(w.z << 16), b.x, s);                 \
  s = fmaf(__uint_as_float(w.z & 0xffff0000u), b.y, s);         \
  s = fmaf(__uint_as_float(w.w << 16), b.z, s);                 \
  s = fmaf(__uint_as_float(w.w & 0xffff0000u), b.w, s);         \
  return s;
// x = the chunk's input + lane * kXLane in shared memory.
MK_DEVICE float dot8(uint4 w, const float* x) {
  float4 a = *reinterpret_cast<const float4*>(x);
  float4 b = *reinterpret_cast<const float4*>(x + kXHi);
  MK_DOT8_BODY(w, a, b)
}
#ifndef MK_ACT_BF16
#define MK_ACT_BF16 0  // layout option act_bf16 (batch builds: matvec inputs in bf16; flag only when on)
#endif
#if MK_ACT_BF16
// 8 packed bf16 weights dotted with 8 packed bf16 inputs, in dot8's order (the products are exact in fp32).
MK_DEVICE float dot8b(uint4 w, uint4 x) {
  float s;
  s = __uint_as_float(w.x << 16) * __uint_as_float(x.x << 16);
  s = fmaf(__uint_as_float(w.x & 0xffff0000u), __uint_as_float(x.x & 0xffff0000u), s);
  s = fmaf(__uint_as_float(w.y << 16), __uint_as_float(x.y << 16), s);
  s = fmaf(__uint_as_float(w.y & 0xffff0000u), __uint_as_float(x.y & 0xffff0000u), s);
  s = fmaf(__uint_as_float(w.z << 16), __uint_as_float(x.z << 16), s);
  s = fmaf(__uint_as_float(w.z & 0xffff0000u), __uint_as_float(x.z & 0xffff0000u), s);
  s = fmaf(__uint_as_float(w.w << 16), __uint_as_float(x.w << 16), s);
  s = fmaf(__uint_as_float(w.w & 0xffff0000u), __uint_as_float(x.w & 0xffff0000u), s);
  return s;
}
#endif
#if MK_GU_IL
// The input already loaded: gate/up interleaved (gu_il) dots a gate and an up chunk with one load of it.
MK_DEVICE float dot8v(uint4 w, const float4& a, const float4& b) { MK_DOT8_BODY(w, a, b) }
#endif

// ---- cp.async (LDGSTS): 16 bytes global -> shared, L2 only; one commit group per chunk ----
MK_DEVICE void cp_async16(void* smem, const void* gmem) {
#ifdef MK_EMU
  mk_emu_cp_async16(smem, gmem);
#else
  unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
#endif
}
// The same with an L2 eviction policy (weights are streamed once per step: evict them first so
// they do not push out what was prefetched into L2).
#ifdef MK_EMU  // the copy happens at once, so the waits never wait
MK_DEVICE unsigned long long l2_evict_first_policy() { return 0; }
MK_DEVICE void cp_async16_hint(void* smem, const void* gmem, unsigned long long) { mk_emu_cp_async16(smem, gmem); }
MK_DEVICE void cp_async_commit() {}
template <int N>
MK_DEVICE void cp_async_wait() {}
MK_DEVICE void cp_async_wait_all() {}
#else
MK_DEVICE unsigned long long l2_evict_first_policy() {
  unsigned long long pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
  return pol;
}
MK_DEVICE void cp_async16_hint(void* smem, const void* gmem, unsigned long long pol) {
  unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "l"(pol) : "memory");
}
MK_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
MK_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
MK_DEVICE void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
#endif

// ---- thread-block clusters (layout options pair_norm, pair_dn: the kernel is launched in clusters of MK_CLUSTER) ----
#ifndef MK_CLUSTER
#define MK_CLUSTER 1
#endif
#ifndef MK_PAIR_NORM
#define MK_PAIR_NORM 0  // layout option pair_norm (flag emitted only when on; with MK_CLUSTER=2)
#endif
#ifndef MK_PAIR_DN
#define MK_PAIR_DN 0  // layout option pair_dn (flag emitted only when on; with MK_CLUSTER=2)
#endif
// Every thread of every block of the cluster; orders shared-memory stores into the cluster's blocks (DSMEM)
// before the loads after it (arrive has release, wait acquire semantics).
MK_DEVICE void cluster_sync() {
#ifdef MK_EMU
  mk_emu_cluster_sync();
#else
  __cluster_barrier_arrive();
  __cluster_barrier_wait();
#endif
}

// ---- reductions ----
MK_DEVICE float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
MK_DEVICE float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Block-wide sum; `scratch` holds >= 32 floats; every thread gets the result.
MK_DEVICE float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = lane < nw ? scratch[lane] : 0.f;
  return warp_sum(t);
}
// (value, index) argmax: larger value wins, ties go to the lower index.
MK_DEVICE void argmax_merge(float& v, int& i, float ov, int oi) {
  if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
}
MK_DEVICE void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    float ov = __shfl_xor_sync(0xffffffffu, v, o);
    int oi = __shfl_xor_sync(0xffffffffu, i, o);
    argmax_merge(v, i, ov, oi);
  }
}

// ---- grid barrier: one monotonically growing arrival counter (no reset on the critical path);
// barrier number e completes when the counter reaches e * gridDim.x. ----
MK_DEVICE unsigned ld_acquire(const unsigned* p) {
#ifdef MK_EMU
  return mk_emu_ld_acquire(p);
#else
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
#endif
}
// Spin until *p reaches target (wrapping compare). Polling with relaxed loads and one fence after
// (as cooperative groups' grid sync does) measured 2% slower on llama-3.2-1b than an acquire per poll.
MK_DEVICE void wait_reach(const unsigned* p, unsigned target) {
  while ((int)(ld_acquire(p) - target) < 0) { }
}
#ifndef MK_NORM_EARLY
#define MK_NORM_EARLY 0  // layout option norm_early (flag emitted only when on)
#endif
// The residual prologues' RMSNorm weights: with MK_NORM_EARLY loaded with the residual and partials (one L2
// round trip), not after the block reduction (a second one on the critical path: the timeline probe measured
// the QKV / MLP prologues, per-layer weights, at 2.0 / 1.85 µs and the LM head's, one weight vector every step
// so mostly in L1, at 0.93 µs). Used inside a prologue's loops over k < kIt (element i = thread + k * threads).
#if MK_NORM_EARLY
#define MK_NW_DECL float nw_[kIt];
#define MK_NW_LOAD(k, i) nw_[k] = (i) < MK_H ? w[i] : 0.f;
#define MK_NW(k, i) nw_[k]
#else
#define MK_NW_DECL
#define MK_NW_LOAD(k, i)
#define MK_NW(k, i) w[i]
#endif

#ifndef MK_ZERO_SPREAD
#define MK_ZERO_SPREAD 0  // layout option zero_spread (flag emitted only when on)
#endif
// Zero n int64 accumulator words before the next grid barrier. Block-strided, the first n/512 blocks
// store everything and their barrier arrival (a fence) waits for those stores: the timeline probe
// found blocks 1..4 last at the QKV barrier. MK_ZERO_SPREAD gives every block an equal run instead.
MK_DEVICE void zero_acc(long long* acc, int n) {
#if MK_ZERO_SPREAD
  const int per = (n + (int)gridDim.x - 1) / (int)gridDim.x, i = (int)blockIdx.x * per + (int)threadIdx.x;
  for (int k = i; k < min(n, ((int)blockIdx.x + 1) * per); k += MK_THREADS) acc[k] = 0;
#else
  for (int i = blockIdx.x * MK_THREADS + threadIdx.x; i < n; i += gridDim.x * MK_THREADS) acc[i] = 0;
#endif
}

template <int kArriver>
MK_DEVICE void grid_barrier(unsigned* count, unsigned& epoch) {
  __syncthreads();
  epoch++;
  if (threadIdx.x == kArriver) {
    const unsigned target = epoch * gridDim.x;
#if MK_BAR_RELEASE
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(count) : "memory");
#else
    __threadfence();
    atomicAdd(count, 1u);
#endif
    wait_reach(count, target);
  }
  __syncthreads();
}

// ---- Philox4x32-10 counter-based RNG: same (seed, counter) -> same numbers ----
MK_DEVICE uint4 philox4x32(uint4 ctr, uint2 key) {
#pragma unroll
  for (int r = 0; r < 10; r++) {
    unsigned hi0 = __umulhi(0xD2511F53u, ctr.x), lo0 = 0xD2511F53u * ctr.x;
    unsigned hi1 = __umulhi(0xCD9E8D57u, ctr.z), lo1 = 0xCD9E8D57u * ctr.z;
    ctr = make_uint4(hi1 ^ ctr.y ^ key.x, lo1, hi0 ^ ctr.w ^ key.y, lo0);
    key.x += 0x9E3779B9u;
    key.y += 0xBB67AE85u;
  }
  return ctr;
}
// Standard Gumbel noise for (seed, step, token): argmax(logit/T + g) samples softmax(logit/T).
MK_DEVICE float gumbel(unsigned long long seed, int step, int token) {
  uint4 r = philox4x32(make_uint4((unsigned)token, (unsigned)step, 0x6d6b6e6cu, 0u),
                       make_uint2((unsigned)seed, (unsigned)(seed >> 32)));
  float u = ((r.x >> 8) + 0.5f) * (1.0f / 16777216.0f);  // (0, 1)
  return -__logf(-__logf(u));
}
