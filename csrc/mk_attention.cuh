// Attention for one decode step of one layer: q/k/v of the new token from the QKV partials
// (+bias, Qwen3 q/k RMSNorm, RoPE), KV-cache append, then GQA attention over the whole cache,
// split over KV length: block `item` handles (kv head g, split s) and publishes its unnormalised
// partial (max, sum, output). After the grid barrier every block combines the partials while
// staging the O-projection input (combine_attention), so no atomics or second pass are needed.
#pragma once
#include "mk_common.cuh"
#include "mk_layout.cuh"
#include "mk_stream.cuh"
#include "mk_batch.cuh"
#include "mk_timeline.cuh"

constexpr int kOPerThread = (kGroup * MK_D + MK_THREADS - 1) / MK_THREADS;

// Shared-memory scratch of the attention phase (aliases the activation buffer), in floats.
constexpr int kAttnQ = 0;                                   // [kGroup][D] q of the group, fp32
constexpr int kAttnKC = kAttnQ + kGroup * MK_D;             // [D] k of the new token (roped, bf16-rounded)
constexpr int kAttnVC = kAttnKC + MK_D;                     // [D] v of the new token
constexpr int kAttnSC = kAttnVC + MK_D;                     // [kGroup][TILE] scores -> probabilities
constexpr int kAttnStats = kAttnSC + kGroup * MK_ATTN_TILE; // m, l, alpha per head + flag
constexpr int kAttnKV = (kAttnStats + 4 * kGroup + 4 + 3) / 4 * 4;  // bf16 K tile then V tile
constexpr int kAttnFloats = kAttnKV + MK_ATTN_TILE * MK_D;
static_assert(kAttnFloats <= MK_ACT_FLOATS, "attention scratch exceeds the activation buffer");
static_assert(MK_ATTN_O || MK_QP + 2 * MK_NH * MK_MAX_SPLITS <= MK_ACT_FLOATS, "combine scratch");
constexpr int kRowPieces = MK_D / 8;                        // 16-byte pieces per K/V row
constexpr int kTilePieces = 2 * MK_ATTN_TILE * kRowPieces;   // K tile then V tile
constexpr int kPiecesPerThread = (kTilePieces + MK_THREADS - 1) / MK_THREADS;

// MK_KV_REGS: K/V tiles are loaded through registers, so waiting for them never waits for the
// weight ring's cp.async groups (cp.async.wait_group completes groups in order only).
struct KVTile {
  uint4 r[kPiecesPerThread];
  MK_DEVICE static bool decode(int i, int tt, int n, int pos, int& kv, int& j, int& c) {
    kv = i / (MK_ATTN_TILE * kRowPieces);
    const int rem = i % (MK_ATTN_TILE * kRowPieces);
    j = rem / kRowPieces; c = rem % kRowPieces;
    return i < kTilePieces && j < n && tt + j != pos;
  }
  MK_DEVICE void load(const MkParams& p, long long head_base, int tt, int n, int pos) {
#pragma unroll
    for (int k = 0; k < kPiecesPerThread; k++) {
      int kv, j, c;
      if (decode(threadIdx.x + k * MK_THREADS, tt, n, pos, kv, j, c))
        r[k] = __ldcg(reinterpret_cast<const uint4*>((kv ? p.v_cache : p.k_cache) + (head_base + tt + j) * MK_D + c * 8));
    }
  }
  MK_DEVICE void store(uint16_t* s_k, uint16_t* s_v, int tt, int n, int pos) const {
#pragma unroll
    for (int k = 0; k < kPiecesPerThread; k++) {
      int kv, j, c;
      if (decode(threadIdx.x + k * MK_THREADS, tt, n, pos, kv, j, c))
        *reinterpret_cast<uint4*>((kv ? s_v : s_k) + j * MK_D + c * 8) = r[k];
    }
  }
};

#ifndef MK_SPLIT_POS
#define MK_SPLIT_POS 64  // layout option split_pos (flag emitted only when not 64)
#endif
// KV-length splits per kv head for a context of `ctx` positions (>= ~MK_SPLIT_POS positions per split).
MK_DEVICE int split_capacity() { return max(1, min((int)gridDim.x / MK_NKV, MK_MAX_SPLITS)); }
// With `nlive` slots decoding, each gets 1/nlive of the capacity, so every block still has at most
// one attention item (items run one after another in a block: the chain would grow with the batch).
MK_DEVICE int num_splits(int ctx, int nlive = 1) {
  return max(1, min(split_capacity() / nlive, (ctx + MK_SPLIT_POS - 1) / MK_SPLIT_POS));
}

// QKV units of one kv group: its kGroup q heads, its k head and its v head, each D rows x splits.
constexpr unsigned kQKVGroupUnits = (unsigned)(kGroup + 2) * MK_D * MK_S_QKV;

// Lane 0 of each warp, after its QKV units: publish how many units of each kv group it finished.
MK_DEVICE void signal_qkv_done(const MkParams& p, const WeightStream& st) {
  if (st.gw < 0 || st.lane != 0) return;
  long long u0, u1;
  warp_range(kUnitsQKV, st.gw, st.nw, u0, u1);
  if (u1 <= u0) return;
  __threadfence();
  for (int g = 0; g < MK_NKV; g++) {
    const long long starts[3] = {(long long)g * kGroup * MK_D * MK_S_QKV, (long long)(kQDim + g * MK_D) * MK_S_QKV,
                                 (long long)(kQDim + kKVDim + g * MK_D) * MK_S_QKV};
    const long long lens[3] = {(long long)kGroup * MK_D * MK_S_QKV, (long long)MK_D * MK_S_QKV, (long long)MK_D * MK_S_QKV};
    long long n = 0;
#pragma unroll
    for (int k = 0; k < 3; k++) n += max(0LL, min(u1, starts[k] + lens[k]) - max(u0, starts[k]));
    if (n > 0) atomicAdd(p.qkv_done + g, (unsigned)n);
  }
}

// Attention splits of this step over the live slots: (slot, kv head, split) items, slot-major.
MK_DEVICE int attention_items(const MkParams& p, int step, unsigned live) {
  int n = 0;
#pragma unroll 1
  for (int b = 0; b < kB; b++)
    if ((live >> b) & 1u) n += MK_NKV * num_splits(slot_pos(p, b, step) + 1, __popc(live));
  return n;
}

MK_DEVICE void attention_phase(const MkParams& p, int layer, int step, unsigned live, float* s_act, unsigned qkv_target
                                MK_TL_PARAM) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int split_cap = split_capacity();  // partials: [B][NKV][split_cap]
  float* s_q = s_act + kAttnQ;
  float* s_kc = s_act + kAttnKC;
  float* s_vc = s_act + kAttnVC;
  float* s_sc = s_act + kAttnSC;
  float* s_m = s_act + kAttnStats;
  float* s_l = s_m + kGroup;
  float* s_alpha = s_l + kGroup;
  uint16_t* s_k = reinterpret_cast<uint16_t*>(s_act + kAttnKV);  // [TILE][D]
  uint16_t* s_v = s_k + MK_ATTN_TILE * MK_D;
  const float qscale = rsqrtf((float)MK_D);

  for (int item = blockIdx.x;; item += gridDim.x) {
    int slot = -1, pos = 0, nsplit = 1, rem = item;
#pragma unroll 1
    for (int b = 0; b < kB; b++) {  // which live slot's split this item is
      if (!((live >> b) & 1u)) continue;
      const int pb = slot_pos(p, b, step), nb = num_splits(pb + 1, __popc(live));
      if (rem < MK_NKV * nb) { slot = b; pos = pb; nsplit = nb; break; }
      rem -= MK_NKV * nb;
    }
    if (slot < 0) break;
    const int ctx = pos + 1;
    const int g = rem / nsplit, s = rem % nsplit;
    const int chunk = (ctx + nsplit - 1) / nsplit;
    const int t0 = s * chunk, t1 = min(ctx, t0 + chunk);
    const long long head_base = kv_head_base(slot, layer, g);
    const float* qkv_part = slot_qkv(p, slot);
    // Start fetching the first tile of cached K/V (earlier positions do not depend on this step).
    auto fetch_tile = [&](int tt, int n) {
      for (int i = tid; i < 2 * n * kRowPieces; i += MK_THREADS) {
        const int kv = i / (n * kRowPieces), r = i % (n * kRowPieces), j = r / kRowPieces, c = r % kRowPieces;
        if (tt + j == pos) continue;  // the new token's row comes from s_kc / s_vc
        const uint16_t* src = (kv ? p.v_cache : p.k_cache) + (head_base + tt + j) * MK_D + c * 8;
        cp_async16((kv ? s_v : s_k) + j * MK_D + c * 8, src);
      }
      cp_async_commit();
    };
    KVTile tile;
    if (t0 < t1) {
      if (MK_KV_REGS) tile.load(p, head_base, t0, min(MK_ATTN_TILE, t1 - t0), pos);
      else fetch_tile(t0, min(MK_ATTN_TILE, t1 - t0));
    }
    if (MK_QKV_FLAGS) {  // wait until every QKV unit of kv group g is written
      if (tid == 0) while ((int)(ld_acquire(p.qkv_done + g) - qkv_target) < 0) { }
      __syncthreads();
    }
    // 1. q (group heads), k, v of the new token: sum the k-split partials, add bias.
#pragma unroll
    for (int i0 = 0; i0 < (kGroup + 2) * MK_D; i0 += MK_THREADS) {
      const int i = i0 + tid;
      if (i < (kGroup + 2) * MK_D) {
        int row = i < kGroup * MK_D ? g * kGroup * MK_D + i
                : i < (kGroup + 1) * MK_D ? kQDim + g * MK_D + (i - kGroup * MK_D)
                : kQDim + kKVDim + g * MK_D + (i - (kGroup + 1) * MK_D);
        float v = 0.f;
#pragma unroll
        for (int k = 0; k < MK_S_QKV; k++) v += __ldcg(qkv_part + (long long)row * MK_S_QKV + k);
        if (MK_QKV_BIAS) v += p.qkv_bias[(long long)layer * kQKVRows + row];
        s_q[i] = i >= (kGroup + 1) * MK_D ? bf16_round(v) : v;  // v is cached as bf16
      }
    }
    __syncthreads();
    MK_TL_AT(tl, 4);
    // 2. per head (group q heads + the k head): optional RMSNorm over D, then RoPE (rotate-half).
    for (int h = warp; h < kGroup + 1; h += kWarps) {
      float* vec = s_q + h * MK_D;
      if (MK_QK_NORM) {
        const float* w = (h < kGroup ? p.q_norm : p.k_norm) + layer * MK_D;
        float ss = 0.f;
        for (int d = lane; d < MK_D; d += 32) ss += vec[d] * vec[d];
        float r = rsqrtf(warp_sum(ss) / MK_D + MK_EPS);
        __syncwarp();
        for (int d = lane; d < MK_D; d += 32) vec[d] = vec[d] * r * w[d];
        __syncwarp();
      }
      const float* cs = p.rope_cos + (long long)pos * kHalfD;
      const float* sn = p.rope_sin + (long long)pos * kHalfD;
      for (int d = lane; d < kHalfD; d += 32) {
        float a = vec[d], b = vec[d + kHalfD], c = cs[d], si = sn[d];
        float lo = a * c - b * si, hi = b * c + a * si;
        if (h < kGroup) { lo *= qscale; hi *= qscale; } else { lo = bf16_round(lo); hi = bf16_round(hi); }
        vec[d] = lo; vec[d + kHalfD] = hi;
      }
    }
    if (tid < kGroup) { s_m[tid] = -INFINITY; s_l[tid] = 0.f; }
    __syncthreads();
    MK_TL_AT(tl, 5);
    if (t0 <= pos && pos < t1) {  // this split owns the new position: append it to the cache
      for (int d = tid; d < MK_D; d += MK_THREADS) {
        p.k_cache[(head_base + pos) * MK_D + d] = f32_to_bf16(s_kc[d]);
        p.v_cache[(head_base + pos) * MK_D + d] = f32_to_bf16(s_vc[d]);
      }
    }
    // 3. tiles of positions: scores, online softmax, weighted values (all from shared memory).
    float o[kOPerThread];
#pragma unroll
    for (int k = 0; k < kOPerThread; k++) o[k] = 0.f;
    for (int tt = t0; tt < t1; tt += MK_ATTN_TILE) {
      const int n = min(MK_ATTN_TILE, t1 - tt);
      if (MK_KV_REGS) {
        if (tt != t0) tile.load(p, head_base, tt, n, pos);
        tile.store(s_k, s_v, tt, n, pos);
      } else {
        cp_async_wait_all();
      }
      __syncthreads();
      for (int j = warp; j < n; j += kWarps) {
        float kv[kDPerLane];
        if (tt + j == pos) {
#pragma unroll
          for (int e = 0; e < kDPerLane; e++) kv[e] = s_kc[lane * kDPerLane + e];
        } else {
#pragma unroll
          for (int e = 0; e < kDPerLane; e++) kv[e] = bf16_to_f32(s_k[j * MK_D + lane * kDPerLane + e]);
        }
#pragma unroll
        for (int h = 0; h < kGroup; h++) {
          float part = 0.f;
#pragma unroll
          for (int e = 0; e < kDPerLane; e++) part += s_q[h * MK_D + lane * kDPerLane + e] * kv[e];
          part = warp_sum(part);
          if (lane == 0) s_sc[h * MK_ATTN_TILE + j] = part;
        }
      }
      __syncthreads();
      for (int h = warp; h < kGroup; h += kWarps) {
        float mx = -INFINITY;
        for (int j = lane; j < n; j += 32) mx = fmaxf(mx, s_sc[h * MK_ATTN_TILE + j]);
        mx = warp_max(mx);
        const float m_old = s_m[h], m_new = fmaxf(m_old, mx);
        float sum = 0.f;
        for (int j = lane; j < n; j += 32) {
          float e = __expf(s_sc[h * MK_ATTN_TILE + j] - m_new);
          s_sc[h * MK_ATTN_TILE + j] = e;
          sum += e;
        }
        sum = warp_sum(sum);
        if (lane == 0) {
          float alpha = __expf(m_old - m_new);
          s_alpha[h] = alpha;
          s_l[h] = s_l[h] * alpha + sum;
          s_m[h] = m_new;
        }
      }
      __syncthreads();
#pragma unroll
      for (int k = 0; k < kOPerThread; k++) {
        const int idx = tid + k * MK_THREADS;
        if (idx < kGroup * MK_D) {
          const int h = idx / MK_D, d = idx % MK_D;
          float acc = o[k] * s_alpha[h];
          for (int j = 0; j < n; j++) {
            float vv = (tt + j == pos) ? s_vc[d] : bf16_to_f32(s_v[j * MK_D + d]);
            acc += s_sc[h * MK_ATTN_TILE + j] * vv;
          }
          o[k] = acc;
        }
      }
      __syncthreads();
      if (!MK_KV_REGS && tt + MK_ATTN_TILE < t1) fetch_tile(tt + MK_ATTN_TILE, min(MK_ATTN_TILE, t1 - tt - MK_ATTN_TILE));
    }
    MK_TL_AT(tl, 6);
    // 4. publish this split's partial; the last split of kv head g to finish combines.
    const long long pbase = (((long long)slot * MK_NKV + g) * split_cap + s) * kGroup;
#pragma unroll
    for (int k = 0; k < kOPerThread; k++) {
      const int idx = tid + k * MK_THREADS;
      if (idx < kGroup * MK_D) p.attn_o[pbase * MK_D + idx] = o[k];
    }
    if (tid < kGroup) { p.attn_m[pbase + tid] = s_m[tid]; p.attn_l[pbase + tid] = s_l[tid]; }
#if MK_ATTN_O  // fused_attn_o (mk_attn_o.cuh): count this split's partial, visible, for group g's waiters
    __threadfence();
    __syncthreads();
    if (tid == 0) atomicAdd(p.attn_cnt + g, 1u);
#endif
    __syncthreads();
    MK_TL_AT(tl, 7);
  }
}

// Every block, after the barrier: attn_out = softmax-weighted combination of the splits'
// partials, staged straight into s_act[0..QP) as the O-projection input (zero padded).
MK_DEVICE void combine_attention(const MkParams& p, int pos, float* s_act) {
  const int tid = threadIdx.x;
  const int cap = split_capacity(), nsplit = num_splits(pos + 1);
  float* s_w = s_act + MK_QP;  // [NH][nsplit] weights
  for (int i = tid; i < MK_NH * nsplit; i += MK_THREADS) {
    const int h = i / nsplit, s = i % nsplit;
    const long long b = ((long long)(h / kGroup) * cap + s) * kGroup + h % kGroup;
    s_w[i] = __ldcg(p.attn_m + b);
    s_w[MK_NH * nsplit + i] = __ldcg(p.attn_l + b);
  }
  __syncthreads();
  for (int h = tid; h < MK_NH; h += MK_THREADS) {
    float M = -INFINITY, den = 0.f;
    for (int s = 0; s < nsplit; s++) M = fmaxf(M, s_w[h * nsplit + s]);
    for (int s = 0; s < nsplit; s++) den += __expf(s_w[h * nsplit + s] - M) * s_w[MK_NH * nsplit + h * nsplit + s];
    for (int s = 0; s < nsplit; s++) s_w[h * nsplit + s] = __expf(s_w[h * nsplit + s] - M) / den;
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < (MK_QP + MK_THREADS - 1) / MK_THREADS; k++) {
    const int i = tid + k * MK_THREADS;
    if (i < MK_QP) {
      float acc = 0.f;
      if (i < kQDim) {
        const int h = i / MK_D, d = i % MK_D;
        const float* o = p.attn_o + ((long long)(h / kGroup) * cap * kGroup + h % kGroup) * MK_D + d;
#pragma unroll 4
        for (int s = 0; s < nsplit; s++) acc += s_w[h * nsplit + s] * __ldcg(o + (long long)s * kGroup * MK_D);
      }
      act_store(s_act, 0, i, acc);
    }
  }
  __syncthreads();
}
