// The CUDA built-ins the monokernel uses, emulated on the CPU (replicas/monokernel_emu.py prepends this
// to the assembled kernel source and builds it with g++ -DMK_EMU). Tests only: it runs the real kernel
// code, every phase and index, on a tiny model with a small grid, so layout and indexing bugs show up
// without a GPU. Not a performance model.
//
// Every CUDA thread is a fiber (own stack, a 6-register context switch); one OS thread runs them all
// (the scheduler's state is thread_local: launches in different OS threads run side by side),
// cooperatively, so atomics are plain read-modify-writes and there are no data races. A fiber gives
// up the CPU only at a synchronisation point: __syncthreads, __syncwarp, a shuffle, an mma, or a spin
// load (ld_acquire). Warp-collective operations are barriers over the warp's 32 fibers with the
// values deposited in a per-warp buffer (double-buffered by round, so a lane can start the next
// collective while slower lanes still read this one). cp.async copies at once (its waits then
// never wait). Blocks share nothing but global memory, as on the GPU.
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <stdio.h>
#include <sys/mman.h>

#include <vector>

#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(a, b)
#define __align__(n) alignas(n)

struct uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct dim3u { unsigned x, y, z; };
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

namespace mk_emu {
struct Fiber {
  void* sp = nullptr;  // saved stack pointer while switched out
  dim3u tid{0, 0, 0}, bid{0, 0, 0};
  bool done = false;
  const unsigned* wait = nullptr;  // at a barrier: the round word it waits to change from wait_round
  unsigned wait_round = 0;
  unsigned char* stack = nullptr;  // its `stack_bytes` in the launch's FiberStacks; the lowest 8 hold a canary
};
// Every fiber's stack in one mapping on huge pages where the kernel allows (madvise): the scheduler switches to
// every fiber at every barrier, so the fibers' live stack tops are the launch's hot working set; separately
// allocated 256 KB stacks put each top on a 4 KB page of its own. A 40-token tiny-model generation: 9.5 s with
// those, 8.6 s packed on 4 KB pages, 7.3 s packed on huge pages (session 21; most of what is left is the switch's
// first load from the next fiber's stack).
struct FiberStacks {
  static constexpr size_t kHuge = 2u << 20;
  unsigned char* base = nullptr;  // the mapping (nullptr: it failed)
  unsigned char* first = nullptr;  // fiber 0's stack: the first huge-page boundary in it
  size_t bytes = 0, stack_bytes = 0;
  FiberStacks(size_t n, size_t stack_bytes) : bytes(n * stack_bytes + kHuge), stack_bytes(stack_bytes) {
    void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return;
    base = static_cast<unsigned char*>(m);
    first = (unsigned char*)(((uintptr_t)base + kHuge - 1) & ~(uintptr_t)(kHuge - 1));
    madvise(first, n * stack_bytes, MADV_HUGEPAGE);  // (a hint: without it, plain pages)
  }
  ~FiberStacks() { if (base) munmap(base, bytes); }
  unsigned char* stack(size_t i) const { return first + i * stack_bytes; }
};
constexpr unsigned long long kStackCanary = 0x6d6b5f656d755f21ull;
struct Warp {  // one warp's collective state
  unsigned arrived = 0, round = 0;
  unsigned long long vals[2][32][10];  // per round parity: each lane's deposited words
};
struct Block {
  unsigned arrived = 0, round = 0;  // __syncthreads
  unsigned c_arrived = 0, c_round = 0;  // the cluster barrier (kept in each cluster's first block)
  std::vector<Warp> warps;
  std::vector<unsigned char> smem;
};
inline thread_local Fiber* cur = nullptr;
inline thread_local void* sched_sp = nullptr;
inline thread_local std::vector<Block>* blocks = nullptr;
inline thread_local dim3u grid{1, 1, 1}, block{1, 1, 1};
inline thread_local unsigned long long clock_ns = 0;
inline thread_local bool trapped = false;  // __trap(): the launch ends at once (run returns 2)
}  // namespace mk_emu

// switch stacks: save the callee-saved registers on this stack, store rsp in *from, load `to`, pop, ret
extern "C" void mk_emu_switch(void** from, void* to);
__asm__(
    ".text\n.globl mk_emu_switch\n.type mk_emu_switch,@function\nmk_emu_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n  ret\n");

namespace mk_emu {
inline void yield() { mk_emu_switch(&cur->sp, sched_sp); }
inline Block& my_block() { return (*blocks)[cur->bid.x]; }
inline Warp& my_warp() { return my_block().warps[cur->tid.x >> 5]; }
inline unsigned lane() { return cur->tid.x & 31; }
inline unsigned char* block_smem() { return my_block().smem.data(); }
// Wait for a barrier's round word to move on; the scheduler passes over this fiber without switching to it
// until it has (most of an emulated launch is fibers waiting at barriers).
inline void wait_round_change(const unsigned& round, unsigned r) {
  cur->wait = &round;
  cur->wait_round = r;
  while (round == r) yield();
  cur->wait = nullptr;
}

// Deposit n words, wait for the whole warp, return the round's buffer (valid until the next-but-one collective).
inline unsigned long long (*warp_exchange(const unsigned long long* words, int n))[10] {
  Warp& w = my_warp();
  const unsigned r = w.round;
  memcpy(w.vals[r & 1][lane()], words, sizeof(unsigned long long) * n);
  if (++w.arrived == 32) {
    w.arrived = 0;
    w.round++;
  } else {
    wait_round_change(w.round, r);
  }
  return w.vals[r & 1];
}
}  // namespace mk_emu

#define threadIdx (mk_emu::cur->tid)
#define blockIdx (mk_emu::cur->bid)
#define blockDim (mk_emu::block)
#define gridDim (mk_emu::grid)

inline void __syncthreads() {
  mk_emu::Block& b = mk_emu::my_block();
  const unsigned r = b.round;
  if (++b.arrived == mk_emu::block.x) {
    b.arrived = 0;
    b.round++;
  } else {
    mk_emu::wait_round_change(b.round, r);
  }
}
inline void __syncwarp(unsigned = 0xffffffffu) {
  unsigned long long none = 0;
  mk_emu::warp_exchange(&none, 1);
}
// Thread-block clusters of MK_CLUSTER consecutive blocks (the kernel's __cluster_dims__, layout option pair_norm):
// a block's rank, another block's shared memory at the same offset (DSMEM), and the cluster barrier.
#ifndef MK_CLUSTER
#define MK_CLUSTER 1
#endif
#define __cluster_dims__(x, y, z)
inline unsigned __clusterRelativeBlockRank() { return mk_emu::cur->bid.x % MK_CLUSTER; }
inline mk_emu::Block& mk_emu_cluster_block(unsigned rank) {
  return (*mk_emu::blocks)[mk_emu::cur->bid.x - mk_emu::cur->bid.x % MK_CLUSTER + rank];
}
inline void* __cluster_map_shared_rank(const void* ptr, unsigned rank) {
  const size_t off = static_cast<const unsigned char*>(ptr) - mk_emu::block_smem();
  return mk_emu_cluster_block(rank).smem.data() + off;
}
inline void mk_emu_cluster_sync() {  // barrier.cluster.arrive + wait over every thread of the cluster's blocks
  mk_emu::Block& b = mk_emu_cluster_block(0);
  const unsigned r = b.c_round;
  if (++b.c_arrived == MK_CLUSTER * mk_emu::block.x) {
    b.c_arrived = 0;
    b.c_round++;
  } else {
    mk_emu::wait_round_change(b.c_round, r);
  }
}
template <class T>
inline T mk_emu_shfl(T v, unsigned src) {
  static_assert(sizeof(T) <= 8, "shuffle of a word");
  unsigned long long w = 0;
  memcpy(&w, &v, sizeof(T));
  auto vals = mk_emu::warp_exchange(&w, 1);
  T out;
  memcpy(&out, &vals[src & 31][0], sizeof(T));
  return out;
}
template <class T>
inline T __shfl_sync(unsigned, T v, int src) { return mk_emu_shfl(v, (unsigned)src); }
template <class T>
inline T __shfl_xor_sync(unsigned, T v, int mask) { return mk_emu_shfl(v, mk_emu::lane() ^ (unsigned)mask); }

// Fences order this fiber's memory operations for other OS threads too: the tensor-parallel emulation runs each
// rank's grid on its own OS thread (replicas/monokernel_emu_tp.py), and the peers read what a rank published.
// __trap(): as on the GPU, every thread of the grid stops now; the launch reports an error (run returns 2).
inline void __trap() {
  mk_emu::trapped = true;
  for (;;) mk_emu::yield();  // (never resumed: the scheduler stops at the flag)
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
// A resident launch's idle wait (csrc/mk_batch.cuh): real time and a real sleep, so the host thread that
// writes the admission words runs meanwhile.
inline unsigned long long mk_emu_real_ns() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (unsigned long long)t.tv_sec * 1000000000ull + (unsigned long long)t.tv_nsec;
}
inline void __nanosleep(unsigned ns) {
  timespec t{0, (long)ns};
  nanosleep(&t, nullptr);
}
template <class T>
inline T __ldcg(const T* p) { return *p; }
template <class T>
inline T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }
template <class T>
inline T atomicMax(T* p, T v) { T old = *p; if (v > old) *p = v; return old; }

inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __ll2float_rn(long long v) { return (float)v; }
inline long long __float2ll_rn(float v) { return llrintf(v); }
inline float __int2float_rn(int v) { return (float)v; }
// (as cvt.rni.s32.f32: round to nearest even, saturating; NaN -> 0)
inline int __float2int_rn(float v) {
  if (v != v) return 0;
  if (v >= 2147483648.f) return 2147483647;
  if (v <= -2147483648.f) return (-2147483647 - 1);
  return (int)lrintf(v);
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
// position of the offset-th set bit of mask at or above base (offset >= 1), else 0xffffffff
inline unsigned __fns(unsigned mask, unsigned base, int offset) {
  for (unsigned i = base; i < 32; i++)
    if (((mask >> i) & 1u) && --offset == 0) return i;
  return 0xffffffffu;
}
template <class A, class B>
inline auto min(A a, B b) -> decltype(a + b) { return a < b ? a : b; }
template <class A, class B>
inline auto max(A a, B b) -> decltype(a + b) { return a < b ? b : a; }

struct __nv_bfloat16 { uint16_t bits; };
inline __nv_bfloat16 __float2bfloat16_rn(float f) {  // round to nearest even (NaN kept quiet)
  unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {(uint16_t)((u >> 16) | 0x40u)};
  return {(uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}

// ---- the operations the kernel headers implement with PTX (their MK_EMU branches call these) ----
inline void mk_emu_cp_async16(void* smem, const void* gmem) { memcpy(smem, gmem, 16); }
inline unsigned mk_emu_ld_acquire(const unsigned* p) {
  mk_emu::yield();  // a spin load: let the fiber being waited for run
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);  // (a peer rank's OS thread may have written it)
}
inline unsigned long long mk_emu_globaltimer() { return mk_emu::clock_ns += 1000; }
// mma.m16n8k16 bf16 -> fp32 for the warp: every lane deposits its fragments, each computes its own
// four outputs from the whole A (16 x 16) and B (16 x 8) tiles (PTX ISA fragment layouts), in fp32.
inline void mk_emu_mma_16816(float (&d)[4], const uint4& a, const uint2& b) {
  unsigned long long w[6] = {a.x, a.y, a.z, a.w, b.x, b.y};
  auto vals = mk_emu::warp_exchange(w, 6);
  auto bf = [](unsigned long long word, int hi) { return __uint_as_float(((unsigned)(word >> (16 * hi)) & 0xffffu) << 16); };
  auto A = [&](int row, int k) {  // lane 4(row & 7) + (k & 7) / 2, register (row >= 8) + 2 (k >= 8)
    return bf(vals[4 * (row & 7) + ((k & 7) >> 1)][(row >> 3) + 2 * (k >> 3)], k & 1);
  };
  auto B = [&](int k, int col) { return bf(vals[4 * col + ((k & 7) >> 1)][4 + (k >> 3)], k & 1); };
  const int g = (int)mk_emu::lane() >> 2, t = (int)mk_emu::lane() & 3;
  for (int j = 0; j < 4; j++) {
    const int row = g + 8 * (j >> 1), col = 2 * t + (j & 1);
    float s = d[j];
    for (int k = 0; k < 16; k++) s = fmaf(A(row, k), B(k, col), s);
    d[j] = s;
  }
}

namespace mk_emu {
using Kernel = void (*)(const void*);
inline thread_local Kernel entry = nullptr;
inline thread_local const void* entry_arg = nullptr;
extern "C" inline void mk_emu_trampoline() {
  entry(entry_arg);
  cur->done = true;
  mk_emu_switch(&cur->sp, sched_sp);
}
// Run kernel(arg) on grid x block threads with `smem_bytes` of dynamic shared memory per block.
inline int run(Kernel kernel, const void* arg, unsigned nblocks, unsigned nthreads, size_t smem_bytes,
               size_t stack_bytes, unsigned long long max_switches) {
  grid = {nblocks, 1, 1};
  block = {nthreads, 1, 1};
  entry = kernel;
  entry_arg = arg;
  std::vector<Block> bl(nblocks);
  for (auto& b : bl) {
    b.warps.resize((nthreads + 31) / 32);
    b.smem.assign(smem_bytes + 16, 0);
  }
  blocks = &bl;
  std::vector<Fiber> fibers(nblocks * nthreads);
  if (stack_bytes % 64 || stack_bytes < 4096) return 4;
  FiberStacks stacks(fibers.size(), stack_bytes);
  if (!stacks.base) return 4;
  for (unsigned i = 0; i < fibers.size(); i++) {
    Fiber& f = fibers[i];
    f.bid = {i / nthreads, 0, 0};
    f.tid = {i % nthreads, 0, 0};
    f.stack = stacks.stack(i);
    memcpy(f.stack, &kStackCanary, sizeof kStackCanary);
    uintptr_t top = ((uintptr_t)(f.stack + stack_bytes)) & ~(uintptr_t)15;
    void** sp = (void**)top;
    *--sp = nullptr;                          // (alignment: the trampoline is entered with rsp = 8 mod 16)
    *--sp = (void*)&mk_emu_trampoline;        // `ret` of the first switch lands here
    for (int r = 0; r < 6; r++) *--sp = nullptr;  // rbp rbx r12 r13 r14 r15
    f.sp = sp;
  }
  unsigned long long switches = 0;
  size_t left = fibers.size();
  trapped = false;
  while (left) {
    bool ran = false;
    for (auto& f : fibers) {
      if (f.done || (f.wait && *f.wait == f.wait_round)) continue;
      ran = true;
      cur = &f;
      mk_emu_switch(&sched_sp, f.sp);
      if (trapped) { cur = nullptr; return 2; }  // (the fibers' stacks are dropped unfinished)
      if (f.done) left--;
      if (++switches > max_switches) return 1;  // deadlock or a runaway kernel
    }
    if (!ran) return 1;  // every fiber left waits at a barrier that no running fiber can reach: deadlock
  }
  cur = nullptr;
  for (auto& f : fibers) {
    if (memcmp(f.stack, &kStackCanary, sizeof kStackCanary)) return 3;  // a fiber outgrew its stack
  }
  return 0;
}
}  // namespace mk_emu
