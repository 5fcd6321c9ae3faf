"""The reference engine against Hugging Face transformers (goldens from scripts/make_goldens.py).

Tolerances. Both sides compute in fp32 on the same fp32 weights; they differ only in the order
of floating-point operations (BLAS blocking, softmax/RMSNorm reductions, RoPE angles computed in
float64 here vs float32 in HF). Over 2 layers that is a few ulp of drift, measured at ~4e-7 of
max|logit|; 1e-4 leaves 250x headroom yet would catch any real mistake (a wrong RoPE frequency,
a missing bias or norm moves logits by >1e-2 relative).
Greedy tokens must equal HF's wherever HF's top-2 margin exceeds 1e-3: with logit errors
~1e-5 absolute at most, only a smaller margin can flip an argmax legitimately; after the first
such flip the two continuations may diverge, so the comparison stops there.
"""

from pathlib import Path

import numpy as np
import pytest

from replicas.engine import SamplingParams
from replicas.model import ModelConfig
from replicas.reference import ReferenceEngine

GOLDENS = Path(__file__).parent / "goldens"
CASES = sorted(p.name for p in GOLDENS.iterdir() if (p / "golden.npz").is_file())
REL_TOL = 1e-4
MARGIN = 1e-3


def test_all_families_have_goldens():
    families = {ModelConfig.from_pretrained(GOLDENS / c).family for c in CASES}
    assert families == {"llama", "mistral", "qwen2", "qwen3"}
    assert any((GOLDENS / c / "model.safetensors.index.json").is_file() for c in CASES)


@pytest.fixture(scope="module", params=CASES)
def case(request):
    path = GOLDENS / request.param
    return ReferenceEngine.from_pretrained(path), np.load(path / "golden.npz")


def test_forward_logits_match_transformers(case):
    engine, golden = case
    ref = golden["logits"]
    ours = engine.forward_logits(golden["logits_ids"].tolist())
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel <= REL_TOL, f"max|Δ|/max|ref| = {rel:.2e} > {REL_TOL}"


def test_greedy_generate_matches_transformers(case):
    engine, golden = case
    prompt, hf = golden["prompt_ids"].tolist(), golden["greedy_ids"].tolist()
    ours = list(engine.generate(prompt, SamplingParams(max_tokens=len(hf), ignore_eos=True)))
    assert len(ours) == len(hf)
    # logits[P-1+i] is the distribution HF picked hf[i] from.
    top2 = np.sort(golden["logits"][len(prompt) - 1:], axis=-1)[:, -2:]
    for i, (a, b) in enumerate(zip(ours, hf)):
        if a != b:
            margin = top2[i, 1] - top2[i, 0]
            assert margin <= MARGIN, f"token {i}: reference {a}, transformers {b} (HF top-2 margin {margin:.4f})"
            break  # a near-tie flipped legitimately; beyond it the sequences may differ


@pytest.mark.parametrize("name", ["llama_gqa_llama3", "llama_linear_v4cfg"])
def test_goldens_would_catch_missing_rope_scaling(name):
    """The scaled-RoPE goldens are sensitive to the scaling: ignoring it misses by far more than REL_TOL."""
    engine = ReferenceEngine.from_pretrained(GOLDENS / name)
    golden = np.load(GOLDENS / name / "golden.npz")
    engine._inv_freq = engine.config.model_copy(update={"rope_scaling": None}).rope_inv_freq()
    rel = np.abs(engine.forward_logits(golden["logits_ids"].tolist()) - golden["logits"]).max()
    assert rel / np.abs(golden["logits"]).max() > 100 * REL_TOL
