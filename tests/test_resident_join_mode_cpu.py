"""Joiner.warm's choice of the joins' GEMM mode (replicas/monokernel_resident.py), with the GPU parts faked:
which modes run beside a held grid, whose logits agree with the tensor-core prefill, which fail to load.
(The real check runs on the H200 in tests/test_monokernel_resident_gpu.py.)"""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import pytest

from replicas import concurrency_check, monokernel_blas, monokernel_resident
from replicas.monokernel_blas import gemm_mode
from replicas.monokernel_resident import FP32_JOIN_TOKENS, JOIN_MODE_TOL, MMA_JOIN_TOKENS, Joiner

VOCAB = 50


class _Stream(nullcontext):
    def synchronize(self):
        pass


class _Prefill:
    """Logits that depend on the calling thread's GEMM mode: `offsets[mode]` away from the tensor ones."""

    def __init__(self, offsets):
        self.offsets, self.calls = offsets, []
        self.base = np.random.default_rng(3).standard_normal((128, VOCAB)).astype(np.float32)

    def run(self, ids, all_logits=False, start=0):
        mode = gemm_mode()
        self.calls.append((mode, len(ids)))
        logits = self.base[:len(ids)] * (1 + self.offsets.get(mode, 0.0)) if all_logits else None
        return np.zeros(8, np.float32), logits


def warmed(monkeypatch, beside, offsets=None, broken=()):
    gpu = SimpleNamespace(cp=SimpleNamespace(cuda=SimpleNamespace(Device=lambda d: nullcontext()), asnumpy=np.asarray),
                          device=0, device_sms=132, layout=SimpleNamespace(num_sms=116), stream=None,
                          prefill_stream=_Stream(), admissions=SimpleNamespace(consumed=True))

    def load(cp, mode):
        if mode in broken:
            raise RuntimeError(f"{mode} kernels failed to build")

    monkeypatch.setattr(concurrency_check, "runs_beside", lambda cp, sms, stream, work, max_s=3.0:
                        (work(), (beside[gemm_mode()], 0.01))[1])
    monkeypatch.setattr(monokernel_blas, "load_gemm_mode", load)
    monkeypatch.setattr(monokernel_blas, "set_sm_count_target", lambda cp, sms: True)
    monkeypatch.setattr(monokernel_resident, "module_loading_mode", lambda: "eager")
    monkeypatch.setattr(Joiner, "_warm_handover", lambda self, slot: None)
    pre = _Prefill(offsets or {})
    j = Joiner(gpu, [None, pre])
    mode = j.warm(1, 4096, VOCAB)
    worker_mode = j._pool.submit(gemm_mode).result()  # the join thread keeps the chosen mode
    j.close()
    return j, mode, worker_mode, pre


def test_the_first_mode_that_runs_beside_and_agrees_is_taken_with_its_prompt_limit(monkeypatch):
    j, mode, worker, pre = warmed(monkeypatch, {"tensor": False, "mma": True, "fp32": True})
    assert (mode, worker, j.max_join_tokens) == ("mma", "mma", MMA_JOIN_TOKENS)
    assert j.takes(MMA_JOIN_TOKENS) and not j.takes(MMA_JOIN_TOKENS + 1)
    assert {m for m, _ in pre.calls} == {"tensor", "mma"}  # fp32 never tried
    j, mode, worker, _ = warmed(monkeypatch, {"tensor": True, "mma": True, "fp32": True})
    assert (mode, worker, j.max_join_tokens) == ("tensor", "tensor", None) and j.takes(10**6)


@pytest.mark.parametrize("why", ["logits", "build"])
def test_a_mode_with_wrong_logits_or_broken_kernels_is_skipped(monkeypatch, why):
    off = {"mma": 5 * JOIN_MODE_TOL} if why == "logits" else {}
    j, mode, worker, pre = warmed(monkeypatch, {"tensor": False, "mma": True, "fp32": True}, off,
                                  broken=("mma",) if why == "build" else ())
    assert (mode, worker, j.max_join_tokens) == ("fp32", "fp32", FP32_JOIN_TOKENS)
    j, mode, _, _ = warmed(monkeypatch, {"tensor": False, "mma": True, "fp32": True}, {"mma": JOIN_MODE_TOL / 4})
    assert mode == "mma"  # within the tolerance: accepted


def test_nothing_beside_a_launch_turns_joins_off_and_leaves_the_thread_on_tensor_cores(monkeypatch):
    j, mode, worker, _ = warmed(monkeypatch, {"tensor": False, "mma": False, "fp32": False})
    assert (mode, worker, j.max_join_tokens) == (None, "tensor", None)


def test_gemm_modes_are_checked_and_per_thread():
    from concurrent.futures import ThreadPoolExecutor

    with pytest.raises(ValueError, match="one of"):
        monokernel_blas.use_gemm_mode("bf16")
    with ThreadPoolExecutor(1) as pool:
        pool.submit(monokernel_blas.use_gemm_mode, "fp32").result()
        assert pool.submit(gemm_mode).result() == "fp32"
    assert gemm_mode() == "tensor"  # this thread untouched
