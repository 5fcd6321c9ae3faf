// Attention for one decode step of one layer: q/k/v of the new token from the QKV partials
// (+bias, Qwen3 q/k RMSNorm, RoPE), KV-cache append, then GQA attention over the whole cache,
// split over KV length: block `item` handles (kv head g, split s); the last split of a kv head
// to finish combines all splits' (max, sum, output) into attn_out. No grid barrier inside.
#pragma once
#include "mk_common.cuh"
#include "mk_layout.cuh"

constexpr int kOPerThread = (kGroup * MK_D + MK_THREADS - 1) / MK_THREADS;

// kDPerLane head-dim elements of one cached key row (bf16), read past L1 (rows written by other SMs).
MK_DEVICE void load_key(const uint16_t* row, int lane, float* out) {
  const uint16_t* src = row + lane * kDPerLane;
  if constexpr (kDPerLane == 1) {
    out[0] = bf16_to_f32(__ldcg(src));
  } else if constexpr (kDPerLane == 2) {
    unsigned w = __ldcg(reinterpret_cast<const unsigned*>(src));
    out[0] = __uint_as_float(w << 16); out[1] = __uint_as_float(w & 0xffff0000u);
  } else if constexpr (kDPerLane == 4) {
    uint2 w = __ldcg(reinterpret_cast<const uint2*>(src));
    out[0] = __uint_as_float(w.x << 16); out[1] = __uint_as_float(w.x & 0xffff0000u);
    out[2] = __uint_as_float(w.y << 16); out[3] = __uint_as_float(w.y & 0xffff0000u);
  } else {
    uint4 w = __ldcg(reinterpret_cast<const uint4*>(src));
    unsigned ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; i++) { out[2 * i] = __uint_as_float(ws[i] << 16); out[2 * i + 1] = __uint_as_float(ws[i] & 0xffff0000u); }
  }
}

MK_DEVICE void attention_phase(const MkParams& p, int layer, int pos, float* s_act) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int ctx = pos + 1;
  const int split_cap = max(1, (int)gridDim.x / MK_NKV);  // partial buffers are [NKV][split_cap]
  const int nsplit = max(1, min(split_cap, (ctx + 31) / 32));
  const int items = MK_NKV * nsplit;
  float* s_q = s_act;                       // [kGroup][D], then k and v of this step
  float* s_kc = s_q + kGroup * MK_D;
  float* s_vc = s_kc + MK_D;
  float* s_sc = s_vc + MK_D;                // [kGroup][TILE] scores, then probabilities
  float* s_m = s_sc + kGroup * MK_ATTN_TILE;
  float* s_l = s_m + kGroup;
  float* s_alpha = s_l + kGroup;
  int* s_last = reinterpret_cast<int*>(s_alpha + kGroup);
  const float qscale = rsqrtf((float)MK_D);

  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int g = item / nsplit, s = item % nsplit;
    const int chunk = (ctx + nsplit - 1) / nsplit;
    const int t0 = s * chunk, t1 = min(ctx, t0 + chunk);
    // 1. q (group heads), k, v of the new token: sum the k-split partials, add bias.
    for (int i = tid; i < (kGroup + 2) * MK_D; i += MK_THREADS) {
      int row = i < kGroup * MK_D ? g * kGroup * MK_D + i
              : i < (kGroup + 1) * MK_D ? kQDim + g * MK_D + (i - kGroup * MK_D)
              : kQDim + kKVDim + g * MK_D + (i - (kGroup + 1) * MK_D);
      float v = 0.f;
#pragma unroll
      for (int k = 0; k < MK_S_QKV; k++) v += __ldcg(p.qkv_part + (long long)row * MK_S_QKV + k);
      if (MK_QKV_BIAS) v += p.qkv_bias[(long long)layer * kQKVRows + row];
      s_q[i] = i >= (kGroup + 1) * MK_D ? bf16_round(v) : v;  // v is cached as bf16
    }
    __syncthreads();
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
    const long long head_base = ((long long)layer * MK_NKV + g) * MK_MAX_CTX;
    if (t0 <= pos && pos < t1) {  // this split owns the new position: append it to the cache
      for (int d = tid; d < MK_D; d += MK_THREADS) {
        p.k_cache[(head_base + pos) * MK_D + d] = f32_to_bf16(s_kc[d]);
        p.v_cache[(head_base + pos) * MK_D + d] = f32_to_bf16(s_vc[d]);
      }
    }
    // 3. tiles of positions: scores, online softmax, weighted values.
    float o[kOPerThread];
#pragma unroll
    for (int k = 0; k < kOPerThread; k++) o[k] = 0.f;
    for (int tt = t0; tt < t1; tt += MK_ATTN_TILE) {
      const int n = min(MK_ATTN_TILE, t1 - tt);
      for (int j = warp; j < n; j += kWarps) {
        const int t = tt + j;
        float kv[kDPerLane];
        if (t == pos) {
#pragma unroll
          for (int e = 0; e < kDPerLane; e++) kv[e] = s_kc[lane * kDPerLane + e];
        } else {
          load_key(p.k_cache + (head_base + t) * MK_D, lane, kv);
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
          const uint16_t* vrow = p.v_cache + (head_base + tt) * MK_D + d;
#pragma unroll 8
          for (int j = 0; j < n; j++) {
            float vv = (tt + j == pos) ? s_vc[d] : bf16_to_f32(__ldcg(vrow + (long long)j * MK_D));
            acc += s_sc[h * MK_ATTN_TILE + j] * vv;
          }
          o[k] = acc;
        }
      }
      __syncthreads();
    }
    // 4. publish this split's partial; the last split of kv head g combines.
    const long long pbase = ((long long)g * split_cap + s) * kGroup;
#pragma unroll
    for (int k = 0; k < kOPerThread; k++) {
      const int idx = tid + k * MK_THREADS;
      if (idx < kGroup * MK_D) p.attn_o[pbase * MK_D + idx] = o[k];
    }
    if (tid < kGroup) { p.attn_m[pbase + tid] = s_m[tid]; p.attn_l[pbase + tid] = s_l[tid]; }
    __threadfence();
    __syncthreads();
    if (tid == 0) *s_last = atomicAdd(p.attn_cnt + g, 1u) == (unsigned)(nsplit - 1);
    __syncthreads();
    if (*s_last) {
      __threadfence();
      for (int idx = tid; idx < kGroup * MK_D; idx += MK_THREADS) {
        const int h = idx / MK_D;
        float M = -INFINITY;
        for (int q = 0; q < nsplit; q++) M = fmaxf(M, __ldcg(p.attn_m + ((long long)g * split_cap + q) * kGroup + h));
        float den = 0.f, num = 0.f;
        for (int q = 0; q < nsplit; q++) {
          const long long b = ((long long)g * split_cap + q) * kGroup;
          float w = __expf(__ldcg(p.attn_m + b + h) - M);
          den += w * __ldcg(p.attn_l + b + h);
          num += w * __ldcg(p.attn_o + b * MK_D + idx);
        }
        p.attn_out[g * kGroup * MK_D + idx] = num / den;
      }
      if (tid == 0) atomicExch(p.attn_cnt + g, 0u);
    }
    __syncthreads();
  }
}
