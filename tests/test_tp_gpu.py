"""Tensor-parallel monokernel on >= 2 GPUs (H200s): TP=2 against TP=1, the numpy reference and
transformers; greedy and seeded sampling identical to TP=1; stops, cancel. The same tests on ONE
GPU with the ranks emulated side by side (emulate_on_one_gpu: tiny at TP=2 and 4, each rank on
SMs // N blocks): the exchange protocol and the numerics without a second GPU.

Run on the 2-GPU machine:  python -m pytest -q -m gpu tests/test_tp_gpu.py
(needs CuPy, and torch + transformers for the oracle; deselected in CI by the `gpu` marker; with
one GPU only the emulated setups run).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

# The emulation's rank streams must not share one of CUDA's hardware queues (8 by default): two
# ranks' kernels in one queue would run one after the other while the first spins waiting for the
# second. Takes effect as CUDA initializes after this import (pytest collects before running).
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

TOL = 2e-2  # max |Δ| / max |ref|, as tests/test_monokernel_gpu.py
TP_TOL = 1e-2  # TP=2 vs TP=1: same bf16 weights, different fp32 summation order (expect ~1e-4)
POSITIONS = 288  # 16 through the prefill, 272 through the decode kernel
GREEDY_STEPS = 256


def rel(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def hf_logits(path, ids) -> np.ndarray:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        out = model(torch.tensor([ids], device="cuda")).logits[0].float().cpu().numpy()
    del model
    torch.cuda.empty_cache()
    return out


def gpu_count() -> int:
    try:
        import cupy as cp

        return cp.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no CuPy / driver: skip
        return 0


# (preset, N, emulated on GPU 0); tiny's 4 q heads allow N = 2 and 4 (check_tp refuses 8). Each real-GPU setup
# skips where fewer GPUs are visible: on 2 GPUs the N = 8 one (issue 7's) skips.
SETUPS = [("tiny", 2, False), ("llama-3.2-1b", 2, False), ("llama-3.2-1b", 8, False), ("tiny", 2, True),
          ("tiny", 4, True)]


@pytest.fixture(scope="module", params=SETUPS, ids=[f"{p}-tp{n}{'-emulated' if e else ''}" for p, n, e in SETUPS])
def engines(request, tmp_path_factory):
    preset, n, emulate = request.param
    if gpu_count() < (1 if emulate else n):
        pytest.skip(f"needs {'a GPU' if emulate else f'at least {n} GPUs'}")
    from replicas.checkpoint import make_checkpoint
    from replicas.monokernel import MonokernelEngine

    path = make_checkpoint(preset, tmp_path_factory.mktemp(preset), seed=0, dtype="bf16")
    one = MonokernelEngine.from_pretrained(path, devices=[0], max_context=1024)
    two = MonokernelEngine.from_pretrained(path, devices=[0] * n if emulate else list(range(n)), max_context=1024,
                                           emulate_on_one_gpu=emulate)
    return path, one, two


def test_tp2_is_the_tensor_parallel_engine(engines):
    from replicas.monokernel_tp import TpMonokernelEngine

    _, one, two = engines
    n = len(two.devices)
    assert isinstance(two, TpMonokernelEngine) and two.kind == "monokernel" and one.gpu.layout.tp == 1
    assert all(m.layout.tp == n for m in two.gpu.models) and len({m.stream.ptr for m in two.gpu.models}) == n
    if two.gpu.emulated:  # N grids side by side on GPU 0
        assert two.devices == [0] * n and all(m.layout.num_sms == one.gpu.layout.num_sms // n for m in two.gpu.models)
    else:
        assert two.devices == list(range(n)) and two.gpu.layout.num_sms == one.gpu.layout.num_sms


def test_teacher_forced_logits_match_tp1_reference_and_transformers(engines):
    from replicas.reference import ReferenceEngine

    path, one, two = engines
    ids = np.random.default_rng(1).integers(0, two.config.vocab_size, POSITIONS).tolist()
    got = two.forward_logits(ids)
    assert got.shape == (POSITIONS, two.config.vocab_size) and np.isfinite(got).all()
    assert rel(got, one.forward_logits(ids)) <= TP_TOL
    assert rel(got, ReferenceEngine.from_pretrained(path).forward_logits(ids)) <= TOL
    assert rel(got, hf_logits(path, ids)) <= TOL


def test_greedy_tokens_equal_tp1_where_margins_allow(engines):
    from replicas.engine import FinishReason, SamplingParams

    _, one, two = engines
    prompt = np.random.default_rng(2).integers(0, two.config.vocab_size, 32).tolist()
    params = SamplingParams(max_tokens=GREEDY_STEPS, ignore_eos=True)
    gen = two.generate(prompt, params)
    toks = list(gen)
    assert len(toks) == GREEDY_STEPS and gen.finish_reason is FinishReason.LENGTH
    ref = list(one.generate(prompt, params))
    if toks != ref:  # allowed only after a position whose top-2 logits are within tolerance
        first = next(i for i, (a, b) in enumerate(zip(toks, ref)) if a != b)
        logits = one.forward_logits(prompt + ref[:first + 1])[len(prompt) + first - 1]
        top2 = np.sort(logits)[-2:]
        assert (top2[1] - top2[0]) / np.max(np.abs(logits)) <= TP_TOL, f"diverged at step {first} on a clear margin"


def test_seeded_sampling_matches_tp1(engines):
    from replicas.engine import SamplingParams

    _, one, two = engines
    prompt = [5, 6, 7, 8]
    for kw in ({"temperature": 1.5}, {"temperature": 0.9, "top_k": 40, "top_p": 0.95}):
        p = SamplingParams(max_tokens=40, seed=1234, ignore_eos=True, **kw)
        a, b = list(two.generate(prompt, p)), list(two.generate(prompt, p))
        assert a == b and len(a) == 40
        # The same Gumbel noise per (seed, step, global token id) on both: identical tokens
        # (a flip would need two Gumbel keys within ~1e-4 of each other).
        assert a == list(one.generate(prompt, p))


def test_stop_token_and_cancel_stop_every_gpu(engines):
    from replicas.engine import EngineBusy, FinishReason, SamplingParams

    _, _, two = engines
    prompt = [11, 12, 13]
    toks = list(two.generate(prompt, SamplingParams(max_tokens=48, ignore_eos=True)))
    j = next((i for i in range(1, len(toks)) if toks[i] not in toks[:i]), None)
    if j is not None:
        gen = two.generate(prompt, SamplingParams(max_tokens=48, stop_token_ids=[toks[j]], ignore_eos=True))
        assert list(gen) == toks[:j] and gen.finish_reason is FinishReason.STOP
    gen = two.generate([1, 2, 3], SamplingParams(max_tokens=900, ignore_eos=True))
    with pytest.raises(EngineBusy):
        two.generate([1], SamplingParams(max_tokens=2))
    got = []
    for t in gen:
        got.append(t)
        if len(got) == 4:
            gen.cancel()
    assert len(got) == 4 and gen.finish_reason is FinishReason.CANCELLED
    # every GPU left the kernel at the same step: the next generation runs (no hang, no stale flags)
    assert len(list(two.generate([1], SamplingParams(max_tokens=3, ignore_eos=True)))) == 3
