"""replicas.monokernel_blas.CublasC (cuBLAS through ctypes, so CUDA graphs can capture the prefill's GEMMs)
against a stand-in library with cuBLAS's C signatures: every argument arrives in its C position and type, a
non-zero status raises. The real library is exercised by the GPU tests (tests/test_prefill_graph_gpu.py)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest

from replicas.monokernel_blas import COMPUTE_32F, GEMM_DEFAULT, OP_N, OP_T, R_16BF, R_32F, CublasC

STUB = r"""
#include <stdint.h>
extern "C" {
long long seen[32];
int status = 0;
int cublasGemmEx(void* h, int ta, int tb, int m, int n, int k, const void* alpha, const void* A, int at, int lda,
                 const void* B, int bt, int ldb, const void* beta, void* C, int ct, int ldc, int compute, int algo) {
  long long v[] = {(long long)(intptr_t)h, ta, tb, m, n, k, *(const float*)alpha == 2.5f, (long long)(intptr_t)A,
                   at, lda, (long long)(intptr_t)B, bt, ldb, *(const float*)beta == 0.f, (long long)(intptr_t)C, ct,
                   ldc, compute, algo};
  for (int i = 0; i < 19; i++) seen[i] = v[i];
  return status;
}
int cublasGemmStridedBatchedEx(void* h, int ta, int tb, int m, int n, int k, const void* alpha, const void* A, int at,
                               int lda, long long sa, const void* B, int bt, int ldb, long long sb, const void* beta,
                               void* C, int ct, int ldc, long long sc, int batch, int compute, int algo) {
  long long v[] = {(long long)(intptr_t)h, ta, tb, m, n, k, 0, (long long)(intptr_t)A, at, lda, sa,
                   (long long)(intptr_t)B, bt, ldb, sb, 0, (long long)(intptr_t)C, ct, ldc, sc, batch, compute, algo};
  for (int i = 0; i < 23; i++) seen[i] = v[i];
  return status;
}
int cublasSetStream_v2(void* h, void* s) { seen[0] = (long long)(intptr_t)h; seen[1] = (long long)(intptr_t)s; return status; }
}
"""


@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("needs g++")
    d = tmp_path_factory.mktemp("cublas_stub")
    (d / "stub.cpp").write_text(STUB)
    so = d / "libcublas_stub.so"
    r = subprocess.run([cxx, "-shared", "-fPIC", "-O1", str(d / "stub.cpp"), "-o", str(so)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    return str(so), ctypes.CDLL(str(so))


def seen(lib, n):
    return list((ctypes.c_longlong * 32).in_dll(lib, "seen"))[:n]


def test_gemm_ex_passes_every_argument_in_its_c_position(stub):
    path, lib = stub
    import numpy as np

    alpha, beta = np.array([2.5], np.float32), np.zeros(1, np.float32)
    c = CublasC(path)
    big = 0x7F00_0000_1000  # device pointers above 2^32 survive
    c.gemmEx(0x1234, OP_T, OP_N, 3072, 40, 2048, alpha.ctypes.data, big, R_16BF, 2048, big + 64, R_16BF, 2048,
             beta.ctypes.data, big + 128, R_32F, 3072, COMPUTE_32F, GEMM_DEFAULT)
    assert seen(lib, 19) == [0x1234, OP_T, OP_N, 3072, 40, 2048, 1, big, R_16BF, 2048, big + 64, R_16BF, 2048, 1,
                             big + 128, R_32F, 3072, COMPUTE_32F, GEMM_DEFAULT]


def test_strided_batched_and_set_stream(stub):
    path, lib = stub
    c = CublasC(path)
    big = 0x7F00_0000_1000
    c.gemmStridedBatchedEx(7, OP_T, OP_N, 100, 32, 64, 0, big, R_16BF, 64, 2**33, big + 8, R_16BF, 64, 12345, 0,
                           big + 16, R_32F, 100, 3200, 8, COMPUTE_32F, GEMM_DEFAULT)
    assert seen(lib, 23) == [7, OP_T, OP_N, 100, 32, 64, 0, big, R_16BF, 64, 2**33, big + 8, R_16BF, 64, 12345, 0,
                             big + 16, R_32F, 100, 3200, 8, COMPUTE_32F, GEMM_DEFAULT]
    c.setStream(0x55, 0x66)
    assert seen(lib, 2) == [0x55, 0x66]


def test_a_failed_call_raises_with_its_status(stub):
    path, lib = stub
    ctypes.c_int.in_dll(lib, "status").value = 13
    try:
        with pytest.raises(RuntimeError, match="cublasSetStream_v2 returned cuBLAS status 13"):
            CublasC(path).setStream(1, 2)
    finally:
        ctypes.c_int.in_dll(lib, "status").value = 0
