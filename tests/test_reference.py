"""The numpy reference engine's behaviour: decode consistency, stops, limits, cancel, concurrency."""

import threading
from pathlib import Path

import numpy as np
import pytest

from replicas import reference
from replicas.engine import Engine, FinishReason, InvalidRequest, SamplingParams
from replicas.reference import EngineBusy, KVCache, ReferenceEngine
from replicas.weights import load_weights

# A golden checkpoint: 2 layers, GQA, llama3 RoPE, max_position_embeddings 128 (small, so the
# context-window cases are cheap to reach).
SMALL = Path(__file__).parent / "goldens" / "llama_gqa_llama3"
PROMPT = [17, 200, 3, 45, 99, 128, 7, 64, 250, 11]


@pytest.fixture(scope="module")
def engine():
    return ReferenceEngine.from_pretrained(SMALL, max_batch=2)


def greedy(engine, prompt=PROMPT, **kw):
    gen = engine.generate(prompt, SamplingParams(**{"max_tokens": 24, "ignore_eos": True, **kw}))
    return list(gen), gen


def test_implements_engine_protocol(engine):
    assert isinstance(engine, Engine)
    assert (engine.kind, engine.max_batch, engine.max_context) == ("reference", 2, 128)


def test_greedy_generate_is_argmax_of_forward_logits_step_by_step(engine):
    tokens, gen = greedy(engine)
    assert len(tokens) == 24 and gen.finish_reason is FinishReason.LENGTH
    logits = engine.forward_logits(PROMPT + tokens[:-1])
    assert np.argmax(logits[len(PROMPT) - 1:], axis=-1).tolist() == tokens


def test_greedy_on_tiny_preset_is_argmax_of_forward_logits(tiny_checkpoint):
    engine = ReferenceEngine.from_pretrained(tiny_checkpoint)
    prompt = [5, 6, 7, 8, 9]
    gen = engine.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    tokens = list(gen)
    assert len(tokens) == 12
    logits = engine.forward_logits(prompt + tokens[:-1])
    assert np.argmax(logits[len(prompt) - 1:], axis=-1).tolist() == tokens


def test_incremental_decode_equals_teacher_forced_logits(engine):
    ids = PROMPT + [5, 80, 123, 9, 31, 77]
    full = engine.forward_logits(ids)
    cache = KVCache(engine.config, len(ids))
    steps = [engine._prefill(ids[:len(PROMPT)], cache, all_logits=False)[0]]
    steps += [engine._forward([t], cache, all_logits=False)[0] for t in ids[len(PROMPT):]]
    np.testing.assert_allclose(np.stack(steps), full[len(PROMPT) - 1:], rtol=0, atol=1e-5 * np.abs(full).max())


def test_chunked_prefill_equals_one_pass(engine, monkeypatch):
    ids = list(range(3, 43))
    one_pass = engine.forward_logits(ids)
    monkeypatch.setattr(reference, "PREFILL_CHUNK", 7)
    np.testing.assert_allclose(engine.forward_logits(ids), one_pass, rtol=0, atol=1e-5 * np.abs(one_pass).max())


def test_kv_cache_growth_keeps_decode_exact(engine, monkeypatch):
    expected, _ = greedy(engine, max_tokens=40)
    monkeypatch.setattr(reference, "KV_FIRST_ROWS", 3)  # forces several doublings mid-decode
    assert greedy(engine, max_tokens=40)[0] == expected


def test_seeded_sampling_reproduces_and_seeds_differ(engine):
    def run(seed):
        return greedy(engine, temperature=1.5, top_p=0.95, seed=seed)[0]

    assert run(11) == run(11)
    assert run(11) != run(12)
    assert run(11) != greedy(engine)[0]


def test_stop_token_ids_end_generation_and_are_not_yielded(engine):
    full, _ = greedy(engine)
    stop = full[5]
    tokens, gen = greedy(engine, stop_token_ids=[stop])
    assert tokens == full[:full.index(stop)]
    assert (gen.finish_reason, gen.stop_token_id) == (FinishReason.STOP, stop)


def test_eos_stops_unless_ignored():
    config = ReferenceEngine.from_pretrained(SMALL).config
    probe = ReferenceEngine(config, load_weights(SMALL, config), max_batch=1)
    full, _ = greedy(probe)
    eos = full[4]
    engine = ReferenceEngine(config.model_copy(update={"eos_token_ids": (eos,)}), load_weights(SMALL, config))
    tokens, gen = greedy(engine, ignore_eos=False)
    assert tokens == full[:full.index(eos)]
    assert (gen.finish_reason, gen.stop_token_id) == (FinishReason.STOP, eos)
    assert greedy(engine, ignore_eos=True)[0] == full


def test_max_tokens(engine):
    tokens, gen = greedy(engine, max_tokens=3)
    assert len(tokens) == 3 and gen.finish_reason is FinishReason.LENGTH and gen.stop_token_id is None


def test_context_window_limits(engine):
    with pytest.raises(InvalidRequest, match="128 tokens but the context window is 128"):
        engine.generate([5] * 128, SamplingParams())
    # 120 prompt tokens leave room for 8 generated ones: the sequence ends full, reason LENGTH.
    tokens, gen = greedy(engine, prompt=[5] * 120, max_tokens=50)
    assert len(tokens) == 8 and gen.finish_reason is FinishReason.LENGTH
    with pytest.raises(InvalidRequest, match="129 tokens exceed the context window of 128"):
        engine.forward_logits([5] * 129)


def test_cancel_from_another_thread_stops_within_one_step(engine):
    gen = engine.generate(PROMPT, SamplingParams(max_tokens=100, ignore_eos=True))
    first = [next(gen) for _ in range(3)]
    canceller = threading.Thread(target=gen.cancel)
    canceller.start()
    canceller.join()
    assert len(list(gen)) <= 1  # at most the step already in flight
    assert gen.finish_reason is FinishReason.CANCELLED and len(first) == 3


def test_cancel_before_start_and_between_prefill_chunks(engine, monkeypatch):
    gen = engine.generate(PROMPT, SamplingParams())
    gen.cancel()
    assert list(gen) == [] and gen.finish_reason is FinishReason.CANCELLED

    monkeypatch.setattr(reference, "PREFILL_CHUNK", 4)
    gen = engine.generate(list(range(3, 43)), SamplingParams())  # 10 prefill chunks
    chunks = []
    real_forward = engine._forward

    def forward_then_cancel(ids, cache, all_logits):
        chunks.append(len(ids))
        gen.cancel()  # as if the client went away during the first chunk
        return real_forward(ids, cache, all_logits)

    monkeypatch.setattr(engine, "_forward", forward_then_cancel)
    assert list(gen) == [] and gen.finish_reason is FinishReason.CANCELLED
    assert chunks == [4]  # the rest of the prompt was never computed


def test_cancel_while_consumer_is_streaming(engine):
    seen, started, resume = [], threading.Event(), threading.Event()

    def consume(gen):
        for t in gen:
            seen.append(t)
            started.set()
            resume.wait(10)  # hold the consumer so the cancel lands mid-stream even on a loaded machine

    gen = engine.generate(PROMPT, SamplingParams(max_tokens=110, ignore_eos=True))
    worker = threading.Thread(target=consume, args=(gen,))
    worker.start()
    assert started.wait(10)
    gen.cancel()
    resume.set()
    worker.join(10)
    assert not worker.is_alive()
    assert gen.finish_reason is FinishReason.CANCELLED
    assert len(seen) <= 2, f"{len(seen)} tokens after cancel: the engine must stop within one step"


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"bogus": 1}, "bogus"),
])
def test_bad_sampling_params_are_invalid_requests(kwargs, message):
    with pytest.raises(InvalidRequest, match=message):
        SamplingParams.parse(**kwargs)


@pytest.mark.parametrize("prompt, params, message", [
    ([], SamplingParams(), "prompt is empty"),
    ([1, 256], SamplingParams(), "token id 256 outside the vocabulary"),
    ([1, 2], SamplingParams(stop_token_ids=[999]), "stop token id 999"),
    ([1, 2], {"max_tokens": 4}, "params must be SamplingParams"),
])
def test_bad_requests_raise_before_any_token(engine, prompt, params, message):
    with pytest.raises(InvalidRequest, match=message):
        engine.generate(prompt, params)


def test_concurrent_generations_match_solo_runs(engine):
    jobs = [(PROMPT, SamplingParams(max_tokens=30, ignore_eos=True)),
            (PROMPT[::-1], SamplingParams(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True))]
    solo = [list(engine.generate(p, s)) for p, s in jobs]
    results = [None, None]
    barrier = threading.Barrier(2)

    def run(i):
        gen = engine.generate(*jobs[i])
        barrier.wait()
        results[i] = list(gen)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == solo


def test_slots_beyond_max_batch_are_refused_and_freed():
    engine = ReferenceEngine.from_pretrained(SMALL, max_batch=1)
    first = engine.generate(PROMPT, SamplingParams(max_tokens=5))
    with pytest.raises(EngineBusy, match="all 1 generation slots"):
        engine.generate(PROMPT, SamplingParams())
    first.close()  # closed before it ever started: its slot is still returned
    second = engine.generate(PROMPT, SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(list(second)) == 2  # ran to the end: slot free again
    third = engine.generate(PROMPT, SamplingParams(max_tokens=50))
    next(third)
    third.close()  # closed mid-stream
    assert third.finish_reason is FinishReason.CANCELLED
    engine.generate(PROMPT, SamplingParams(max_tokens=1)).close()
