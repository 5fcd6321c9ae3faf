"""EngineGroup: a replica's per-GPU-group engines served as one engine (CPU, paced engines)."""

import threading

import pytest

from replicas.actor import engines_per_gpu_group
from replicas.engine import EngineBusy, FinishReason, SamplingParams, accepts_session_id
from replicas.engine_group import EngineGroup
from replicas.testing import PacedEngine


def group(n=2, **kw):
    return EngineGroup([PacedEngine(tokens_per_s=2000, **kw) for _ in range(n)])


def test_slots_add_up_and_generations_spread_over_members():
    g = group(2)
    assert g.max_batch == 2 and g.kind == "paced" and accepts_session_id(g)
    a = g.generate([1, 2], SamplingParams(max_tokens=3))
    b = g.generate([1, 2], SamplingParams(max_tokens=3))
    assert g._active == [1, 1]
    with pytest.raises(EngineBusy, match="all 2 generation slots"):
        g.generate([1], SamplingParams(max_tokens=1))
    assert list(a) == list(PacedEngine(tokens_per_s=2000).generate([1, 2], SamplingParams(max_tokens=3)))
    assert a.finish_reason is FinishReason.LENGTH
    assert g._active == [0, 1]  # finishing frees the member's slot
    b.close()  # closed without being iterated: freed too
    assert g._active == [0, 0]


def test_cancel_reaches_the_member_engine():
    g = group(1, max_batch=1)
    gen = g.generate([5], SamplingParams(max_tokens=10_000, ignore_eos=True))
    tokens = []
    t = threading.Thread(target=lambda: tokens.extend(gen))
    t.start()
    while not tokens:
        pass
    gen.cancel()
    t.join(timeout=5)
    assert not t.is_alive() and gen.finish_reason is FinishReason.CANCELLED
    assert g._active == [0]


def test_session_prefers_the_member_that_served_it():
    g = group(3)
    held = g.generate([1], SamplingParams(max_tokens=1))  # member 0 busy
    list(g.generate([1], SamplingParams(max_tokens=1), session_id="s"))  # -> member 1
    held.close()
    assert g._sessions["s"] == 1 and g._active == [0, 0, 0]
    again = g.generate([1, 9], SamplingParams(max_tokens=1), session_id="s")  # all idle: sticky wins
    assert g._active == [0, 1, 0]
    again.close()


def test_one_engine_per_tensor_parallel_group():
    loaded = []

    def load(devices):
        loaded.append(devices)
        return PacedEngine(tokens_per_s=1000)

    engine = engines_per_gpu_group(load, list(range(8)), 8)
    assert isinstance(engine, PacedEngine) and loaded == [list(range(8))]
    loaded.clear()
    engine = engines_per_gpu_group(load, list(range(8)), 2)
    assert isinstance(engine, EngineGroup) and engine.max_batch == 4
    assert sorted(loaded) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the 8 GPUs"):
        engines_per_gpu_group(load, list(range(8)), 3)
