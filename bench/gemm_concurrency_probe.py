"""Which prefill GEMMs wait for a persistent kernel holding most SMs (issue 9's resident joins).

    python bench/gemm_concurrency_probe.py

The H200 run of bench/concurrency_probe.py found the prefill's bf16 cuBLAS gemmEx waiting for a spinning
kernel on 116 SMs while fp32 sgemm, elementwise kernels, copies and allocations did not. This times the
prefill's GEMM shapes (llama-3.2-1b: T = 40 rows, N x K = 3072 x 2048, 16384 x 2048, 2048 x 8192) as bf16
gemmEx (fp32 compute), as TF32 and as fp32 sgemm, under spins of 116 / 100 / 66 SMs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.concurrency_probe import _SPIN, time_beside  # noqa: E402

SPIN_MS = 300


def main() -> None:
    import cupy as cp
    import numpy as np

    from replicas.monokernel_blas import COMPUTE_32F, GEMM_DEFAULT, OP_N, OP_T, R_16BF, R_32F, _cublas

    lib = _cublas(cp)
    spin = cp.RawModule(code=_SPIN, enable_cooperative_groups=True).get_function("spin")
    spin.max_dynamic_shared_size_bytes = 200 * 1024
    a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    t_rows = 40

    def gemm(n, k, in_type, compute):
        w = cp.random.standard_normal((n, k), dtype=cp.float32)
        x = cp.random.standard_normal((t_rows, k), dtype=cp.float32)
        if in_type == R_16BF:
            w, x = (w.view(cp.uint32) >> 16).astype(cp.uint16), (x.view(cp.uint32) >> 16).astype(cp.uint16)
        y = cp.empty((t_rows, n), cp.float32)

        def run():
            h = cp.cuda.device.get_cublas_handle()
            lib.setStream(h, b.ptr)
            lib.gemmEx(h, OP_T, OP_N, n, t_rows, k, one.ctypes.data, w.data.ptr, in_type, k, x.data.ptr, in_type,
                       k, zero.ctypes.data, y.data.ptr, R_32F, n, compute, GEMM_DEFAULT)
        return run

    cases = {}
    for n, k in ((3072, 2048), (16384, 2048), (2048, 8192)):
        cases[f"bf16 {n}x{k}"] = gemm(n, k, R_16BF, COMPUTE_32F)
        cases[f"tf32 {n}x{k}"] = gemm(n, k, R_32F, 77)  # CUBLAS_COMPUTE_32F_FAST_TF32
        cases[f"fp32 {n}x{k}"] = gemm(n, k, R_32F, COMPUTE_32F)
    for run in cases.values():
        with b:
            run()
    b.synchronize()
    for blocks in (116, 100, 66):
        for name, run in cases.items():
            ms = time_beside(spin, blocks, 200 * 1024, a, b, run, SPIN_MS)
            print(json.dumps({"spin_sms": blocks, "gemm": name, "ms": round(ms, 2), "waited": ms > SPIN_MS / 2}))


if __name__ == "__main__":
    main()
