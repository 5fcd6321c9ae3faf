"""Agent-session KV reuse of the monokernel engine on a real GPU: the cuBLAS prefill from a cached
prefix, turn 2 of a session equals a fresh full-prompt request, other sessions / cancels / the LRU.

Run on the GPU machine:  python -m pytest -q -m gpu tests/test_monokernel_sessions_gpu.py
(deselected in CI by the `gpu` marker; the same logic runs on the CPU in test_monokernel_sessions_cpu.py).

Greedy outputs are compared token for token. The reused KV of turn 1's output was written by the
decode kernel, a fresh request's by the prefill GEMMs: equal to bf16 rounding, not bit for bit, so a
difference is accepted only where the two candidates' logits are within TOL (a near tie).
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

TOL = 2e-2  # as tests/test_monokernel_gpu.py: max |Δ| / max |ref|


def rel(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module", params=["tiny", "llama-3.2-1b"])
def eng(request, tmp_path_factory):
    pytest.importorskip("cupy")
    from replicas.checkpoint import make_checkpoint
    from replicas.monokernel import MonokernelEngine

    path = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param), seed=0, dtype="bf16")
    return MonokernelEngine.from_pretrained(path, max_context=1024)


def words(eng, n, seed):
    return np.random.default_rng(seed).integers(3, eng.config.vocab_size - 64, n).tolist()


def run(eng, prompt, max_tokens=24, session_id=None, **kw):
    from replicas.engine import SamplingParams

    gen = eng.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw), session_id=session_id)
    return list(gen), gen


def assert_same_greedy(eng, prompt, got, want):
    """got == want, or they part at a near tie of the teacher-forced logits (then stop comparing)."""
    if got == want:
        return
    assert len(got) == len(want)
    j = next(i for i in range(len(got)) if got[i] != want[i])
    row = eng.forward_logits(prompt + want[:j])[-1]
    gaps = [(row.max() - row[t]) / np.max(np.abs(row)) for t in (got[j], want[j])]
    assert max(gaps) <= TOL, f"token {j}: {got[j]} vs {want[j]}, below the best logit by {gaps}"


def test_cublas_prefill_from_a_cached_prefix_equals_one_full_prefill(eng):
    from replicas.monokernel_weights import to_f32

    cp, gpu = eng.gpu.cp, eng.gpu
    T = 300
    ids = words(eng, T, 1)

    def host(*arrays):
        gpu.synchronize()  # the prefill runs on the engine's (non-blocking) stream
        return [cp.asnumpy(a) for a in arrays]

    x_full, logits_full = host(*eng.prefill(ids, all_logits=True))
    kv_full = host(gpu.k_cache[:, :, :T], gpu.v_cache[:, :, :T])
    for P in (1, 100, 257, T - 1):
        with cp.cuda.Device(gpu.device), gpu.stream:
            gpu.k_cache[:] = 0
            gpu.v_cache[:] = 0
        eng.prefill(ids[:P])
        x, logits = host(*eng.prefill(ids, all_logits=True, start=P))
        assert logits.shape == (T - P, eng.config.vocab_size)
        assert rel(x, x_full) <= 1e-2 and rel(logits, logits_full[P:]) <= 1e-2, P  # a bug gives ~1
        for got, want in zip(host(gpu.k_cache[:, :, :T], gpu.v_cache[:, :, :T]), kv_full):
            assert rel(to_f32(np, got), to_f32(np, want)) <= 1e-2, P  # a few bf16 roundings differ
    with pytest.raises(ValueError, match="start="):
        eng.prefill(ids, start=T)


def test_turn_two_reuses_the_session_and_equals_a_fresh_request(eng):
    prompt = words(eng, 200, 2)
    before = eng.session_stats()
    out1, gen = run(eng, prompt, session_id="t2")
    assert gen.reused_tokens == 0
    assert_same_greedy(eng, prompt, out1, run(eng, prompt)[0])
    turn2 = prompt + out1 + words(eng, 30, 3)
    out2, gen = run(eng, turn2, session_id="t2")
    assert gen.reused_tokens == len(prompt) + len(out1) - 1  # the last output token was never fed back
    assert_same_greedy(eng, turn2, out2, run(eng, turn2)[0])
    after = eng.session_stats()
    assert (after.hits - before.hits, after.misses - before.misses) == (1, 1)
    assert after.reused_tokens - before.reused_tokens == gen.reused_tokens
    turn3 = turn2 + out2 + words(eng, 10, 4)  # and once more from the KV turn 2 stored
    out3, gen = run(eng, turn3, session_id="t2")
    assert gen.reused_tokens == len(turn2) + len(out2) - 1
    assert_same_greedy(eng, turn3, out3, run(eng, turn3)[0])


def test_a_different_session_does_not_reuse(eng):
    prompt = words(eng, 120, 5)
    run(eng, prompt, session_id="mine")
    before = eng.session_stats()
    out, gen = run(eng, prompt + [7, 8, 9], session_id="theirs")
    assert gen.reused_tokens == 0 and eng.session_stats().misses == before.misses + 1
    assert_same_greedy(eng, prompt + [7, 8, 9], out, run(eng, prompt + [7, 8, 9])[0])


def test_a_stop_keeps_every_emitted_token(eng):
    prompt = words(eng, 64, 6)
    out = run(eng, prompt, max_tokens=32)[0]
    j = next((i for i in range(1, len(out)) if out[i] not in out[:i]), None)
    if j is None:
        pytest.skip("greedy output repeats one token; no fresh stop id to pick")
    got, gen = run(eng, prompt, max_tokens=32, session_id="stop", stop_token_ids=[out[j]])
    assert got == out[:j]
    nxt = prompt + got + words(eng, 5, 7)
    out2, gen = run(eng, nxt, session_id="stop")
    assert gen.reused_tokens == len(prompt) + len(got)  # the kernel fed back every emitted token
    assert_same_greedy(eng, nxt, out2, run(eng, nxt)[0])


def test_cancel_mid_stream_discards_and_the_next_turn_is_a_correct_miss(eng):
    from replicas.engine import FinishReason, SamplingParams

    prompt = words(eng, 150, 8)
    out1 = run(eng, prompt, session_id="cut")[0]
    turn2 = prompt + out1 + words(eng, 20, 9)
    gen = eng.generate(turn2, SamplingParams(max_tokens=400, ignore_eos=True), session_id="cut")
    got = []
    for t in gen:
        got.append(t)
        if len(got) == 3:
            assert gen.reused_tokens > 0
            gen.cancel()
    assert len(got) == 3 and gen.finish_reason is FinishReason.CANCELLED
    assert "cut" not in eng.sessions.resident()
    turn3 = turn2 + got + words(eng, 10, 10)
    out3, gen = run(eng, turn3, session_id="cut")
    assert gen.reused_tokens == 0
    assert_same_greedy(eng, turn3, out3, run(eng, turn3)[0])


def test_the_lru_bound_evicts(eng):
    from replicas.session_cache import SessionCache

    saved, eng.sessions = eng.sessions, SessionCache(max_sessions=1)
    try:
        prompts = {"a": words(eng, 80, 11), "b": words(eng, 80, 12)}
        for _ in range(2):
            for sid, p in prompts.items():
                out, gen = run(eng, p, session_id=sid)
                assert gen.reused_tokens == 0
                assert_same_greedy(eng, p, out, run(eng, p)[0])
                prompts[sid] = p + out
        s = eng.session_stats()
        assert (s.hits, s.misses, s.evictions, s.sessions) == (0, 4, 3, 1)
        assert s.bytes == eng.sessions._entries["b"].nbytes > 0
    finally:
        eng.sessions = saved
