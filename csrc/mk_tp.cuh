// Tensor parallelism inside the kernel (MK_TP > 1 GPUs, one persistent kernel each).
//
// Every GPU holds a shard (replicas/tp_shard.py): its q/kv heads, intermediate rows and a
// vocabulary slice of MK_V rows starting at global id tp_rank * MK_V. The O- and down-projection
// outputs are partials of the full hidden vector: after the phase's local grid barrier, every
// block sums its slice of elements' local k-split partials and stores them into every GPU's
// receive buffer [H][N] at column tp_rank (peer memory over NVLink), then signals each GPU with
// one `red.release.sys` on that GPU's arrival counter for this source. Counters grow forever
// (one per block per exchange), so exchange e is complete on a GPU when every source's counter
// reaches e * gridDim.x: no reset, no flag reuse. The consumer (residual_norm<MK_TP>) then adds
// the N columns in rank order 0..N-1, so every GPU computes a bitwise identical residual stream.
//
// Buffer reuse: the O and down receive buffers alternate, and a GPU can only write exchange e+2
// into a buffer after exchange e+1 completed, which needs every block of every GPU to have
// contributed to e+1, i.e. to have finished reading e.
//
// Token choice: each GPU reduces its slice to (best key, global id); block 0 thread 0 sends it,
// with rank 0's copy of the host cancel flag, to every GPU (data, then st.release.sys of the
// step-numbered flag; two slots by step parity). Every block merges the N messages in rank
// order (larger key, then lower id wins), so every GPU picks the same token and takes the same cancel/stop/length decision at
// the same step: no GPU can leave the loop while a peer still waits for it.
// top-k/top-p additionally gathers every GPU's logits slice into each GPU's full-vocabulary
// buffer (a bulk exchange), where block 0 samples exactly as the single-GPU kernel does.
#pragma once
#include "mk_common.cuh"
#include "mk_layout.cuh"

#if MK_TP > 1
static_assert(MK_TP == 2 || MK_TP == 4 || MK_TP == 8, "tensor parallelism over 2, 4 or 8 GPUs");
static_assert(MK_V * MK_TP >= MK_V_ALL, "vocabulary slices cover the vocabulary");
static_assert(MK_TP_OFF_TOKVAL - MK_TP_OFF_TOKFLAG >= 2 * MK_TP && MK_TP_OFF_RECV_O >= MK_TP_OFF_TOKCANCEL + 2 * MK_TP,
              "exchange region header: two message slots per source");

// What the layer loop sums after the O- and down-projections: the N GPUs' partials.
constexpr int kSumO = MK_TP, kSumDN = MK_TP;
#define MK_O_SRC(p) ((p).tp_local + MK_TP_OFF_RECV_O)
#define MK_DN_SRC(p) ((p).tp_local + MK_TP_OFF_RECV_DN)

#ifdef MK_EMU  // (one process, a rank per OS thread: the peers' words are host memory; monokernel_emu_tp.py)
MK_DEVICE unsigned ld_acquire_sys(const unsigned* p) { return mk_emu_ld_acquire(p); }
MK_DEVICE void st_release_sys(unsigned* p, unsigned v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
MK_DEVICE void red_release_sys_add(unsigned* p, unsigned v) { __atomic_fetch_add(p, v, __ATOMIC_RELEASE); }
#else
MK_DEVICE unsigned ld_acquire_sys(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
MK_DEVICE void st_release_sys(unsigned* p, unsigned v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
MK_DEVICE void red_release_sys_add(unsigned* p, unsigned v) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
#endif
MK_DEVICE unsigned* tp_words(float* region, int off) { return reinterpret_cast<unsigned*>(region + off); }

// Wait until the word `w` (a peer's count or flag) reaches `target`. A peer that died, or whose kernel never
// started, would keep every GPU of the group spinning forever, with the host none the wiser: after
// p.tp_timeout_ns the kernel reports STATUS_PEER_TIMEOUT in its host words and traps, which ends every block
// of this grid at once (its blocks may be anywhere in the step; only a trap stops them all) and loses the CUDA
// context: the host raises EngineFailed and the replica has to be restarted. The peers time out the same way.
MK_DEVICE void tp_wait(const MkParams& p, const unsigned* w, unsigned target) {
  if ((int)(ld_acquire_sys(w) - target) >= 0) return;
  const unsigned long long t0 = global_ns();
  while ((int)(ld_acquire_sys(w) - target) < 0) {
    if (global_ns() - t0 > p.tp_timeout_ns) {
      volatile int* ctrl = p.host_ctrl;
      ctrl[MK_CTRL_STATUS] = MK_STATUS_PEER_TIMEOUT;
      __threadfence_system();
      ctrl[MK_CTRL_DONE] = 1;
      __threadfence_system();
      __trap();
    }
  }
}

// The end of a bulk exchange: this block's stores are out; count it at every GPU, then wait
// until every source has counted all its blocks for exchange number `exchanges`.
MK_DEVICE void tp_signal_and_wait(const MkParams& p, unsigned& exchanges) {
  __syncthreads();
  exchanges++;
  if (threadIdx.x == 0) {
    __threadfence_system();
    const int rank = (int)p.tp_rank;
#pragma unroll
    for (int g = 0; g < MK_TP; g++) red_release_sys_add(tp_words(p.tp_peers[g], MK_TP_OFF_COUNT) + rank, 1u);
    const unsigned target = exchanges * gridDim.x;
    const unsigned* count = tp_words(p.tp_local, MK_TP_OFF_COUNT);
#pragma unroll
    for (int g = 0; g < MK_TP; g++) tp_wait(p, count + g, target);
  }
  __syncthreads();
}

// All-reduce of a phase's output (after its local grid barrier): `parts` [H][S] local partials.
template <int S>
MK_DEVICE void tp_all_reduce(const MkParams& p, const float* parts, int off_recv, unsigned& exchanges) {
#if !MK_TP_SKIP_AR
  const int rank = (int)p.tp_rank;
  const int per = (MK_H + gridDim.x - 1) / gridDim.x;
  const int i0 = blockIdx.x * per, i1 = min(MK_H, i0 + per);
  for (int i = i0 + threadIdx.x; i < i1; i += MK_THREADS) {
    float v = 0.f;
#pragma unroll
    for (int q = 0; q < S; q++) v += __ldcg(parts + (long long)i * S + q);
#pragma unroll
    for (int g = 0; g < MK_TP; g++) p.tp_peers[g][off_recv + i * MK_TP + rank] = v;
  }
  tp_signal_and_wait(p, exchanges);
#endif
}

// top-k/top-p: every GPU's logits slice [MK_V] into every GPU's full buffer at rank * MK_V.
MK_DEVICE void tp_gather_logits(const MkParams& p, const float* local, unsigned& exchanges) {
  const int rank = (int)p.tp_rank;
  const int per = (MK_V + gridDim.x - 1) / gridDim.x;
  const int j0 = blockIdx.x * per, j1 = min(MK_V, j0 + per);
  for (int j = j0 + threadIdx.x; j < j1; j += MK_THREADS) {
    const float v = __ldcg(local + j);
#pragma unroll
    for (int g = 0; g < MK_TP; g++) p.tp_peers[g][MK_TP_OFF_LOGITS + rank * MK_V + j] = v;
  }
  tp_signal_and_wait(p, exchanges);
}

// Every block: this GPU's best (key, global id) over all warps' bests (as reduce_best).
MK_DEVICE void tp_local_best(const MkParams& p, float* s_red, float& v, int& i) {
  const int nw = gridDim.x * kStreamWarps;
  v = -INFINITY; i = 0x7fffffff;
  for (int w = threadIdx.x; w < nw; w += MK_THREADS) argmax_merge(v, i, __ldcg(p.best_val + w), __ldcg(p.best_idx + w));
  warp_argmax(v, i);
  int* s_idx = reinterpret_cast<int*>(s_red + 32);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) { s_red[threadIdx.x >> 5] = v; s_idx[threadIdx.x >> 5] = i; }
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < kWarps ? s_red[threadIdx.x] : -INFINITY;
    i = threadIdx.x < kWarps ? s_idx[threadIdx.x] : 0x7fffffff;
    warp_argmax(v, i);
  }
  // thread 0 holds the result
}

// Every block: the global token of this step (same on every GPU) and rank 0's cancel flag.
MK_DEVICE int tp_choose(const MkParams& p, float* s_red, int step, int& cancel) {
  float v; int i;
  tp_local_best(p, s_red, v, i);
  const unsigned flag = (unsigned)step + 1u;
  const int rank = (int)p.tp_rank;
  // Message slots alternate by step parity: a GPU rewrites slot (s+1)&1 only after every GPU's
  // step-s message arrived, i.e. after every GPU's block 0 (so, by its grid barriers, every block)
  // finished step s-1 and its read of that slot -- with or without the layer all-reduces.
  const int slot = (step & 1) * MK_TP;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    const int c = rank == 0 ? p.cancel_step[0] : 0;  // written by this thread at the step's start
#pragma unroll
    for (int g = 0; g < MK_TP; g++) {
      float* r = p.tp_peers[g];
      r[MK_TP_OFF_TOKVAL + slot + rank] = v;
      reinterpret_cast<int*>(r)[MK_TP_OFF_TOKID + slot + rank] = i;
      reinterpret_cast<int*>(r)[MK_TP_OFF_TOKCANCEL + slot + rank] = c;
    }
    __threadfence_system();
#pragma unroll
    for (int g = 0; g < MK_TP; g++) st_release_sys(tp_words(p.tp_peers[g], MK_TP_OFF_TOKFLAG) + slot + rank, flag);
  }
  int* s_idx = reinterpret_cast<int*>(s_red + 32);
  if (threadIdx.x == 0) {
    const unsigned* flags = tp_words(p.tp_local, MK_TP_OFF_TOKFLAG);
    float bv = -INFINITY; int bi = 0x7fffffff;
#pragma unroll
    for (int g = 0; g < MK_TP; g++) {
      tp_wait(p, flags + slot + g, flag);
      argmax_merge(bv, bi, __ldcg(p.tp_local + MK_TP_OFF_TOKVAL + slot + g),
                   __ldcg(reinterpret_cast<const int*>(p.tp_local) + MK_TP_OFF_TOKID + slot + g));
    }
    s_idx[32] = bi;
    s_idx[33] = __ldcg(reinterpret_cast<const int*>(p.tp_local) + MK_TP_OFF_TOKCANCEL + slot);
  }
  __syncthreads();
  const int tok = s_idx[32];
  cancel = s_idx[33];
  __syncthreads();
  return tok;
}
#else
constexpr int kSumO = MK_S_O, kSumDN = MK_S_DN;
#define MK_O_SRC(p) ((p).o_part)
#define MK_DN_SRC(p) ((p).dn_part)
#endif
