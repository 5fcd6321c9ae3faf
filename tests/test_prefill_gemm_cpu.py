"""The prefill GEMM (csrc/prefill_gemm.cu, replicas/prefill_gemm.py) without a GPU.

- a numpy model of the kernel's ldmatrix lane addresses and the PTX ISA's m16n8k16 fragment formulas
  (A: row g (+8 for a2 a3 a6 a7), col 2t + (i & 1) (+8 for a4..a7); B: k 2t + (i & 1) (+8 for b2 b3),
  n g; C: row g (+8 for c2 c3), col 2t + (i & 1); g = lane >> 2, t = lane % 4) must reproduce A @ B;
- the real kernel source on the CPU emulator (csrc/emu/cuda_on_cpu.h: fibers for threads, its own
  PTX-layout mma) through plan_gemm's launch arguments: every tile size, both B layouts, the 16-byte and
  2-byte load paths, unaligned K / N, strided and broadcast operands, non-contiguous output;
- nvcc builds it for sm_90a with exactly the kernels the module names; the module imports without
  CuPy; argument checks raise clear ValueErrors.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from replicas import prefill_gemm as pg
from tests.emu_cpp import build_emulated

# -- fragment model -------------------------------------------------------------------------------------

LANES = np.arange(32)
G, T = LANES >> 2, LANES & 3


def ldmatrix_x4(mat: np.ndarray, addr, trans: bool) -> np.ndarray:
    """ldmatrix.m8n8.x4(.trans).b16 on a logical matrix: addr(lane) -> (row, first col) of the 8
    elements lane gives for matrix lane // 8. Returns [32 lanes, 4 regs, 2 halves (lo, hi)]."""
    rows = [addr(l) for l in range(32)]
    out = np.zeros((32, 4, 2), mat.dtype)
    for l in range(32):
        for j in range(4):
            for h in range(2):
                if trans:  # element l/4 of the matrix's rows 2(l%4) + h
                    r, c = rows[8 * j + 2 * (l & 3) + h]
                    out[l, j, h] = mat[r, c + (l >> 2)]
                else:  # row l/4, elements 2(l%4) + h
                    r, c = rows[8 * j + (l >> 2)]
                    out[l, j, h] = mat[r, c + 2 * (l & 3) + h]
    return out


def mma_from_fragments(a_frag: np.ndarray, b_frag: np.ndarray) -> np.ndarray:
    """m16n8k16 per the PTX ISA: a_frag [32, 8] (a0..a7), b_frag [32, 4] (b0..b3) -> d [32, 4]."""
    a = np.zeros((16, 16))
    b = np.zeros((16, 8))
    for i in range(8):
        a[G + 8 * ((i >> 1) & 1), 2 * T + (i & 1) + 8 * (i >> 2)] = a_frag[:, i]
    for i in range(4):
        b[2 * T + (i & 1) + 8 * (i >> 1), G] = b_frag[:, i]
    d = a @ b
    return np.stack([d[G + 8 * (i >> 1), 2 * T + (i & 1)] for i in range(4)], axis=1)


def c_to_matrix(d: np.ndarray) -> np.ndarray:
    c = np.zeros((16, 8))
    for i in range(4):
        c[G + 8 * (i >> 1), 2 * T + (i & 1)] = d[:, i]
    return c


@pytest.mark.parametrize("trans_b", [True, False])
def test_kernel_ldmatrix_addresses_feed_the_documented_fragments(trans_b):
    """The lane -> (row, chunk) addresses of compute_stage, for one k16 step of a 16-row A slice and a
    16-column B slice (two n8 tiles), give each lane its PTX fragment: the product equals A @ B."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((16, 16))
    b = rng.standard_normal((16, 16))  # [k, n]
    af = ldmatrix_x4(a, lambda l: (l & 15, 8 * (l >> 4)), trans=False).reshape(32, 8)
    if trans_b:  # shared rows are n (b^T), non-transposed ldmatrix
        t = ldmatrix_x4(b.T.copy(), lambda l: ((l & 7) + ((l >> 4) << 3), 8 * ((l >> 3) & 1)), trans=False)
    else:  # shared rows are k, transposed ldmatrix
        t = ldmatrix_x4(b, lambda l: ((l & 7) + (((l >> 3) & 1) << 3), 8 * (l >> 4)), trans=True)
    for q in range(2):  # n tile q: registers t[2q], t[2q + 1] are its b0b1, b2b3
        bf = t[:, 2 * q:2 * q + 2].reshape(32, 4)
        got = c_to_matrix(mma_from_fragments(af, bf))
        np.testing.assert_allclose(got, a @ b[:, 8 * q:8 * q + 8], rtol=1e-12, atol=1e-12)


def test_a_fragment_formula_matches_the_register_pairs():
    """a0a1 / a2a3 / a4a5 / a6a7 = (row g, k 2t), (row g + 8, k 2t), (row g, k 2t + 8), (row g + 8, k 2t + 8)."""
    m = np.arange(256).reshape(16, 16)  # value = row * 16 + k
    af = ldmatrix_x4(m, lambda l: (l & 15, 8 * (l >> 4)), trans=False).reshape(32, 8)
    lane = 13  # g 3, t 1
    assert af[lane].tolist() == [50, 51, 178, 179, 58, 59, 186, 187]


# -- the kernel on the CPU emulator ---------------------------------------------------------------------

def tol(k: int) -> float:
    """max |got - ref| / max |ref| allowed. bf16 x bf16 products are exact in fp32, so the error is the
    fp32 accumulation's: up to ~2 ulps (truncating adds) of the running sum per k16 mma, about
    max |ref| in size: 2 * 2^-23 * ceil(K / 16). (A numpy model of round-toward-zero per k16 step gives
    3e-6 at K = 2048 against this 3e-5.) A wrong fragment or a lost k chunk is O(1e-2) or worse."""
    return 2.0 ** -22 * -(-k // 16)


def bf16(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bits (round to nearest even)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def as_f64(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def rand_bits(rng, shape) -> np.ndarray:
    """bf16 bits of normal values, zeros replaced, so every element matters."""
    x = rng.standard_normal(shape).astype(np.float32)
    x[x == 0] = 1.0
    return bf16(x)


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    lib = build_emulated(tmp_path_factory.mktemp("pg_emu"), "pg_emu", pg.SOURCE.read_text(), ("-DPG_EMU",))
    P, I, LL = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    lib.pg_emu_launch.restype = I
    lib.pg_emu_launch.argtypes = [I, I, I, I, P, P, P, I, I, I, LL, LL, LL, LL, LL, LL, ctypes.c_float, I,
                                  ctypes.c_uint, ctypes.c_ulonglong, ctypes.c_ulonglong]
    lib.pg_emu_smem_bytes.restype = I
    return lib


def emu_gemm(lib, a, b, out, *, trans_b, alpha=1.0) -> pg.Plan:
    """MmaGemm.gemm's launch, run by the emulator on numpy arrays."""
    p = pg.plan_gemm(a, b, out, trans_b=trans_b, alpha=alpha)
    rc = lib.pg_emu_launch(p.mi, int(p.trans_b), int(p.vec_a), int(p.vec_b), pg.data_ptr(a), pg.data_ptr(b),
                           pg.data_ptr(out), p.m, p.n, p.k, p.lda, p.sa, p.ldb, p.sb, p.ldc, p.sc, p.alpha,
                           int(p.vec_c), p.blocks, p.smem, 10**9)
    assert rc == 0, "emulated kernel deadlocked"
    return p


def reference(a, b, trans_b, alpha):
    bt = as_f64(b).transpose(0, 2, 1) if trans_b else as_f64(b)
    return alpha * np.einsum("zmk,zkn->zmn", as_f64(a), bt)


def check(got, ref, k):
    err = np.abs(got.astype(np.float64) - ref).max() / np.abs(ref).max()
    assert err <= tol(k), f"max |d| / max |ref| = {err:.3g} > {tol(k):.3g}"


def test_emulator_shared_memory_matches_the_plan(emu):
    for mi in pg.MIS:
        assert emu.pg_emu_smem_bytes(mi) == pg.smem_bytes(mi) <= 48 * 1024


def operand(rng, batch, rows, cols, pad=0, offset=0, batch_pad=0):
    """A [batch, rows, cols] view into a bigger buffer: row stride cols + pad, batch stride
    (rows + batch_pad) * (cols + pad), first element `offset` elements into the buffer."""
    buf = rand_bits(rng, (batch * (rows + batch_pad) * (cols + pad) + offset + 8,))
    view = buf[offset:offset + batch * (rows + batch_pad) * (cols + pad)].reshape(batch, rows + batch_pad, cols + pad)
    return view[:, :rows, :cols]


CASES = [  # (batch, M, N, K, trans_b, pads (a, b), offsets (a, b), want (vec_a, vec_b))
    (1, 5, 70, 45, True, (3, 3), (0, 0), (True, True)),      # K % 8 != 0 under 16-byte loads: partial chunks
    (2, 37, 70, 45, True, (0, 0), (0, 0), (False, False)),   # row stride 45: 2-byte loads
    (2, 50, 37, 200, True, (8, 0), (0, 0), (True, True)),    # 7 k tiles (past the pipeline's stages)
    (1, 130, 66, 96, True, (0, 0), (1, 0), (False, True)),   # A 2 bytes off 16-byte alignment
    (2, 130, 64, 37, False, (0, 0), (0, 0), (False, True)),  # P.V-like: P rows of 37 keys, B [K, N]
    (2, 20, 37, 64, False, (0, 3), (0, 0), (True, True)),    # B [K, N] with N % 8 != 0 (ldb 40)
    (2, 64, 45, 70, False, (2, 0), (0, 0), (True, False)),   # ldb 45: 2-byte B [K, N] loads
    (3, 33, 9, 130, False, (6, 0), (0, 1), (True, False)),   # B off alignment, 5 k tiles
]


@pytest.mark.parametrize("batch,m,n,k,trans_b,pads,offs,want", CASES)
def test_emulated_kernel_matches_float64(emu, batch, m, n, k, trans_b, pads, offs, want):
    rng = np.random.default_rng(batch * 1000 + m + n + k)
    a = operand(rng, batch, m, k, pads[0], offs[0], batch_pad=1)
    b = operand(rng, batch, n, k, pads[1], offs[1]) if trans_b else operand(rng, batch, k, n, pads[1], offs[1])
    out_buf = np.full((batch, m + 2, n + 3), np.nan, np.float32)  # strided out; untouched parts stay NaN
    out = out_buf[:, 1:m + 1, 1:n + 1]  # 4 bytes past 8-byte alignment: scalar stores
    p = emu_gemm(emu, a, b, out, trans_b=trans_b, alpha=0.37)
    assert (p.vec_a, p.vec_b, p.vec_c) == (*want, False)
    check(out, reference(a, b, trans_b, 0.37), k)
    mask = np.ones(out_buf.shape, bool)
    mask[:, 1:m + 1, 1:n + 1] = False
    assert np.isnan(out_buf[mask]).all(), "wrote outside the output view"


def test_emulated_broadcast_b_and_vector_stores(emu):
    """Batch stride 0 (one B for every batch entry, as a shared V) and float2 output stores."""
    rng = np.random.default_rng(7)
    a = operand(rng, 3, 40, 64)
    b1 = rand_bits(rng, (1, 64, 72))
    b = np.lib.stride_tricks.as_strided(b1, shape=(3, 64, 72), strides=(0, *b1.strides[1:]))
    out = np.zeros((3, 40, 72), np.float32)
    p = emu_gemm(emu, a, b, out, trans_b=False)
    assert p.vec_a and p.vec_b and p.vec_c and p.mi == 2 and p.blocks == 1 * 2 * 3
    check(out, reference(a, b, False, 1.0), 64)


# -- build, import, argument checks ---------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_source_compiles_for_sm90a_with_the_named_kernels(tmp_path):
    r = subprocess.run(["nvcc", "-arch=sm_90a", "-std=c++17", "-c", "-o", str(tmp_path / "x.o"), str(pg.SOURCE)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    r = subprocess.run(["nvcc", "-arch=sm_90a", "-std=c++17", "-ptx", "-o", str(tmp_path / "x.ptx"), str(pg.SOURCE)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    ptx = (tmp_path / "x.ptx").read_text()
    entries = {line.split(".entry")[1].strip().split("(")[0] for line in ptx.splitlines() if ".entry" in line}
    assert entries == set(pg.KERNELS)
    for banned in ("wgmma", "cp.async.bulk", "cluster", "setmaxnreg"):  # what would tie it to free SMs
        assert banned not in ptx


def _nvrtc():
    """libnvrtc by soname, or $NVRTC_LIBRARY (a path; its builtins library is loaded from beside it)."""
    import os

    path = os.environ.get("NVRTC_LIBRARY")
    try:
        if path:
            for lib in sorted(Path(path).parent.glob("libnvrtc-builtins.so.*")):
                ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(path)
        for name in ("libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"):
            try:
                return ctypes.CDLL(name)
            except OSError:
                continue
    except OSError:
        pass
    return None


def test_source_compiles_under_nvrtc_as_cupy_does():
    """cp.RawModule compiles with NVRTC (no host headers, options -std=c++17 plus the device's arch)."""
    lib = _nvrtc()
    if lib is None:
        pytest.skip("libnvrtc not found (set NVRTC_LIBRARY to its path)")
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), pg.SOURCE.read_bytes(), b"prefill_gemm.cu", 0, None, None) == 0
    opts = (ctypes.c_char_p * 2)(b"-std=c++17", b"--gpu-architecture=sm_90")
    rc = lib.nvrtcCompileProgram(prog, 2, opts)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    assert rc == 0, log.value.decode()[-4000:]


def test_module_imports_without_cupy():
    code = ("import sys; sys.modules['cupy'] = None\n"  # `import cupy` now raises ImportError
            "import replicas.prefill_gemm as m\n"
            "assert m.MmaGemm and m.plan_gemm and 'cupy' not in [k for k, v in sys.modules.items() if v]\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(pg.SOURCE.parent.parent))
    assert r.returncode == 0, r.stderr


def test_mma_gemm_compiles_the_source_once_with_cxx17():
    calls = []

    class RawModule:
        def __init__(self, code, options):
            calls.append((code, options))

    g = pg.MmaGemm(types.SimpleNamespace(RawModule=RawModule, ndarray=type(None)))
    assert calls == [(pg.SOURCE.read_text(), ("-std=c++17",))]
    with pytest.raises(ValueError, match="a must be a CuPy array"):
        g.gemm(np.zeros((1, 2, 2), np.uint16), None, None, trans_b=True)


def bits(*shape):
    return np.zeros(shape, np.uint16)


def out32(*shape):
    return np.zeros(shape, np.float32)


@pytest.mark.parametrize("a,b,out,trans_b,match", [
    (bits(4, 8), bits(1, 3, 8), out32(1, 4, 3), True, "a must be 3-d"),
    (np.zeros((1, 4, 8), np.float16), bits(1, 3, 8), out32(1, 4, 3), True, "a must be uint16"),
    (bits(1, 4, 8), bits(1, 3, 8), np.zeros((1, 4, 3), np.float64), True, "out must be float32"),
    (bits(1, 4, 8), bits(1, 3, 9), out32(1, 4, 3), True, r"b \[batch, N, K\]"),
    (bits(1, 4, 8), bits(1, 3, 8), out32(1, 4, 3), False, r"b \[batch, K, N\]"),
    (bits(2, 4, 8), bits(1, 3, 8), out32(2, 4, 3), True, "must match"),
    (bits(1, 4, 8), bits(1, 3, 8), out32(1, 3, 4), True, r"out must be \[batch, M, N\]"),
    (bits(1, 8, 4).transpose(0, 2, 1), bits(1, 3, 8), out32(1, 4, 3), True, "a's last dim must be contiguous"),
    (bits(1, 4, 8), bits(1, 3, 8), out32(1, 3, 4).transpose(0, 2, 1), True, "out's last dim must be contiguous"),
    (bits(1, 4, 8)[:, ::-1], bits(1, 3, 8), out32(1, 4, 3), True, "a's row stride must be a non-negative"),
    (bits(2, 4, 8), bits(2, 3, 8), out32(2, 4, 3)[::-1], True, "out's batch stride must be a non-negative"),
])
def test_bad_operands_are_refused(a, b, out, trans_b, match):
    with pytest.raises(ValueError, match=match):
        pg.plan_gemm(a, b, out, trans_b=trans_b)


def test_odd_byte_strides_are_refused():
    raw = np.zeros(200, np.uint8)
    a = np.lib.stride_tricks.as_strided(raw.view(np.uint16), shape=(1, 4, 8), strides=(64, 17, 2))
    with pytest.raises(ValueError, match="row stride must be a non-negative multiple of 2 bytes"):
        pg.plan_gemm(a, bits(1, 3, 8), out32(1, 4, 3), trans_b=True)


def test_plans_pick_tiles_paths_and_grid():
    w = bits(1, 3072, 2056)[:, :, :2048]  # padded weight rows (ldw 2056)
    p = pg.plan_gemm(bits(1, 40, 2048), w, out32(1, 40, 3072), trans_b=True)
    assert (p.name, p.blocks, p.ldb, p.lda, p.ldc) == ("pg_gemm_m2_t1_a1_b1", 48, 2056, 2048, 3072)
    p = pg.plan_gemm(bits(1, 300, 2048), w, out32(1, 300, 3072), trans_b=True, alpha=0.5)
    assert (p.mi, p.blocks, p.alpha, p.smem) == (4, 3 * 48, 0.5, pg.smem_bytes(4))
    # P . V: P rows of 37 keys (2-byte loads), V [keys, 64] of a [8, max_ctx, 64] cache
    v = bits(8, 256, 64)[:, :37]
    p = pg.plan_gemm(bits(8, 16, 37), v, out32(8, 16, 64), trans_b=False)
    assert (p.name, p.sb, p.ldb, p.blocks) == ("pg_gemm_m1_t0_a0_b1", 256 * 64, 64, 8)
    assert pg.plan_gemm(bits(1, 0, 8), bits(1, 3, 8), out32(1, 0, 3), trans_b=True) is None
    assert pg.plan_gemm(bits(1, 4, 0), bits(1, 3, 0), out32(1, 4, 3), trans_b=True) is None
    assert len(set(pg.KERNELS)) == 24 and all(pg.smem_bytes(mi) <= 48 * 1024 for mi in pg.MIS)


def test_small_grids_split_k_into_batch_entries():
    """k_splits on llama-3.2-1b's linears at a 32-row join (down and o: 32 blocks -> 4 parts, qkv: 48 -> 2,
    gate/up: 256 -> none), a 300-row prefill (already wide), and a K that is not a whole number of k steps."""
    assert pg.k_splits(32, 2048, 8192) == 4
    assert pg.k_splits(32, 2048, 2048) == 4
    assert pg.k_splits(32, 3072, 2048) == 2
    assert pg.k_splits(32, 16384, 2048) == 1
    assert pg.k_splits(300, 2048, 8192) == 1
    assert pg.k_splits(1, 2048, 45) == 1 and pg.k_splits(1, 2048, 96) == 1  # 96 = 3 k steps: no even split
    assert pg.k_splits(16, 4096, 14336) == 2  # llama-3.1-8b's down: 64 blocks


def test_emulated_split_k_linear_matches_float64(emu):
    """MmaGemm.linear's split path on the emulated kernel: the K parts as batch entries of padded weight rows
    (ldw = k + 8, 16-byte loads), summed after; within the same bound as one pass over K."""
    rng = np.random.default_rng(11)
    t, n, k = 5, 72, 256
    w = rand_bits(rng, (n, k + 8))
    x = rand_bits(rng, (t, k))
    splits = pg.k_splits(t, n, k, target_blocks=8)
    assert splits == 4
    a, b = pg.split_views(np, x, w, k, splits)
    parts = np.full((splits, t, n), np.nan, np.float32)
    p = emu_gemm(emu, a, b, parts, trans_b=True)
    assert (p.vec_a, p.vec_b, p.sa, p.sb, p.blocks) == (True, True, k // splits, k // splits, splits * 2)
    ks = k // splits
    for z in range(splits):  # each batch entry is its own slice of K
        check(parts[z], as_f64(x[:, z * ks:(z + 1) * ks]) @ as_f64(w[:, z * ks:(z + 1) * ks]).T, ks)
    check(parts.sum(axis=0), as_f64(x) @ as_f64(w[:, :k]).T, k)
