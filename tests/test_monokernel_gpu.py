"""The monokernel engine on a real GPU (H200): correctness against transformers (fp32) and the
numpy reference engine, greedy decoding, seeded sampling, stops, cancel, limits.

Run on the GPU machine:  python -m pytest -q -m gpu tests/test_monokernel_gpu.py
(needs CuPy, torch and transformers; deselected in CI by the `gpu` marker).
Every test runs on the engine's default layout (replicas/layout_tuned.py); MK_TEST_LAYOUT=x_perm=0,split_pos=64
(comma-separated KernelLayout options: NAME turns a boolean on, NAME=N sets an integer or 0/1 a boolean)
runs them on that variant instead (MK_TEST_LAYOUT=fused_mlp=0,fused_attn_o=0,x_perm=0,split_pos=64: the plain kernel).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

TOL = 2e-2  # max |Δ| / max |ref| over all positions and the whole vocabulary
POSITIONS = 288  # 16 through the prefill, 272 through the decode kernel


def _layout_from_env(spec: str) -> dict:
    import inspect

    from replicas.layout import KernelLayout

    plain = {n: v.default for n, v in inspect.signature(KernelLayout.from_config).parameters.items()}
    out: dict = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, eq, val = part.partition("=")
        out[key] = True if not eq else bool(int(val)) if isinstance(plain.get(key), bool) else int(val)
    return out


LAYOUT = _layout_from_env(os.environ.get("MK_TEST_LAYOUT", ""))


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


@pytest.fixture(scope="module", params=["tiny", "qwen3-0.6b", "llama-3.2-1b"])
def model(request, tmp_path_factory):
    pytest.importorskip("cupy")
    from replicas.checkpoint import make_checkpoint
    from replicas.monokernel import MonokernelEngine

    path = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param), seed=0, dtype="bf16")
    engine = MonokernelEngine.from_pretrained(path, max_context=1024, layout_options=LAYOUT)
    assert all(getattr(engine.gpu.layout, k) == v for k, v in LAYOUT.items()), LAYOUT  # the variant really is under test
    return path, engine


def test_teacher_forced_logits_match_transformers_and_reference(model):
    from replicas.reference import ReferenceEngine

    path, eng = model
    ids = np.random.default_rng(1).integers(0, eng.config.vocab_size, POSITIONS).tolist()
    got = eng.forward_logits(ids)
    assert got.shape == (POSITIONS, eng.config.vocab_size) and np.isfinite(got).all()
    assert rel(got, hf_logits(path, ids)) <= TOL
    assert rel(got, ReferenceEngine.from_pretrained(path).forward_logits(ids)) <= TOL


def test_greedy_tokens_follow_the_oracle(model):
    from replicas.engine import FinishReason, SamplingParams

    path, eng = model
    prompt = np.random.default_rng(2).integers(0, eng.config.vocab_size, 32).tolist()
    gen = eng.generate(prompt, SamplingParams(max_tokens=96, ignore_eos=True))
    toks = list(gen)
    assert len(toks) == 96 and gen.finish_reason is FinishReason.LENGTH
    oracle = hf_logits(path, prompt + toks)[len(prompt) - 1:-1]
    top2 = np.sort(oracle, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) / np.max(np.abs(oracle)) > TOL
    assert np.array_equal(np.argmax(oracle, axis=1)[clear], np.array(toks)[clear])


def test_seeded_sampling_reproduces_and_seeds_differ(model):
    from replicas.engine import SamplingParams

    _, eng = model
    prompt = [5, 6, 7, 8]
    for kw in ({"temperature": 1.5}, {"temperature": 0.9, "top_k": 40, "top_p": 0.95}):
        p = SamplingParams(max_tokens=40, seed=1234, ignore_eos=True, **kw)
        a, b = list(eng.generate(prompt, p)), list(eng.generate(prompt, p))
        c = list(eng.generate(prompt, SamplingParams(max_tokens=40, seed=77, ignore_eos=True, **kw)))
        assert a == b and len(a) == 40
        assert a != c


def test_stop_token_ends_without_yielding_it(model):
    from replicas.engine import FinishReason, SamplingParams

    _, eng = model
    prompt = [11, 12, 13]
    toks = list(eng.generate(prompt, SamplingParams(max_tokens=48, ignore_eos=True)))
    j = next((i for i in range(1, len(toks)) if toks[i] not in toks[:i]), None)
    if j is None:
        pytest.skip("greedy output repeats one token; no fresh stop id to pick")
    gen = eng.generate(prompt, SamplingParams(max_tokens=48, stop_token_ids=[toks[j]], ignore_eos=True))
    assert list(gen) == toks[:j]
    assert gen.finish_reason is FinishReason.STOP and gen.stop_token_id == toks[j]


def test_cancel_stops_within_a_step_and_frees_the_engine(model):
    from replicas.engine import EngineBusy, FinishReason, SamplingParams

    _, eng = model
    gen = eng.generate([1, 2, 3], SamplingParams(max_tokens=900, ignore_eos=True))
    with pytest.raises(EngineBusy):
        eng.generate([1], SamplingParams(max_tokens=2))
    got = []
    for t in gen:
        got.append(t)
        if len(got) == 4:
            gen.cancel()
    assert len(got) == 4 and gen.finish_reason is FinishReason.CANCELLED
    assert len(list(eng.generate([1], SamplingParams(max_tokens=3, ignore_eos=True)))) == 3  # engine free again


def test_context_limit_and_bad_input_are_clear(model):
    from replicas.engine import FinishReason, InvalidRequest, SamplingParams

    _, eng = model
    with pytest.raises(InvalidRequest, match="context window"):
        eng.generate(list(range(eng.max_context)), SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        eng.generate([eng.config.vocab_size], SamplingParams(max_tokens=2))
    gen = eng.generate(list(range(1, eng.max_context - 3)), SamplingParams(max_tokens=50, ignore_eos=True))
    assert len(list(gen)) == 4 and gen.finish_reason is FinishReason.LENGTH  # window full
