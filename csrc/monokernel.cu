// The monokernel: one persistent, cooperative launch decodes a whole generation of one sequence.
// This file is the one place that sequences the phases; each phase lives in its own header.
//
// Per step:  LM head (from the previous hidden state) | sample, emit, stop check |
//            per layer: QKV | attention (+KV append) | O-proj | gate/up+SiLU | down      ("|" = grid barrier)
// Residual adds and RMSNorms are done redundantly by every block at the start of the phase that
// needs them (the vector is tiny); block 0 writes the new residual stream to the other half of
// xbuf. Matvec outputs are per-unit partials the next phase sums (deterministic, no atomics).
#include "mk_params.cuh"
#include "mk_common.cuh"
#include "mk_layout.cuh"
#include "mk_stream.cuh"
#include "mk_attention.cuh"
#include "mk_sample.cuh"

// s_x = base + sum of partials (+bias); optionally block 0 stores it to xdst; s_act = RMSNorm(s_x) * w.
MK_DEVICE void residual_norm(const float* xsrc, const uint16_t* emb_row, const float* parts, int S,
                             const float* bias, float* xdst, const float* w, float* s_x, float* s_act,
                             float* s_red) {
  float ss = 0.f;
  for (int i = threadIdx.x; i < MK_HP; i += MK_THREADS) {
    float v = 0.f;
    if (i < MK_H) {
      v = emb_row ? bf16_to_f32(emb_row[i]) : __ldcg(xsrc + i);
      if (parts) for (int k = 0; k < S; k++) v += __ldcg(parts + (long long)i * S + k);
      if (bias) v += bias[i];
      if (xdst && blockIdx.x == 0) xdst[i] = v;
    }
    s_x[i] = v;
    ss += v * v;
  }
  const float r = rsqrtf(block_sum(ss, s_red) / MK_H + MK_EPS);
  for (int i = threadIdx.x; i < MK_HP; i += MK_THREADS) s_act[i] = i < MK_H ? s_x[i] * r * w[i] : 0.f;
  __syncthreads();
}

// s_act[0..n_pad) = src[0..n) then zeros.
MK_DEVICE void stage_vector(const float* src, int n, int n_pad, float* s_act) {
  for (int i = threadIdx.x; i < n_pad; i += MK_THREADS) s_act[i] = i < n ? __ldcg(src + i) : 0.f;
  __syncthreads();
}

MK_DEVICE bool is_stop(const MkParams& p, int tok) {
  for (int i = 0; i < (int)p.n_stop; i++) if (p.stop_ids[i] == tok) return true;
  return false;
}

extern "C" __global__ void __launch_bounds__(MK_THREADS, 1) monokernel(const MkParams* __restrict__ pp) {
  const MkParams& p = *pp;
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* ring = reinterpret_cast<uint4*>(smem);
  float* s_act = reinterpret_cast<float*>(smem + (size_t)kWarps * MK_RING * 512);
  float* s_x = s_act + MK_ACT_FLOATS;
  float* s_red = s_x + MK_HP;
  const int warp = threadIdx.x >> 5;

  WeightStream st;
  st.init(p, ring + warp * MK_RING * 32);
  unsigned epoch = 0;
  int xi = 0;  // xbuf half holding the residual stream
  const int mode = (int)p.mode;
  const float invT = (float)p.inv_temperature;

  for (int step = 0;; step++) {
    // ---- LM head on the previous hidden state (the prefill's last one at step 0) ----
    residual_norm(p.xbuf + xi * MK_HP, nullptr, p.dn_part, MK_S_DN, nullptr, nullptr, p.lnf, s_x, s_act, s_red);
    if (blockIdx.x == 0 && threadIdx.x == 0) p.cancel_step[0] = p.host_ctrl[MK_CTRL_CANCEL];
    float* logits = p.logits + (long long)step * p.logits_per_step;
    {
      float best = -INFINITY; int best_i = 0x7fffffff;
      run_phase<MAT_LM>(st, p, 0, s_act, [&](long long u, float acc, float) {
        logits[u] = acc;
        float key = mode == MK_MODE_GUMBEL ? acc * invT + gumbel(p.seed, step, (int)u) : acc;
        argmax_merge(best, best_i, key, (int)u);
      });
      if (st.lane == 0) { p.best_val[st.gw] = best; p.best_idx[st.gw] = best_i; }
    }
    grid_barrier(p.bar_count, p.bar_flag, epoch);

    // ---- choose the token (same answer in every block), emit, stop checks ----
    int tok = reduce_best(p, s_red);
    if (mode == MK_MODE_TOPKP) {
      if (blockIdx.x == 0) {
        float M = __ldcg(logits + tok);
        int t = sample_topkp(p, logits, step, M, s_red);
        if (threadIdx.x == 0) *p.shared_token = t;
      }
      grid_barrier(p.bar_count, p.bar_flag, epoch);
      tok = __ldcg(p.shared_token);
    }
    const bool last = step + 1 >= p.max_steps || p.start_pos + step + 1 >= MK_MAX_CTX;
    int status = 0;
    if (__ldcg(p.cancel_step) != 0) status = MK_STATUS_CANCELLED;
    else if (!p.teacher && is_stop(p, tok)) status = MK_STATUS_STOP;
    else if (last) status = MK_STATUS_LENGTH;
    if (p.teacher && !last) tok = p.forced[step];
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      if (status != MK_STATUS_CANCELLED && status != MK_STATUS_STOP) {
        p.tokens[step] = tok;
        p.host_tokens[step] = tok;
        __threadfence_system();
        p.host_ctrl[MK_CTRL_COUNT] = step + 1;
      }
      if (status) {
        p.host_ctrl[MK_CTRL_STOP_TOKEN] = tok;
        p.host_ctrl[MK_CTRL_STATUS] = status;
        __threadfence_system();
        p.host_ctrl[MK_CTRL_DONE] = 1;
      }
    }
    if (status) break;
    const int pos = (int)p.start_pos + step;

    // ---- the layers, on token `tok` at position `pos` ----
    for (int layer = 0; layer < MK_L; layer++) {
      // QKV: x = embedding (layer 0) or x + down partials; RMSNorm.
      const float* xs = p.xbuf + xi * MK_HP;
      float* xd = p.xbuf + (xi ^ 1) * MK_HP;
      if (layer == 0)
        residual_norm(nullptr, p.embed + (long long)tok * MK_H, nullptr, 0, nullptr, xd, p.ln1, s_x, s_act, s_red);
      else
        residual_norm(xs, nullptr, p.dn_part, MK_S_DN, nullptr, xd, p.ln1 + layer * MK_H, s_x, s_act, s_red);
      xi ^= 1;
      run_phase<MAT_QKV>(st, p, layer, s_act, [&](long long u, float acc, float) { p.qkv_part[u] = acc; });
      grid_barrier(p.bar_count, p.bar_flag, epoch);

      attention_phase(p, layer, pos, s_act);
      grid_barrier(p.bar_count, p.bar_flag, epoch);

      stage_vector(p.attn_out, kQDim, MK_QP, s_act);
      run_phase<MAT_O>(st, p, layer, s_act, [&](long long u, float acc, float) { p.o_part[u] = acc; });
      grid_barrier(p.bar_count, p.bar_flag, epoch);

      residual_norm(p.xbuf + xi * MK_HP, nullptr, p.o_part, MK_S_O, MK_O_BIAS ? p.o_bias + layer * MK_H : nullptr,
                    p.xbuf + (xi ^ 1) * MK_HP, p.ln2 + layer * MK_H, s_x, s_act, s_red);
      xi ^= 1;
      run_phase<MAT_GU>(st, p, layer, s_act, [&](long long u, float g, float up) {
        p.h_buf[u] = g / (1.f + __expf(-g)) * up;
      });
      grid_barrier(p.bar_count, p.bar_flag, epoch);

      stage_vector(p.h_buf, MK_I, MK_IP, s_act);
      run_phase<MAT_DN>(st, p, layer, s_act, [&](long long u, float acc, float) { p.dn_part[u] = acc; });
      grid_barrier(p.bar_count, p.bar_flag, epoch);
    }
  }
  cp_async_wait_all();
}
