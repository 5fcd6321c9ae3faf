// The monokernel: one persistent, cooperative launch decodes a whole generation of one sequence.
// This file is the one place that sequences the phases; each phase lives in its own header.
//
// Per step:  LM head (from the previous hidden state) | sample, emit, stop check |
//            per layer: QKV | attention (+KV append) | O-proj | gate/up+SiLU | down      ("|" = grid barrier)
// Residual adds and RMSNorms are done redundantly by every block at the start of the phase that
// needs them (the vector is tiny); block 0 writes the new residual stream to the other half of
// xbuf. Matvec outputs are per-unit partials the next phase sums (deterministic, no atomics).
// With MK_TP > 1 GPUs (mk_tp.cuh) the O and down outputs are all-reduced over the GPUs and the
// token is chosen from every GPU's vocabulary slice; MK_TP == 1 compiles exactly the code above.
// With MK_BATCH = B > 1 (mk_batch.cuh) B slots decode together: every phase loops over the slots
// where it touches activations, once per weight chunk; a slot that finishes stops being decoded
// (its bit leaves `live`) and the launch ends when none is left. Any build given host_kctl also ends
// at a step boundary the host asks for (host_kctl[MK_KCTL_YIELD], to admit a request: the batched
// engine's next launch resumes every slot; kctl gets the exit state). A resident batch build instead
// admits requests into free slots at a step boundary, and waits (p.idle_ns) when none is decoding.
#include "mk_params.cuh"
#include "mk_common.cuh"
#include "mk_layout.cuh"
#include "mk_timeline.cuh"
#include "mk_stream.cuh"
#include "mk_attention.cuh"
#include "mk_sample.cuh"
#include "mk_tp.cuh"
#include "mk_batch.cuh"
// (unconditionally: kAccRows sizes the fused accumulators of every build)
#include "mk_fx_pack.cuh"
#if MK_FUSED_MLP
#include "mk_fused.cuh"
#include "mk_block_mma.cuh"
#include "mk_mlp_mma.cuh"
#endif
#if MK_ATTN_O
#include "mk_attn_o.cuh"
#endif
#if MK_FUSED_MLP && MK_ATTN_O
#include "mk_fold.cuh"
#endif
// A batch prologue's loader of the last fused-MLP accumulator (turn `turn`): one load per slot, or with fx_pack
// one per pair of slots (mk_fx_pack.cuh)
#if MK_FX_PACK
#define MK_FX_SRC(turn) pair_load([&](int c, int i) { return fx_load2(p, (turn), c, i); })
#else
#define MK_FX_SRC(turn) [&](int b, int i) { return fx_load(p, slot_x(p, xi, b), (turn), b, i); }
#endif

// x = base (residual stream or embedding row) + S partials (+bias); block 0 stores x to xdst;
// s_act = RMSNorm(x) * w. Loads are unrolled so each thread has all of its loads in flight.
template <int S>
MK_DEVICE void residual_norm(const float* xsrc, const uint16_t* emb_row, const float* parts,
                             const float* bias, float* xdst, const float* w, float* s_act, float* s_red) {
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
      x = emb_row ? bf16_to_f32(emb_row[i]) : __ldcg(xsrc + i);
#pragma unroll
      for (int q = 0; q < S; q++) x += __ldcg(parts + (long long)i * S + q);
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
      act_store(s_act, 0, i, i < MK_H ? v[k] * r * MK_NW(k, i) : 0.f);
    }
  }
  __syncthreads();
}

// s_act[0..NPAD) = src[0..N) then zeros.
template <int N, int NPAD>
MK_DEVICE void stage_vector(const float* src, float* s_act) {
#pragma unroll
  for (int k = 0; k < (NPAD + MK_THREADS - 1) / MK_THREADS; k++) {
    const int i = threadIdx.x + k * MK_THREADS;
    if (i < NPAD) act_store(s_act, 0, i, i < N ? __ldcg(src + i) : 0.f);
  }
  __syncthreads();
}

#if MK_CLUSTER == 2
#define MK_CLUSTER_DIMS __cluster_dims__(2, 1, 1)  // (pairs of blocks: mk_batch.cuh residual_norm_slots, mk_mlp_mma.cuh)
#else
#define MK_CLUSTER_DIMS
#endif
#if MK_PARAM_VALUE && !defined(MK_EMU)
// The parameter block by value: every p.field is a constant-bank operand, not a global load the
// profiler saw stall on (long scoreboard) at each run switch, epilogue and prologue.
extern "C" __global__ void MK_CLUSTER_DIMS __launch_bounds__(MK_THREADS, 1) monokernel(const __grid_constant__ MkParams p) {
#else
extern "C" __global__ void MK_CLUSTER_DIMS __launch_bounds__(MK_THREADS, 1) monokernel(const MkParams* __restrict__ pp) {
  const MkParams& p = *pp;
#endif
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* ring = reinterpret_cast<uint4*>(smem);
  float* s_act = reinterpret_cast<float*>(smem + (size_t)kStreamWarps * MK_RING * 512);
  float* s_red = s_act + MK_ACT_FLOATS;
  const int warp = threadIdx.x >> 5;

  WeightStream st;
  st.init(p, ring + min(warp, kStreamWarps - 1) * MK_RING * 32);
  unsigned epoch = 0;
#if MK_TP > 1
  unsigned exchanges = 0;  // bulk exchanges with the peer GPUs so far (mk_tp.cuh)
  const int vbase = (int)p.tp_rank * MK_V;  // global id of this GPU's first vocabulary row
#endif
#if MK_FUSED_MLP
#if MK_BATCH > 1
  constexpr int kFxSlice = MK_FX_SLICE;  // floats of one slot's h slice (mk_fused.cuh)
  unsigned fx_turn = (unsigned)p.fx_turn0;  // resumed launches continue the accumulator parity
#else
  constexpr int kFxSlice = 0;
  unsigned fx_turn = 0;  // fused MLP phases so far: accumulator fx_turn & 1 is being added to
#endif
#endif
#if MK_ATTN_O
  unsigned ao_target = 0;  // attention splits each kv group has published so far (attn_cnt)
#endif
  unsigned qkv_target = 0;  // running count of QKV units each kv group has finished (MK_QKV_FLAGS)
  int xi = 0;  // xbuf half holding the residual stream
  unsigned live = 0;  // slots still decoding in this launch (bit b), the same in every block
#if MK_RESIDENT
  unsigned admit_seen = 0;  // the host's last admission sequence number this launch consumed (KCTL_ADMIT_SEQ)
  unsigned joined = 0;      // slots that joined at this step's boundary: their LM head starts from admit_x
  for (int b = 0; b < kB; b++) resident_load_slot(p, b, 0, false);
#endif
#pragma unroll
  for (int b = 0; b < kB; b++) if (MK_SLOT_ACTIVE(p, b)) live |= 1u << b;
  // Optional phase timing (block 0, thread 0): ns spent from one barrier to the next, per phase kind.
  const bool prof_on = p.profile != nullptr && blockIdx.x == 0 && threadIdx.x == 0;
  // prof[0..5]: barrier-to-barrier ns per phase kind; prof[6]: steps; prof[7..12]: of that, ns
  // block 0 spent waiting in the barrier (imbalance + barrier latency).
  unsigned long long prof[13] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  unsigned long long t_mark = prof_on ? global_ns() : 0, t_arrive = 0;
#define MK_ARRIVE() if (p.profile != nullptr) { __syncthreads(); if (prof_on) t_arrive = global_ns(); }
#define MK_MARK(k) if (prof_on) { unsigned long long t_ = global_ns(); prof[k] += t_ - t_mark; prof[7 + k] += t_ - t_arrive; t_mark = t_; }

#if MK_TIMELINE
  if (p.profile != nullptr && threadIdx.x == 0) p.profile[kTLBase + (long long)gridDim.x * kTLRowsPerBlock + blockIdx.x] = tl_smid();
#endif
  int step = 0;
  for (;; step++) {
    // the host asked to admit a request (read in the last step's final phase, so every block agrees;
    // only launches given host_kctl: the batched engine's, fused layouts)
#if MK_RESIDENT
    // or a resident launch admits the slots the host made ready, or waits for some while none decodes
    joined = resident_boundary(p, live, step, epoch, admit_seen);
    if (joined == ~0u) break;
    live |= joined;
#else
    if (step > 0 && p.host_kctl != nullptr && __ldcg(p.cancel_step + kB) != 0) break;
#endif
#if MK_TIMELINE
    unsigned long long* const tl_lm = tl_row(p, step, MK_L);
#endif
    MK_TL_AT(tl_lm, 0);
    // ---- LM head on the previous hidden state (the prefill's last one at step 0) ----
#if MK_RESIDENT && MK_FX_PACK
    residual_norm_slots<MK_MMA_LM>(live, pair_load([&](int c, int i) {
        float2 v = fx_load2(p, fx_turn - 1, c, i);
        if ((joined >> (2 * c)) & 1u) v.x = __ldcg(p.admit_x + (long long)(2 * c) * MK_HP + i);
        if ((joined >> (2 * c + 1)) & 1u) v.y = __ldcg(p.admit_x + (long long)(2 * c + 1) * MK_HP + i);
        return v; }),
      [&](int) -> float* { return nullptr; }, p.lnf, s_act, s_red);
#elif MK_RESIDENT
    residual_norm_slots<MK_MMA_LM>(live, [&](int b, int i) {
        return ((joined >> b) & 1u) ? __ldcg(p.admit_x + (long long)b * MK_HP + i) : fx_load(p, slot_x(p, xi, b), fx_turn - 1, b, i); },
      [&](int) -> float* { return nullptr; }, p.lnf, s_act, s_red);
#elif MK_BATCH > 1
    residual_norm_slots<MK_MMA_LM>(live, MK_FX_SRC(fx_turn - 1), [&](int) -> float* { return nullptr; }, p.lnf, s_act, s_red);
#elif MK_FUSED_MLP
    residual_norm_fx(slot_x(p, xi, 0), fx_acc(p, fx_turn - 1), nullptr, p.lnf, s_act, s_red);
#else
    residual_norm<kSumDN>(slot_x(p, xi, 0), nullptr, MK_DN_SRC(p), nullptr, nullptr, p.lnf, s_act, s_red);
#endif
    MK_TL_AT(tl_lm, 1);
    if (blockIdx.x == 0 && threadIdx.x == 0)
      for (int b = 0; b < kB; b++) p.cancel_step[b] = p.host_ctrl[b * MK_CTRL_WORDS + MK_CTRL_CANCEL];
    {
      float best[kB]; int best_i[kB];
#pragma unroll
      for (int b = 0; b < kB; b++) { best[b] = -INFINITY; best_i[b] = 0x7fffffff; }
      run_phase<MAT_LM>(st, p, 0, s_act, [&](long long u, const float* acc, const float*) {
#pragma unroll
        for (int b = 0; b < kB; b++) {
          if (!((live >> b) & 1u)) continue;
          p.logits[(long long)step * p.logits_per_step + (long long)b * MK_V + u] = acc[b];
          const bool gumbel_mode = MK_SLOT(p, b, mode) == MK_MODE_GUMBEL;
          const float invT = (float)MK_SLOT(p, b, inv_temperature);
#if MK_TP > 1
          const int gid = (int)u + vbase;
          if (gid < MK_V_ALL) {  // rows past the vocabulary pad the last slice
            float key = gumbel_mode ? acc[b] * invT + gumbel(p.seed, step, gid) : acc[b];
            argmax_merge(best[b], best_i[b], key, gid);
          }
#else
          float key = gumbel_mode ? acc[b] * invT + gumbel(MK_SLOT(p, b, seed), MK_SLOT_STEP0(p, b) + step, (int)u) : acc[b];
          argmax_merge(best[b], best_i[b], key, (int)u);
#endif
        }
      }, live);
#if MK_MMA || MK_MMA_LM
      // lanes 0..15 each took one row of every tile: merge them (ties: the lowest id, as one lane would)
#pragma unroll
      for (int b = 0; b < kB; b++) warp_argmax(best[b], best_i[b]);
#endif
#if MK_BLOCK_BEST
      block_best_slots(p, s_act, st, best, best_i);
#elif MK_BEST_MAX
      if (st.lane == 0 && st.gw >= 0) best_keys_put(p, step, live, best, best_i);
#else
      if (st.lane == 0 && st.gw >= 0)
#pragma unroll
        for (int b = 0; b < kB; b++) { p.best_val[b * st.nw + st.gw] = best[b]; p.best_idx[b * st.nw + st.gw] = best_i[b]; }
#endif
    }
    MK_ARRIVE();
    MK_TL_AT(tl_lm, 2);
    grid_barrier<kBarrierThread>(p.bar_count, epoch);
    MK_TL_AT(tl_lm, 3);
    MK_MARK(0);
    if (prof_on) prof[6]++;

    // ---- choose each live slot's token (same answer in every block), emit, stop checks ----
    int tok[kB];
#if MK_TP > 1
    int cancelled;
    tok[0] = tp_choose(p, s_red, step, cancelled);
    if (p.mode == MK_MODE_TOPKP) tp_gather_logits(p, p.logits + (long long)step * p.logits_per_step, exchanges);
    const float* all_logits = p.tp_local + MK_TP_OFF_LOGITS;  // indexed by global id
#elif MK_BATCH > 1
    // the slots' cancel flags (block 0 copied them at the LM phase's start) load with the bests: one round trip
    // for all slots instead of one behind each slot's branch below (3.46 us per B = 4 step in the timeline)
    int cancel_flag[kB];
#pragma unroll
    for (int b = 0; b < kB; b++) cancel_flag[b] = __ldcg(p.cancel_step + b);
#if MK_BEST_MAX
    best_keys_take(p, step, live, tok);
#else
    reduce_best_slots(p, s_act, live, tok);
#endif
    MK_TL_AT(tl_lm, 6);
#else
    tok[0] = reduce_best(p, s_red, 0);
#endif
    bool any_topkp = false;
#pragma unroll
    for (int b = 0; b < kB; b++) {
      if (!((live >> b) & 1u) || MK_SLOT(p, b, mode) != MK_MODE_TOPKP) continue;
      any_topkp = true;
      if (blockIdx.x == b % gridDim.x) {  // slot b's top-k/top-p in one block
#if MK_TP == 1
        const float* all_logits = p.logits + (long long)step * p.logits_per_step + (long long)b * MK_V;
#endif
        float M = __ldcg(all_logits + tok[b]);
        int t = sample_topkp(p, all_logits, MK_SLOT_STEP0(p, b) + step, M, s_red, b);
        if (threadIdx.x == 0) p.shared_token[b] = t;
      }
    }
    if (any_topkp) {
      grid_barrier<kBarrierThread>(p.bar_count, epoch);
#pragma unroll
      for (int b = 0; b < kB; b++)
        if (((live >> b) & 1u) && MK_SLOT(p, b, mode) == MK_MODE_TOPKP) tok[b] = __ldcg(p.shared_token + b);
    }
#if MK_BATCH > 1
    {  // every slot decided first, then block 0 emits them all behind two system fences (not two a slot)
      static_assert(MK_TP == 1, "batch builds are single-GPU");
      int status[kB];
#pragma unroll
      for (int b = 0; b < kB; b++) {
        status[b] = 0;
        if (!((live >> b) & 1u)) continue;
        const int n = MK_SLOT_STEP0(p, b) + step;
        const bool last = n + 1 >= MK_SLOT(p, b, max_steps) || slot_pos(p, b, step) + 1 >= MK_MAX_CTX;
        if (cancel_flag[b] != 0) status[b] = MK_STATUS_CANCELLED;
        else if (!p.teacher && slot_is_stop(p, b, tok[b])) status[b] = MK_STATUS_STOP;
        else if (last) status[b] = MK_STATUS_LENGTH;
        if (p.teacher && !last) tok[b] = p.forced[b * MK_MAX_CTX + n];
      }
      if (blockIdx.x == 0 && threadIdx.x == 0) {
        // per slot as in B = 1: its token before its count, its status before its done flag
        bool any_status = false;
        for (int b = 0; b < kB; b++) {
          if (!((live >> b) & 1u) || status[b] == MK_STATUS_CANCELLED || status[b] == MK_STATUS_STOP) continue;
          const int n = MK_SLOT_STEP0(p, b) + step;
          p.tokens[b * MK_MAX_CTX + n] = tok[b];
          p.host_tokens[b * MK_MAX_CTX + n] = tok[b];
        }
        __threadfence_system();
        for (int b = 0; b < kB; b++) {
          if (!((live >> b) & 1u)) continue;
          volatile int* ctrl = p.host_ctrl + b * MK_CTRL_WORDS;
          if (status[b] != MK_STATUS_CANCELLED && status[b] != MK_STATUS_STOP) ctrl[MK_CTRL_COUNT] = MK_SLOT_STEP0(p, b) + step + 1;
          if (status[b]) { ctrl[MK_CTRL_STOP_TOKEN] = tok[b]; ctrl[MK_CTRL_STATUS] = status[b]; any_status = true; }
        }
        if (any_status) {
          __threadfence_system();
          for (int b = 0; b < kB; b++)
            if (((live >> b) & 1u) && status[b]) reinterpret_cast<volatile int*>(p.host_ctrl)[b * MK_CTRL_WORDS + MK_CTRL_DONE] = 1;
        }
      }
      MK_TL_AT(tl_lm, 7);
#pragma unroll
      for (int b = 0; b < kB; b++)
        if (status[b]) { live &= ~(1u << b); tok[b] = 0; }
    }
#else
#pragma unroll
    for (int b = 0; b < kB; b++) {
      if (!((live >> b) & 1u)) continue;
      const int n = MK_SLOT_STEP0(p, b) + step;  // the slot's token index
      const bool last = n + 1 >= MK_SLOT(p, b, max_steps) || slot_pos(p, b, step) + 1 >= MK_MAX_CTX;
      int status = 0;
#if MK_TP > 1
      if (cancelled != 0) status = MK_STATUS_CANCELLED;  // rank 0's flag: every GPU stops at this step
#else
      if (__ldcg(p.cancel_step + b) != 0) status = MK_STATUS_CANCELLED;
#endif
      else if (!p.teacher && slot_is_stop(p, b, tok[b])) status = MK_STATUS_STOP;
      else if (last) status = MK_STATUS_LENGTH;
      if (p.teacher && !last) tok[b] = p.forced[b * MK_MAX_CTX + n];
      if (blockIdx.x == 0 && threadIdx.x == 0) {
        volatile int* ctrl = p.host_ctrl + b * MK_CTRL_WORDS;
        if (status != MK_STATUS_CANCELLED && status != MK_STATUS_STOP) {
          p.tokens[b * MK_MAX_CTX + n] = tok[b];
          p.host_tokens[b * MK_MAX_CTX + n] = tok[b];
          __threadfence_system();
          ctrl[MK_CTRL_COUNT] = n + 1;
        }
        if (status) {
          ctrl[MK_CTRL_STOP_TOKEN] = tok[b];
          ctrl[MK_CTRL_STATUS] = status;
          __threadfence_system();
          ctrl[MK_CTRL_DONE] = 1;
        }
      }
      if (status) { live &= ~(1u << b); tok[b] = 0; }
    }
#endif  // MK_BATCH > 1
#if MK_RESIDENT
    // No slot left: end, or (p.idle_ns > 0) wait at the next boundary for a request to join. The layers
    // still run, empty: the weight stream has run ahead into them (restarting it instead costs registers:
    // 380 vs 248 bytes of spill stores on 1B).
    if (live == 0 && p.idle_ns == 0) break;
#else
    if (live == 0) break;
#endif
    MK_TL_AT(tl_lm, 4);

    // ---- the layers, on each live slot's token at its position ----
    // layer 0's input: the tokens' embeddings
#if MK_BATCH > 1
    residual_norm_slots<MK_MMA_QKV>(live, [&](int b, int i) { return bf16_to_f32(p.embed[(long long)tok[b] * MK_H + i]); },
                                    [&](int b) { return slot_x(p, xi ^ 1, b); }, p.ln1, s_act, s_red);
#else
    residual_norm<0>(nullptr, p.embed + (long long)tok[0] * MK_H, nullptr, nullptr, slot_x(p, xi ^ 1, 0), p.ln1,
                     s_act, s_red);
#endif
    xi ^= 1;
    MK_TL_AT(tl_lm, 5);
    for (int layer = 0; layer < MK_L; layer++) {
#if MK_TIMELINE
      unsigned long long* const tl = tl_row(p, step, layer);
#endif
      MK_TL_AT(tl, 0);
      // QKV: x = x + down partials; RMSNorm (layer 0: done above).
      if (layer > 0) {
#if MK_BATCH > 1
        residual_norm_slots<MK_MMA_QKV>(live, MK_FX_SRC(fx_turn - 1), [&](int b) { return slot_x(p, xi ^ 1, b); },
                                        p.ln1 + layer * MK_H, s_act, s_red);
#elif MK_FUSED_MLP
        residual_norm_fx(slot_x(p, xi, 0), fx_acc(p, fx_turn - 1), slot_x(p, xi ^ 1, 0), p.ln1 + layer * MK_H, s_act, s_red);
#else
        residual_norm<kSumDN>(slot_x(p, xi, 0), nullptr, MK_DN_SRC(p), nullptr, slot_x(p, xi ^ 1, 0), p.ln1 + layer * MK_H,
                              s_act, s_red);
#endif
        xi ^= 1;
      }
      MK_TL_AT(tl, 1);
      l2_prefetch<MAT_GU>(st, p, layer, MK_PF_GU);
      l2_prefetch<MAT_DN>(st, p, layer, MK_PF_DN);
#if MK_MMA_QKV
      qkv_mma(st, p, s_act, live);
#else
      run_phase<MAT_QKV>(st, p, layer, s_act, [&](long long u, const float* acc, const float*) {
#pragma unroll
        for (int b = 0; b < kB; b++) if ((live >> b) & 1u) slot_qkv(p, b)[u] = acc[b];
      }, live);
#endif
#if MK_ATTN_O && MK_FOLD_X
      ao_fold_init(p, layer == 0 ? nullptr : fx_acc(p, fx_turn - 1), tok, live, layer);  // (set, not zeroed)
#elif MK_ATTN_O
      ao_zero(p);  // the O accumulators: read before the MLP's barrier, next added to after QKV's
#endif
#if MK_QKV_FLAGS
      // No grid barrier: each warp counts its finished units per kv group; an attention block
      // waits only for its own group's count (qkv_target grows by one group's units per layer).
      signal_qkv_done(p, st);
      qkv_target += kQKVGroupUnits;
      __syncthreads();
      MK_MARK(1);
      attention_phase(p, layer, step, live, s_act, qkv_target);
#else
      MK_ARRIVE();
      MK_TL_AT(tl, 2);
      grid_barrier<kBarrierThread>(p.bar_count, epoch);
      MK_TL_AT(tl, 3);
      MK_MARK(1);
      attention_phase(p, layer, step, live, s_act, 0u MK_TL_ARG(tl));
#endif
#if MK_ATTN_O
      // No attention -> O barrier: wait only for the kv groups of this block's O units (profile: O = both)
      ao_target += (unsigned)(attention_items(p, step, live) / MK_NKV);
      ao_stage(p, step, live, ao_target, s_act);
      MK_TL_AT(tl, 8);
#if MK_MMA_O
      o_mma(st, p, s_act, live);
#else
      run_phase<MAT_O>(st, p, layer, s_act, [&](long long u, const float* acc, const float*) { ao_add(p, u, acc, live); }, live);
#endif
#else
      MK_ARRIVE();
      grid_barrier<kBarrierThread>(p.bar_count, epoch);
      MK_MARK(2);

      combine_attention(p, slot_pos(p, 0, step), s_act);
      run_phase<MAT_O>(st, p, layer, s_act, [&](long long u, const float* acc, const float*) { p.o_part[u] = acc[0]; });
#endif
#if MK_FUSED_MLP
      fx_zero(fx_acc(p, fx_turn - 1));  // read before the QKV barrier; next added to after O's
#endif
      MK_ARRIVE();
      MK_TL_AT(tl, 9);
      grid_barrier<kBarrierThread>(p.bar_count, epoch);
      MK_TL_AT(tl, 10);
      MK_MARK(3);
#if MK_TP > 1
      tp_all_reduce<MK_S_O>(p, p.o_part, MK_TP_OFF_RECV_O, exchanges);
#endif

#if MK_BATCH > 1
#if MK_FX_PACK
      residual_norm_slots<MK_MMA_MLP>(live, pair_load([&](int c, int i) { return ao_load2(p, c, i); }),
        [&](int b) { return slot_x(p, xi ^ 1, b); }, p.ln2 + layer * MK_H, s_act, s_red);
#else
      residual_norm_slots<MK_MMA_MLP>(live, [&](int b, int i) {
          return ao_load(p, slot_x(p, xi, b), MK_O_BIAS ? p.o_bias + layer * MK_H : nullptr, b, i); },
        [&](int b) { return slot_x(p, xi ^ 1, b); }, p.ln2 + layer * MK_H, s_act, s_red);
#endif
#elif MK_ATTN_O
      residual_norm_ao(p, slot_x(p, xi, 0), MK_O_BIAS ? p.o_bias + layer * MK_H : nullptr,
                       slot_x(p, xi ^ 1, 0), p.ln2 + layer * MK_H, s_act, s_red);
#else
      residual_norm<kSumO>(slot_x(p, xi, 0), nullptr, MK_O_SRC(p), MK_O_BIAS ? p.o_bias + layer * MK_H : nullptr,
                           slot_x(p, xi ^ 1, 0), p.ln2 + layer * MK_H, s_act, s_red);
#endif
      xi ^= 1;
#if MK_FOLD_X
      fx_fold_add(p, fx_acc(p, fx_turn), live);  // the post-attention residual into this layer's MLP accumulator
#endif
      MK_TL_AT(tl, 11);
#if MK_FUSED_MLP
      {  // gate/up into this block's h slice, then its down columns: no barrier in between
#if MK_MMA_MLP
        fused_mlp_mma(st, p, s_act, fx_turn, live MK_TL_ARG(tl));
#else
        const long long js = gu_row0(blockIdx.x);  // the block's first gate/up row
        run_phase<MAT_GU>(st, p, layer, s_act, [&](long long u, const float* g, const float* up) {
#pragma unroll
          for (int b = 0; b < kB; b++)
            if (slot_on(live, b)) s_act[kFxH + b * kFxSlice + (int)(u - js)] = g[b] / (1.f + __expf(-g[b])) * up[b];
        }, live);
        fused_down(st, p, s_act, fx_turn, live MK_TL_ARG(tl));
#endif
        fx_turn++;
      }
      if (layer == MK_L - 1 && p.host_kctl != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
#if MK_RESIDENT
        resident_poll(p, admit_seen);
#else
        p.cancel_step[kB] = p.host_kctl[MK_KCTL_YIELD];
#endif
      }
      MK_ARRIVE();
      MK_TL_AT(tl, 14);
      grid_barrier<kBarrierThread>(p.bar_count, epoch);
      MK_TL_AT(tl, 15);
      MK_MARK(4);
#else
      run_phase<MAT_GU>(st, p, layer, s_act, [&](long long u, const float* g, const float* up) {
        p.h_buf[u] = g[0] / (1.f + __expf(-g[0])) * up[0];
      });
      MK_ARRIVE();
      grid_barrier<kBarrierThread>(p.bar_count, epoch);
      MK_MARK(4);

      stage_vector<MK_I, MK_IP>(p.h_buf, s_act);
      run_phase<MAT_DN>(st, p, layer, s_act, [&](long long u, const float* acc, const float*) { p.dn_part[u] = acc[0]; });
      MK_ARRIVE();
      grid_barrier<kBarrierThread>(p.bar_count, epoch);
      MK_MARK(5);
#if MK_TP > 1
      tp_all_reduce<MK_S_DN>(p, p.dn_part, MK_TP_OFF_RECV_DN, exchanges);
#endif
#endif  // MK_FUSED_MLP
    }
  }
#if MK_FUSED_MLP
  if (p.kctl != nullptr && blockIdx.x == 0 && threadIdx.x == 0) { p.kctl[0] = (int)fx_turn; p.kctl[1] = step; }
#endif
  if (prof_on)
    for (int k = 0; k < 13; k++) p.profile[k] = prof[k];
  cp_async_wait_all();
}
