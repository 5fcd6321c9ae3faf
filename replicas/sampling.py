"""Choosing the next token from logits on the host (numpy): greedy, temperature, top-k, top-p.

`sample` is the reference semantics every engine's sampler is compared against:
- greedy (temperature 0 or top_k 1): argmax, ties broken towards the lowest token id;
- otherwise logits / temperature, keep the top_k most likely (0 = all), then the smallest
  prefix (most likely first) whose probability mass reaches top_p (always at least one token),
  renormalise, and draw once from a seeded counter-based generator (Philox), so the same seed
  reproduces the same sequence of tokens.
"""

from __future__ import annotations

import numpy as np

from replicas.engine import SamplingParams


def make_rng(seed: int | None) -> np.random.Generator:
    """A Philox generator: `seed` reproduces the draws; None takes fresh OS entropy."""
    return np.random.Generator(np.random.Philox(seed))


def _top_ids(scaled: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest values, largest first, equal values by lowest id."""
    if k >= scaled.size:
        return np.argsort(-scaled, kind="stable")  # stable => equal logits keep id order
    kth = scaled[np.argpartition(-scaled, k - 1)[k - 1]]  # O(vocab): the k-th largest value
    # argpartition breaks ties at the boundary arbitrarily: take every id above the k-th value,
    # then the lowest ids equal to it, so ties go to the lowest id as everywhere else.
    above = np.flatnonzero(scaled > kth)
    part = np.concatenate([above, np.flatnonzero(scaled == kth)[:k - above.size]])
    return part[np.lexsort((part, -scaled[part]))]


def candidate_probs(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and their renormalised probabilities after temperature, top-k and top-p.

    Both 1-D, equal length >= 1. With a top-k or top-p limit the ids come most likely first;
    without any limit they are the whole vocabulary in id order (no sort needed to draw).
    """
    scaled = np.asarray(logits, dtype=np.float64) / params.temperature  # float64: exp() stays exact enough
    vocab = scaled.size
    if 0 < params.top_k < vocab:
        ids = _top_ids(scaled, params.top_k)
        probs = np.exp(scaled[ids] - scaled[ids[0]])
        probs /= probs.sum()
    else:
        weights = np.exp(scaled - scaled.max())  # unnormalised softmax over the whole vocabulary
        total = weights.sum()
        if params.top_p == 1.0:
            return np.arange(vocab), weights / total
        # Nucleus without top-k: the mass usually sits in a few tokens, so widen a partial
        # top-k until it holds top_p of the mass instead of sorting the whole vocabulary.
        width = 64
        while width < vocab and weights[_top_ids(scaled, width)].sum() < params.top_p * total:
            width *= 8
        ids = _top_ids(scaled, width)
        probs = weights[ids] / total
    if params.top_p < 1.0:
        cum = np.cumsum(probs)
        # Smallest prefix with mass >= top_p; searchsorted gives its last index. The clamp keeps
        # at least one token and guards rounding when top_p is ~1.
        keep = min(int(np.searchsorted(cum, params.top_p, side="left")) + 1, ids.size)
        ids, probs = ids[:keep], probs[:keep] / cum[keep - 1]
    return ids, probs


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Pick one token id from `logits` [vocab] (float32) according to `params`."""
    if params.greedy:
        return int(np.argmax(logits))  # argmax returns the first (lowest) id among ties
    ids, probs = candidate_probs(logits, params)
    if ids.size == 1:
        rng.random()  # still consume one draw so the stream stays aligned across steps
        return int(ids[0])
    # Inverse CDF with one uniform draw per token: cheap and reproducible for a given seed.
    u = rng.random()
    idx = int(np.searchsorted(np.cumsum(probs), u, side="right"))
    return int(ids[min(idx, ids.size - 1)])
