"""The host sampler (replicas.sampling): greedy, temperature, top-k, top-p, seeding."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replicas.engine import SamplingParams
from replicas.sampling import candidate_probs, make_rng, sample


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


LOGITS = np.log(np.array([0.05, 0.5, 0.15, 0.3, 1e-4], dtype=np.float32))  # ids by prob: 1, 3, 2, 0, 4


def test_greedy_is_argmax_with_ties_to_lowest_id():
    logits = np.array([0.0, 3.0, 1.0, 3.0], dtype=np.float32)
    assert sample(logits, SamplingParams(), make_rng(0)) == 1
    # temperature > 0 with top_k=1 is greedy too
    assert sample(logits, SamplingParams(temperature=1.0, top_k=1), make_rng(0)) == 1


def test_tiny_top_p_is_greedy():
    rng = make_rng(5)
    params = SamplingParams(temperature=1.0, top_p=1e-6)
    assert {sample(LOGITS, params, rng) for _ in range(200)} == {1}


def test_top_k_keeps_the_k_most_likely():
    rng = make_rng(1)
    params = SamplingParams(temperature=5.0, top_k=3)  # hot, so all three are drawn often
    assert {sample(LOGITS, params, rng) for _ in range(500)} == {1, 3, 2}


@pytest.mark.parametrize("top_p, support", [(0.45, [1]), (0.75, [1, 3]), (0.9, [1, 3, 2]), (0.99, [1, 3, 2, 0])])
def test_top_p_keeps_smallest_prefix_reaching_the_mass(top_p, support):
    ids, probs = candidate_probs(LOGITS, SamplingParams(temperature=1.0, top_p=top_p))
    assert ids.tolist() == support
    assert probs.sum() == pytest.approx(1.0)
    full = softmax(LOGITS.astype(np.float64))
    np.testing.assert_allclose(probs, full[support] / full[support].sum(), rtol=1e-9)


def test_empirical_frequencies_match_softmax():
    """20k draws: every frequency within 5 standard errors of softmax(logits / T) (seeded, so stable)."""
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, 1.5, -3.0, 0.2], dtype=np.float32)
    params = SamplingParams(temperature=0.7)
    rng, n = make_rng(42), 20_000
    counts = np.bincount([sample(logits, params, rng) for _ in range(n)], minlength=logits.size)
    p = softmax(logits.astype(np.float64) / 0.7)
    stderr = np.sqrt(p * (1 - p) / n)
    assert np.all(np.abs(counts / n - p) <= 5 * stderr + 1e-12), (counts / n, p)


def test_top_k_and_top_p_frequencies_are_renormalised():
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.9)  # top-3 mass 0.95 -> top_p trims to 1,3,2
    rng, n = make_rng(7), 20_000
    counts = np.bincount([sample(LOGITS, params, rng) for _ in range(n)], minlength=LOGITS.size)
    p = np.zeros(LOGITS.size)
    p[[1, 3, 2]] = np.array([0.5, 0.3, 0.15]) / 0.95
    stderr = np.sqrt(p * (1 - p) / n)
    assert np.all(np.abs(counts / n - p) <= 5 * stderr + 1e-12), (counts / n, p)


def test_same_seed_same_draws_and_different_seeds_differ():
    params = SamplingParams(temperature=1.0)
    logits = np.zeros(1000, dtype=np.float32)  # uniform: 50 draws identical by chance is impossible

    def draws(seed):
        rng = make_rng(seed)
        return [sample(logits, params, rng) for _ in range(50)]

    assert draws(3) == draws(3)
    assert draws(3) != draws(4)
    fresh = [sample(logits, params, make_rng(None)) for _ in range(20)]
    assert len(set(fresh)) > 1  # seed None takes fresh entropy each time


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-20, 20, allow_nan=False), min_size=1, max_size=40),
       st.floats(0.05, 3.0), st.integers(0, 50), st.floats(0.01, 1.0), st.integers(0, 2**32))
def test_sample_is_always_a_candidate(values, temperature, top_k, top_p, seed):
    logits = np.array(values, dtype=np.float32)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    ids, probs = candidate_probs(logits, params)
    assert 1 <= ids.size <= (top_k or logits.size)
    assert probs.sum() == pytest.approx(1.0)
    assert int(np.argmax(logits)) in set(ids.tolist())  # the most likely token always survives
    if 0 < top_k < logits.size or top_p < 1.0:
        assert np.all(np.diff(probs) <= 1e-12)  # limited candidates come most likely first
    assert sample(logits, params, make_rng(seed)) in set(ids.tolist())


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.999])
def test_nucleus_on_a_large_vocab_equals_the_full_sort(top_p):
    """The widening partial top-k must find exactly the nucleus a full sort finds."""
    logits = (make_rng(9).standard_normal(50_000) * 2).astype(np.float32)
    ids, probs = candidate_probs(logits, SamplingParams(temperature=0.8, top_p=top_p))
    p = softmax(logits.astype(np.float64) / 0.8)
    order = np.argsort(-p, kind="stable")
    keep = int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1
    assert ids.tolist() == order[:keep].tolist()
    np.testing.assert_allclose(probs, p[order[:keep]] / p[order[:keep]].sum(), rtol=1e-9)


def test_top_k_ties_at_the_boundary_go_to_the_lowest_ids():
    logits = np.array([0] * 8 + [1, 1, 1], dtype=np.float32)
    for k in (1, 2):
        ids, _ = candidate_probs(logits, SamplingParams(temperature=1.0, top_k=k))
        assert ids.tolist() == [8, 9][:k]
