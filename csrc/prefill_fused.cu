// The prefill's small fused kernels (replicas/monokernel_prefill.py loads this file as one CuPy RawModule).
//
// Short prompts are bound by the host's per-operation launch cost (CuPy), not by the GPU: one kernel each for
// RMSNorm, RoPE and the KV store instead of 5-8 elementwise operations (same math). The *_bits / *_f32 / add_parts
// kernels are the MK_PREFILL_FUSED passes (bf16 outputs written directly, split-K sums into the residual).
// Every kernel returns before touching memory under the arguments of monokernel_prefill._no_work_args
// (each is launched so once when the module loads: under lazy loading a first launch inside a join would wait).
// tests/test_prefill_graph_cpu.py and tests/test_prefill_fused_cpu.py run it on the CPU emulator.

__device__ __forceinline__ unsigned short mk_bf16_rne(float v) {  // = _BF16_RNE (the narrow kernel's rounding)
  const unsigned int u = __float_as_uint(v);
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
template <bool BITS>
__device__ __forceinline__ void mk_rms_row(const float* __restrict__ x, const float* __restrict__ w, void* y, int n,
                                           float eps) {
  // One block per row of n: y = x / sqrt(mean(x^2) + eps) * w (BITS: as bf16 bits, RNE).
  const float* xr = x + (long long)blockIdx.x * n;
  __shared__ float red[32];
  float ss = 0.f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
  for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
  __syncthreads();
  ss = 0.f;
  for (int k = 0; k < (int)(blockDim.x >> 5); k++) ss += red[k];
  const float r = 1.f / sqrtf(ss / n + eps);
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = xr[i] * r * w[i];
    if (BITS) static_cast<unsigned short*>(y)[(long long)blockIdx.x * n + i] = mk_bf16_rne(v);
    else static_cast<float*>(y)[(long long)blockIdx.x * n + i] = v;
  }
}
extern "C" __global__ void mk_rms_rows(const float* __restrict__ x, const float* __restrict__ w,
                                       float* __restrict__ y, int n, float eps) {
  mk_rms_row<false>(x, w, y, n, eps);
}
extern "C" __global__ void mk_rms_rows_bits(const float* __restrict__ x, const float* __restrict__ w,
                                            unsigned short* __restrict__ y, int n, float eps) {
  // The same sums and products as mk_rms_rows, stored as the bf16 bits the next GEMM reads (no narrow pass).
  mk_rms_row<true>(x, w, y, n, eps);
}
__device__ __forceinline__ float mk_rope_at(const float* __restrict__ xr, const float* __restrict__ cs,
                                            const float* __restrict__ sn, long long pos, int d, int j) {
  // Element j of one head's rotate-half RoPE at position pos (xr: the head's d values): mk_rope_rows' math.
  const int half = d / 2, k = j < half ? j : j - half;
  const float a = xr[k], b = xr[k + half], c = cs[pos * half + k], s = sn[pos * half + k];
  return j < half ? a * c - b * s : b * c + a * s;
}
extern "C" __global__ void mk_rope_rows(const float* __restrict__ x, const float* __restrict__ cs,
                                        const float* __restrict__ sn, float* __restrict__ y,
                                        int heads, int d, long long total, const int* __restrict__ dyn_start,
                                        int start) {
  // x, y contiguous [T][heads][d]; cs, sn [positions][d/2]: rotate-half RoPE like replicas.reference.
  // Row t is at position start + t (start = *dyn_start when given: a CUDA graph reads it at replay).
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int j = (int)(i % d);
  const long long t = i / ((long long)heads * d) + (dyn_start ? *dyn_start : start);
  y[i] = mk_rope_at(x + (i - j), cs, sn, t, d, j);
}
// Element i of one pass's [T][nkv][d] rows -> its place in one layer's cache [nkv][ctx][d] at row start + t
// (dyn = {start, count}, read when it runs: CUDA graphs). dst < 0: not stored (past total, or a padding row).
struct MkKvRow {
  long long t, pos, dst;  // row in the pass, its position (start + t), element index in the cache
  int h, j;
};
__device__ __forceinline__ MkKvRow mk_kv_row(long long i, int nkv, int d, int ctx, long long total,
                                             const int* __restrict__ dyn, int start, int count) {
  MkKvRow r{0, 0, -1, 0, 0};
  if (i >= total) return r;
  if (dyn) { start = dyn[0]; count = dyn[1]; }
  r.t = i / ((long long)nkv * d);
  if (r.t >= count) return r;
  r.h = (int)((i / d) % nkv);
  r.j = (int)(i % d);
  r.pos = start + r.t;
  r.dst = ((long long)r.h * ctx + r.pos) * d + r.j;
  return r;
}
extern "C" __global__ void mk_store_kv(const unsigned short* __restrict__ src, unsigned short* __restrict__ dst,
                                       int nkv, int d, int ctx, long long total, const int* __restrict__ dyn,
                                       int start, int count) {
  // src [T][nkv][d] bf16 bits -> one layer's cache dst [nkv][ctx][d], rows start..start+count-1 (rows of
  // src past count are padding and not stored).
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const MkKvRow r = mk_kv_row(i, nkv, d, ctx, total, dyn, start, count);
  if (r.dst >= 0) dst[r.dst] = src[i];
}
extern "C" __global__ void mk_rope_bits(const float* __restrict__ x, long long ldx, const float* __restrict__ cs,
                                        const float* __restrict__ sn, unsigned short* __restrict__ y, int heads,
                                        int group, int d, long long total, const int* __restrict__ dyn_start,
                                        int start) {
  // Queries: x rows t (stride ldx: a view into the QKV output) of [heads][d] -> RoPE at start + t -> bf16 bits
  // y [heads / group][T][group][d] (the attention's layout: no narrow or transpose pass after).
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const long long T = total / ((long long)heads * d), t = i / ((long long)heads * d);
  const int h = (int)((i / d) % heads), j = (int)(i % d);
  const long long pos = t + (dyn_start ? *dyn_start : start);
  const float v = mk_rope_at(x + t * ldx + (long long)h * d, cs, sn, pos, d, j);
  y[(((long long)(h / group) * T + t) * group + h % group) * d + j] = mk_bf16_rne(v);
}
extern "C" __global__ void mk_store_kv_f32(const float* __restrict__ x, long long ldx, const float* __restrict__ cs,
                                           const float* __restrict__ sn, unsigned short* __restrict__ dst, int nkv,
                                           int d, int ctx, long long total, const int* __restrict__ dyn, int start,
                                           int count) {
  // Keys (cs, sn: RoPE) or values (cs null): x rows t (stride ldx) of [nkv][d] fp32 -> bf16 bits (RNE) into one
  // layer's cache dst [nkv][ctx][d] at row start + t; what rope + narrow + mk_store_kv did in three passes.
  const MkKvRow r = mk_kv_row((long long)blockIdx.x * blockDim.x + threadIdx.x, nkv, d, ctx, total, dyn, start, count);
  if (r.dst < 0) return;
  const float* xr = x + r.t * ldx + (long long)r.h * d;
  dst[r.dst] = mk_bf16_rne(cs ? mk_rope_at(xr, cs, sn, r.pos, d, r.j) : xr[r.j]);
}
extern "C" __global__ void mk_add_parts(float* __restrict__ x, const float* __restrict__ parts, int splits,
                                        long long n) {
  // x += the split-K parts of a linear [splits][n], summed in split order first (fixed: deterministic).
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float s = parts[i];
  for (int z = 1; z < splits; z++) s += parts[(long long)z * n + i];
  x[i] += s;
}
