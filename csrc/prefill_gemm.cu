// bf16 tensor-core GEMM for prefill beside a resident kernel (replicas/prefill_gemm.py launches it).
//
//   C[z] = alpha * A[z] @ op(B[z]),  A bf16 [M, K], B bf16 [N, K] (TB: A @ B^T) or [K, N], C fp32 [M, N]
//
// Why our own: while a persistent kernel holds 116 of the H200's 132 SMs, cuBLAS's bf16 tensor-core
// GEMMs of some shapes wait for it (thread-block clusters, or grids that want more SMs). This one is
// an ordinary launch of independent 128-thread blocks using only mma.sync / ldmatrix / cp.async and at
// most 36 KB of dynamic shared memory (no opt-in), so its blocks run on whatever SMs are free.
//
// Block tile BM x 64 (BM = 32 * MI), k step 32, 4 warps as 2 (m) x 2 (n), a warp owns (16 MI) x 32.
// Multi-stage cp.async pipeline; out-of-range rows / k / n are zero-filled in shared memory, so any
// M, N, K >= 1 work. VA / VB: the 16-byte cp.async path (the host checks 16-byte aligned base and row /
// batch strides that are multiples of 8 elements); otherwise a bounds-checked 2-byte load path.
// fp32 accumulation in one fixed order per output (no split-K): deterministic.
//
// -DPG_EMU builds it for the CPU emulator (csrc/emu/cuda_on_cpu.h, tests/test_prefill_gemm_cpu.py):
// the PTX operations then run as C++ with the documented semantics, and pg_emu_launch is the entry.

#ifndef PG_EMU
extern __shared__ __align__(16) unsigned char pg_smem[];
#define PG_SMEM pg_smem
#else
#define PG_SMEM mk_emu::block_smem()
#endif

namespace pg {

constexpr int kThreads = 128, kBN = 64, kBK = 32;

struct Args {
  const unsigned short* a;
  const unsigned short* b;
  float* c;
  int m, n, k;
  long long lda, sa, ldb, sb, ldc, sc;  // row and batch strides, in elements
  float alpha;
  int vec_c;  // C base 8-byte aligned, ldc and sc even: float2 stores
};

template <int MI>
struct Tile {
  static constexpr int BM = 32 * MI;
  static constexpr int kStages = MI == 4 ? 3 : 4;  // 36 KB at MI 4, 24 / 32 KB below
  static constexpr int kABytes = BM * kBK * 2, kBBytes = kBN * kBK * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes;
};

// Shared tiles are stored in 16-byte chunks (8 bf16), XOR-swizzled so that the 8 row addresses of one
// ldmatrix (8 consecutive rows from a multiple of 8, same logical chunk) hit 8 distinct bank groups.
// Rows of 32 k (A, and B as [N, K]): 64 bytes, 4 chunks, two rows share a 128-byte bank line.
__device__ __forceinline__ int swz_k(int r, int c) { return r * 64 + ((c ^ ((r >> 1) & 3)) << 4); }
// Rows of 64 n (B as [K, N]): 128 bytes, 8 chunks.
__device__ __forceinline__ int swz_n(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }

#ifdef PG_EMU
inline void cp16(unsigned char* dst, const unsigned short* src, int bytes) {
  if (bytes) memcpy(dst, src, bytes);
  memset(dst + bytes, 0, 16 - bytes);
}
inline void cp_commit() {}
template <int N>
inline void cp_wait() {}
// ldmatrix.m8n8.x4(.trans).b16: lanes 8j..8j+7 give the row addresses of matrix j; register j of lane l
// holds row l/4, elements 2(l%4), 2(l%4)+1 (.trans: element l/4 of rows 2(l%4) and 2(l%4)+1).
template <bool TRANS>
inline void ldsm_x4(unsigned (&r)[4], const unsigned char* p) {
  unsigned long long w = (unsigned long long)(uintptr_t)p;
  auto vals = mk_emu::warp_exchange(&w, 1);
  const int l = (int)mk_emu::lane();
  auto row = [&](int j, int i) { return (const unsigned short*)(uintptr_t)vals[8 * j + i][0]; };
  for (int j = 0; j < 4; j++) {
    unsigned lo, hi;
    if (TRANS) {
      lo = row(j, 2 * (l & 3))[l >> 2];
      hi = row(j, 2 * (l & 3) + 1)[l >> 2];
    } else {
      lo = row(j, l >> 2)[2 * (l & 3)];
      hi = row(j, l >> 2)[2 * (l & 3) + 1];
    }
    r[j] = lo | (hi << 16);
  }
}
inline void mma(float (&d)[4], const unsigned (&a)[4], const unsigned* b) {
  mk_emu_mma_16816(d, make_uint4(a[0], a[1], a[2], a[3]), make_uint2(b[0], b[1]));
}
inline void st2(float* p, float x, float y) { p[0] = x; p[1] = y; }
#else
__device__ __forceinline__ unsigned smem_u32(const void* p) {  // (inline PTX: no header needed under NVRTC)
  unsigned r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}
// 16-byte async copy; bytes < 16 (0 included) reads only `bytes` and zero-fills the rest.
__device__ __forceinline__ void cp16(unsigned char* dst, const unsigned short* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
template <bool TRANS>
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const unsigned char* p) {
  if (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)) : "memory");
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)) : "memory");
}
// d += a (16 x 16, row) * b (16 x 8, col), fp32 accumulators.
__device__ __forceinline__ void mma(float (&d)[4], const unsigned (&a)[4], const unsigned* b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void st2(float* p, float x, float y) { *reinterpret_cast<float2*>(p) = make_float2(x, y); }
#endif

// Byte offset of 16-byte chunk c of row r in a tile whose rows hold CHUNKS chunks (4: 32 k, 8: 64 n).
template <int CHUNKS>
__device__ __forceinline__ int swz(int r, int c) { return CHUNKS == 4 ? swz_k(r, c) : swz_n(r, c); }

// A ROWS x (8 CHUNKS) tile of a row-major bf16 matrix [nrows, ncols] (row stride ld) at (r0, c0) into shared
// memory, zero outside the matrix. A and B as [N, K] are rows of 32 k (CHUNKS 4); B as [K, N], rows of 64 n.
template <int ROWS, int CHUNKS, bool VEC>
__device__ __forceinline__ void load_tile(unsigned char* s, const unsigned short* g, long long ld, int nrows,
                                          int ncols, int r0, int c0, int tid) {
  if (VEC) {
    for (int i = tid; i < ROWS * CHUNKS; i += kThreads) {
      const int r = (unsigned)i / CHUNKS, c = (unsigned)i % CHUNKS, gr = r0 + r, gc = c0 + 8 * c;  // (shifts)
      const bool ok = gr < nrows && gc < ncols;
      cp16(s + swz<CHUNKS>(r, c), ok ? g + gr * ld + gc : g, ok ? 2 * min(8, ncols - gc) : 0);
    }
  } else {  // consecutive threads read one row: coalesced 2-byte loads
    for (int i = tid; i < ROWS * CHUNKS * 8; i += kThreads) {
      const int r = (unsigned)i / (CHUNKS * 8), e = (unsigned)i % (CHUNKS * 8), gr = r0 + r, gc = c0 + e;
      const unsigned short v = (gr < nrows && gc < ncols) ? g[gr * ld + gc] : (unsigned short)0;
      *reinterpret_cast<unsigned short*>(s + swz<CHUNKS>(r, e >> 3) + 2 * (e & 7)) = v;
    }
  }
}

template <int MI, bool TB, bool VA, bool VB>
__device__ __forceinline__ void load_stage(unsigned char* stage, const Args& p, const unsigned short* a,
                                           const unsigned short* b, int m0, int n0, int kt, int tid) {
  const int k0 = kt * kBK;
  load_tile<Tile<MI>::BM, 4, VA>(stage, a, p.lda, p.m, p.k, m0, k0, tid);
  if (TB)  // B as [N, K] is laid out like A: rows of 32 k
    load_tile<kBN, 4, VB>(stage + Tile<MI>::kABytes, b, p.ldb, p.n, p.k, n0, k0, tid);
  else  // B as [K, N]: 32 rows of k, 64 n each
    load_tile<kBK, 8, VB>(stage + Tile<MI>::kABytes, b, p.ldb, p.k, p.n, k0, n0, tid);
}

// The MMAs of one staged k tile: two k16 steps, each MI x 4 mma per warp.
template <int MI, bool TB>
__device__ __forceinline__ void compute_stage(const unsigned char* stage, float (&acc)[MI][4][4], int wm, int wn,
                                              int lane) {
  const unsigned char* sa = stage;
  const unsigned char* sb = stage + Tile<MI>::kABytes;
#pragma unroll
  for (int ks = 0; ks < 2; ks++) {
    unsigned af[MI][4], bf[4][2];
    // A x4: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15)
    // = registers a0a1, a2a3, a4a5, a6a7 of the m16n8k16 A fragment.
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
      ldsm_x4<false>(af[mi], sa + swz_k(wm * 16 * MI + mi * 16 + (lane & 15), 2 * ks + (lane >> 4)));
#pragma unroll
    for (int q = 0; q < 2; q++) {  // n8 tiles 2q and 2q + 1: matrices (n-tile, k half) -> b0b1, b2b3 each
      unsigned t[4];
      if (TB)  // [N, K] rows: matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
        ldsm_x4<false>(t, sb + swz_k(wn * 32 + q * 16 + (lane & 7) + ((lane >> 4) << 3), 2 * ks + ((lane >> 3) & 1)));
      else  // [K, N] rows, transposed: matrices (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15)
        ldsm_x4<true>(t, sb + swz_n(16 * ks + (lane & 7) + (((lane >> 3) & 1) << 3), wn * 4 + q * 2 + (lane >> 4)));
      bf[2 * q][0] = t[0];
      bf[2 * q][1] = t[1];
      bf[2 * q + 1][0] = t[2];
      bf[2 * q + 1][1] = t[3];
    }
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
      for (int ni = 0; ni < 4; ni++) mma(acc[mi][ni], af[mi], bf[ni]);
  }
}

// One block's output tile. Blocks are numbered m tile fastest, then n tile, then batch: blocks
// running together share the n tile, so a weight tile is read from DRAM once and from L2 after.
template <int MI, bool TB, bool VA, bool VB>
__device__ __forceinline__ void gemm_block(const Args& p, unsigned bid) {
  using T = Tile<MI>;
  unsigned char* smem = PG_SMEM;
  const int tm = (p.m + T::BM - 1) / T::BM, tn = (p.n + kBN - 1) / kBN;
  const int mt = (int)(bid % (unsigned)tm), nt = (int)((bid / (unsigned)tm) % (unsigned)tn);
  const long long z = (long long)(bid / ((unsigned)tm * (unsigned)tn));
  const int m0 = mt * T::BM, n0 = nt * kBN;
  const unsigned short* a = p.a + z * p.sa;
  const unsigned short* b = p.b + z * p.sb;
  const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp >> 1, wn = warp & 1;

  float acc[MI][4][4];
#pragma unroll
  for (int mi = 0; mi < MI; mi++)
#pragma unroll
    for (int ni = 0; ni < 4; ni++)
#pragma unroll
      for (int j = 0; j < 4; j++) acc[mi][ni][j] = 0.f;

  // Pipeline: tile kt lives in stage kt % kStages. One commit group per tile (empty ones included, so
  // wait_group<kStages - 2> at iteration kt always means "tile kt has landed").
  const int ktiles = (p.k + kBK - 1) / kBK;
#pragma unroll
  for (int s = 0; s < T::kStages - 1; s++) {
    if (s < ktiles) load_stage<MI, TB, VA, VB>(smem + s * T::kStageBytes, p, a, b, m0, n0, s, tid);
    cp_commit();
  }
  for (int kt = 0; kt < ktiles; kt++) {
    cp_wait<T::kStages - 2>();
    __syncthreads();  // tile kt visible to all; every warp is done with tile kt - 1's stage
    const int next = kt + T::kStages - 1;
    if (next < ktiles) load_stage<MI, TB, VA, VB>(smem + (next % T::kStages) * T::kStageBytes, p, a, b, m0, n0, next, tid);
    cp_commit();
    compute_stage<MI, TB>(smem + (kt % T::kStages) * T::kStageBytes, acc, wm, wn, lane);
  }

  // Accumulator c0 c1: row g, columns 2t, 2t + 1; c2 c3: row g + 8 (g = lane / 4, t = lane % 4).
  float* c = p.c + z * p.sc;
  const int g = lane >> 2, t2 = 2 * (lane & 3);
#pragma unroll
  for (int mi = 0; mi < MI; mi++)
#pragma unroll
    for (int ni = 0; ni < 4; ni++) {
      const int col = n0 + wn * 32 + ni * 8 + t2;
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const int row = m0 + wm * 16 * MI + mi * 16 + g + 8 * h;
        if (row >= p.m || col >= p.n) continue;
        float* dst = c + row * p.ldc + col;
        const float x = p.alpha * acc[mi][ni][2 * h], y = p.alpha * acc[mi][ni][2 * h + 1];
        if (col + 1 < p.n) {
          if (p.vec_c) st2(dst, x, y);
          else { dst[0] = x; dst[1] = y; }
        } else {
          dst[0] = x;
        }
      }
    }
}

}  // namespace pg

#ifndef PG_EMU
// pg_gemm_m{MI}_t{TB}_a{VA}_b{VB}: 1-D grid of ceil(M / BM) * ceil(N / 64) * batch blocks of 128 threads,
// Tile<MI>::kSmemBytes of dynamic shared memory.
#define PG_KERNEL(MI, TB, VA, VB)                                                                              \
  extern "C" __global__ void __launch_bounds__(pg::kThreads) pg_gemm_m##MI##_t##TB##_a##VA##_b##VB(           \
      const unsigned short* a, const unsigned short* b, float* c, int m, int n, int k, long long lda,           \
      long long sa, long long ldb, long long sb, long long ldc, long long sc, float alpha, int vec_c) {        \
    const pg::Args p{a, b, c, m, n, k, lda, sa, ldb, sb, ldc, sc, alpha, vec_c};                              \
    pg::gemm_block<MI, TB != 0, VA != 0, VB != 0>(p, blockIdx.x);                                            \
  }
#define PG_KERNELS_MI(MI) \
  PG_KERNEL(MI, 0, 0, 0) PG_KERNEL(MI, 0, 0, 1) PG_KERNEL(MI, 0, 1, 0) PG_KERNEL(MI, 0, 1, 1) \
  PG_KERNEL(MI, 1, 0, 0) PG_KERNEL(MI, 1, 0, 1) PG_KERNEL(MI, 1, 1, 0) PG_KERNEL(MI, 1, 1, 1)
PG_KERNELS_MI(1)
PG_KERNELS_MI(2)
PG_KERNELS_MI(4)
#else
// The emulator's entry: the same block function on `blocks` x 128 fibers.
struct PgEmuLaunch {
  pg::Args p;
  int mi, tb, va, vb;
};
template <int MI>
static void pg_emu_block(const PgEmuLaunch& l) {
  const unsigned bid = blockIdx.x;
  const int sel = l.tb * 4 + l.va * 2 + l.vb;
  switch (sel) {
    case 0: pg::gemm_block<MI, false, false, false>(l.p, bid); break;
    case 1: pg::gemm_block<MI, false, false, true>(l.p, bid); break;
    case 2: pg::gemm_block<MI, false, true, false>(l.p, bid); break;
    case 3: pg::gemm_block<MI, false, true, true>(l.p, bid); break;
    case 4: pg::gemm_block<MI, true, false, false>(l.p, bid); break;
    case 5: pg::gemm_block<MI, true, false, true>(l.p, bid); break;
    case 6: pg::gemm_block<MI, true, true, false>(l.p, bid); break;
    default: pg::gemm_block<MI, true, true, true>(l.p, bid); break;
  }
}
extern "C" int pg_emu_launch(int mi, int tb, int va, int vb, const void* a, const void* b, void* c, int m, int n,
                             int k, long long lda, long long sa, long long ldb, long long sb, long long ldc,
                             long long sc, float alpha, int vec_c, unsigned blocks, unsigned long long smem,
                             unsigned long long max_switches) {
  const PgEmuLaunch l{{(const unsigned short*)a, (const unsigned short*)b, (float*)c, m, n, k, lda, sa, ldb, sb,
                       ldc, sc, alpha, vec_c},
                      mi, tb, va, vb};
  auto run = [](const void* q) {
    const PgEmuLaunch& x = *static_cast<const PgEmuLaunch*>(q);
    if (x.mi == 1) pg_emu_block<1>(x);
    else if (x.mi == 2) pg_emu_block<2>(x);
    else pg_emu_block<4>(x);
  };
  return mk_emu::run(run, &l, blocks, pg::kThreads, smem, 256 << 10, max_switches);
}
extern "C" int pg_emu_smem_bytes(int mi) {
  return mi == 1 ? pg::Tile<1>::kSmemBytes : mi == 2 ? pg::Tile<2>::kSmemBytes : pg::Tile<4>::kSmemBytes;
}
#endif
