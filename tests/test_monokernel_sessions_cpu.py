"""Agent-session KV reuse of the monokernel engine, on the CPU.

(1) `Prefill.run(ids, start=P)` after a prefill of ids[:P] equals one full prefill (numpy path,
packed tiny weights). (2) The engine's session logic (restore, suffix prefill, which KV rows are
kept, discard on cancel, LRU) on a numpy stand-in for the GPU whose "kernel" decodes greedily
through the same prefill math, one token at a time, writing each fed-back token's K/V as the real
kernel does (csrc/monokernel.cu's step loop). The CUDA side is tests/test_monokernel_sessions_gpu.py.
"""

from __future__ import annotations

import threading
import types
from contextlib import nullcontext

import numpy as np
import pytest

from replicas import layout as L
from replicas.engine import EngineFailed, FinishReason, SamplingParams, accepts_session_id
from replicas.layout import KernelLayout
from replicas.model import ModelConfig
from replicas.monokernel import MonokernelEngine
from replicas.monokernel_prefill import Prefill
from replicas.monokernel_tp import TpMonokernelEngine
from replicas.monokernel_weights import pack_weights, rope_tables, to_f32
from replicas.session_cache import SessionCache
from replicas.weights import load_weights

MAX_CTX = 160
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def packed(tiny_checkpoint):
    cfg = ModelConfig.from_pretrained(tiny_checkpoint)
    lay = KernelLayout.from_config(cfg, max_ctx=MAX_CTX)
    return cfg, pack_weights(np, lay, cfg, load_weights(tiny_checkpoint, cfg, dtype="raw"))


def numpy_model(cfg, weights):
    """What Prefill reads of a GpuModel: config, packed weights, RoPE tables, an empty KV cache."""
    m = types.SimpleNamespace(config=cfg, weights=weights)
    m.rope_cos, m.rope_sin = rope_tables(cfg, MAX_CTX)
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, MAX_CTX, cfg.head_dim)
    m.k_cache, m.v_cache = np.zeros(shape, np.uint16), np.zeros(shape, np.uint16)
    return m


def rel(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def assert_same_bf16(got, want):
    """The same bf16 K/V but for a few values: a GEMM's rows depend (in the last fp32 bits) on how
    many rows it has, so a value near a rounding boundary may round the other way (and nudge later
    layers). A wrong position, mask or cache row changes nearly every value, by far more."""
    assert np.count_nonzero(got != want) <= 2e-3 * got.size, np.count_nonzero(got != want)
    assert rel(to_f32(np, got), to_f32(np, want)) < 2e-3  # ~5e-4 seen


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prefill_from_a_cached_prefix_equals_one_full_prefill(packed, seed):
    cfg, w = packed
    T = 40
    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, T).tolist()
    full = numpy_model(cfg, w)
    x_full, logits_full = Prefill(full, np).run(ids, all_logits=True)
    for P in (1, 7, 16, T - 1):
        inc = numpy_model(cfg, w)
        pf = Prefill(inc, np)
        pf.run(ids[:P])
        x, logits = pf.run(ids, all_logits=True, start=P)
        assert rel(x, x_full) < 1e-4, P  # ~1e-5 seen: fp32 row noise + the odd one-ulp bf16 K/V flip
        assert logits.shape == (T - P, cfg.vocab_size)  # the new rows only
        assert rel(logits, logits_full[P:]) < 1e-4, P
        for got, want in ((inc.k_cache, full.k_cache), (inc.v_cache, full.v_cache)):
            assert_same_bf16(got[:, :, :T], want[:, :, :T])
            assert not got[:, :, T:].any()


def test_bad_start_is_refused_clearly(packed):
    cfg, w = packed
    pf = Prefill(numpy_model(cfg, w), np)
    for bad in (-1, 5, 6, 1.5, True):
        with pytest.raises(ValueError, match="start="):
            pf.run([1, 2, 3, 4, 5], start=bad)


# ---- the engine's session logic on a numpy stand-in GPU -----------------------------------------

class FakeGpu:
    """Quacks like GpuModel where MonokernelEngine uses it; launch() decodes synchronously."""

    def __init__(self, cfg, weights):
        self.__dict__.update(vars(numpy_model(cfg, weights)))
        self.cp = types.SimpleNamespace(cuda=types.SimpleNamespace(
            Device=lambda d: nullcontext(), memory=types.SimpleNamespace(OutOfMemoryError=MemoryError)))
        self.device, self.stream, self.max_context = 0, nullcontext(), MAX_CTX
        self.host_ctrl = types.SimpleNamespace(array=np.zeros(L.CTRL_WORDS, np.int32))
        self.host_tokens = types.SimpleNamespace(array=np.zeros(MAX_CTX, np.int32))
        self.pf = Prefill(self, np)
        self.launches = []

    def launch(self, x_last, start_pos, max_steps, *, stop_ids=(), **_):
        self.launches.append(start_pos)
        ctrl, toks, pf, c = self.host_ctrl.array, self.host_tokens.array, self.pf, self.config
        ctrl[:] = 0
        x, step = x_last, 0
        while True:  # the kernel's step loop: sample, emit, stop checks, then feed the token back
            logits = pf._linear(pf._rms(x[None], self.weights["lnf"]), self.weights["w_lm"], c.hidden_size)
            tok = int(np.argmax(logits[0, :c.vocab_size]))
            last = step + 1 >= max_steps or start_pos + step + 1 >= MAX_CTX
            status = L.STATUS_STOP if tok in stop_ids else L.STATUS_LENGTH if last else 0
            if status != L.STATUS_STOP:
                toks[step], ctrl[L.CTRL_COUNT] = tok, step + 1
            if status:
                ctrl[L.CTRL_STOP_TOKEN], ctrl[L.CTRL_STATUS], ctrl[L.CTRL_DONE] = tok, status, 1
                return
            pos = start_pos + step
            x, _ = pf.run([0] * pos + [tok], start=pos)  # K/V of `tok` at row pos
            step += 1

    def synchronize(self):
        pass

    def check(self):  # (launch() finished the whole decode: nothing can die meanwhile)
        pass


def fake_engine(packed, **limits) -> MonokernelEngine:
    cfg, w = packed
    eng = MonokernelEngine.__new__(MonokernelEngine)
    eng.config, eng.gpu, eng.devices, eng.profile = cfg, FakeGpu(cfg, w), [0], None
    eng.max_context, eng._prefill, eng._busy = MAX_CTX, eng.gpu.pf, threading.Lock()
    eng.sessions = SessionCache(**limits)
    return eng


def words(n, seed):
    return np.random.default_rng(seed).integers(3, 2000, n).tolist()


def run(eng, prompt, params=GREEDY, session_id=None):
    gen = eng.generate(prompt, params, session_id=session_id)
    return list(gen), gen


def test_engines_tell_the_truth_about_sessions():
    assert accepts_session_id(MonokernelEngine.__new__(MonokernelEngine))
    tp = TpMonokernelEngine.__new__(TpMonokernelEngine)
    assert not accepts_session_id(tp) and getattr(tp, "session_stats", None) is None


def test_turn_two_prefills_only_the_suffix_and_equals_a_fresh_request(packed):
    eng, fresh = fake_engine(packed), fake_engine(packed)
    prompt = words(50, 1)
    out1, gen = run(eng, prompt, session_id="a")
    assert gen.reused_tokens == 0 and out1 == run(fresh, prompt)[0]
    entry = eng.sessions._entries["a"]
    n = len(prompt) + len(out1) - 1  # the last emitted token is never fed back
    assert entry.kv.k.shape == (4, 2, n, 32) and entry.tokens.tolist() == (prompt + out1)[:n]
    assert np.array_equal(entry.kv.k, eng.gpu.k_cache[:, :, :n]) and entry.nbytes == 2 * entry.kv.k.nbytes
    turn2 = prompt + out1 + words(9, 2)
    eng.gpu.k_cache[:] = 0  # another generation may have overwritten the engine's cache meanwhile
    eng.gpu.v_cache[:] = 0
    out2, gen = run(eng, turn2, session_id="a")
    assert gen.reused_tokens == n and out2 == run(fresh, turn2)[0]
    assert eng.gpu.launches[-1] == len(turn2)
    s = eng.session_stats()
    assert (s.hits, s.misses, s.reused_tokens, s.sessions) == (1, 1, n, 1)
    other, gen = run(eng, turn2, session_id="b")  # another session does not reuse
    assert gen.reused_tokens == 0 and other == out2


def test_a_stop_keeps_every_emitted_token(packed):
    eng = fake_engine(packed)
    prompt = words(30, 3)
    out = run(eng, prompt)[0]
    j = next(i for i in range(1, len(out)) if out[i] not in out[:i])
    got, gen = run(eng, prompt, SamplingParams(max_tokens=12, stop_token_ids=[out[j]], ignore_eos=True), "s")
    assert got == out[:j] and gen.finish_reason is FinishReason.STOP
    assert eng.sessions._entries["s"].tokens.tolist() == prompt + got  # all were fed back
    nxt = prompt + got + words(5, 4)
    assert run(eng, nxt, session_id="s")[1].reused_tokens == len(prompt) + len(got)


def test_cancel_discards_and_the_next_turn_is_a_correct_miss(packed):
    eng, fresh = fake_engine(packed), fake_engine(packed)
    prompt = words(40, 5)
    out1 = run(eng, prompt, session_id="c")[0]
    turn2 = prompt + out1 + words(6, 6)
    gen = eng.generate(turn2, GREEDY, session_id="c")
    assert gen.reused_tokens == 0  # not started yet
    next(gen)
    assert gen.reused_tokens > 0
    gen.cancel()
    assert list(gen) == [] and gen.finish_reason is FinishReason.CANCELLED
    assert "c" not in eng.sessions.resident()
    turn3 = turn2 + words(4, 7)
    out3, gen = run(eng, turn3, session_id="c")
    assert gen.reused_tokens == 0 and out3 == run(fresh, turn3)[0]
    closed = eng.generate(turn3 + out3, GREEDY, session_id="c")
    next(closed)
    closed.close()  # the client went away: which rows are valid is not known, drop the entry
    assert eng.session_stats().sessions == 0


def test_lru_bound_evicts_and_zero_sessions_keeps_nothing(packed):
    eng, fresh = fake_engine(packed, max_sessions=1), fake_engine(packed)
    prompts = {"a": words(30, 8), "b": words(30, 9)}
    for _ in range(2):
        for sid, p in prompts.items():
            out, gen = run(eng, p, session_id=sid)
            assert gen.reused_tokens == 0 and out == run(fresh, p)[0]
            prompts[sid] = p + out
    s = eng.session_stats()
    assert (s.hits, s.misses, s.evictions, s.sessions) == (0, 4, 3, 1)
    off = fake_engine(packed, max_sessions=0)
    run(off, prompts["a"], session_id="a")
    assert off.session_stats().sessions == 0


# ---- a kernel that dies: the generation raises EngineFailed instead of waiting forever ----------------

class DyingGpu(FakeGpu):
    """launch() emits `emit` tokens, then the kernel is gone: its done word never comes (a fault), or it comes
    with STATUS_PEER_TIMEOUT (a tensor-parallel rank that lost its peer and trapped)."""

    def __init__(self, cfg, weights, emit: int, peer_timeout: bool):
        super().__init__(cfg, weights)
        self.emit, self.peer_timeout, self.checks, self.syncs = emit, peer_timeout, 0, 0

    def launch(self, x_last, start_pos, max_steps, **_):
        ctrl, toks = self.host_ctrl.array, self.host_tokens.array
        ctrl[:] = 0
        toks[:self.emit] = np.arange(3, 3 + self.emit)
        ctrl[L.CTRL_COUNT] = self.emit
        if self.peer_timeout:
            ctrl[L.CTRL_STATUS], ctrl[L.CTRL_DONE] = L.STATUS_PEER_TIMEOUT, 1

    def check(self):
        self.checks += 1
        if not self.peer_timeout:
            raise EngineFailed("the monokernel on GPU 0 failed (cudaErrorLaunchFailure); restart the replica")

    def synchronize(self):  # (a trapped kernel's stream: waiting on it raises, so the engine must not)
        self.syncs += 1
        raise AssertionError("synchronize() on a dead kernel")


@pytest.mark.parametrize("peer_timeout", [False, True], ids=["fault", "peer-timeout"])
def test_a_dead_kernel_fails_the_generation_and_every_later_one(packed, peer_timeout, monkeypatch):
    import replicas.monokernel as mk

    monkeypatch.setattr(mk, "CHECK_SECONDS", 0.0)
    eng = fake_engine(packed)
    cfg, w = packed
    eng.gpu = DyingGpu(cfg, w, emit=3, peer_timeout=peer_timeout)
    gen = eng.generate(words(12, 5), GREEDY)
    got = []
    with pytest.raises(EngineFailed, match="restart the replica"):
        for tok in gen:
            got.append(tok)
    assert got == [3, 4, 5]  # what the kernel emitted before it died still reached the caller
    assert eng.gpu.syncs == 0 and (eng.gpu.checks >= 1) is not peer_timeout
    with pytest.raises(EngineFailed, match="restart the replica"):  # the engine refuses at once from now on
        eng.generate(words(12, 6), GREEDY)


def test_gpu_check_tells_a_fault_and_an_unfinished_end_from_a_running_kernel():
    from replicas.monokernel_gpu import GpuModel

    class CudaError(Exception):
        pass

    class Stream:
        def __init__(self, state):
            self.state = state

        @property
        def done(self):  # CuPy's Stream.done: cudaStreamQuery, which raises a fault's sticky error
            if self.state == "fault":
                raise CudaError("cudaErrorLaunchFailure: unspecified launch failure")
            return self.state == "ended"

    m = GpuModel.__new__(GpuModel)
    m.cp = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(CUDARuntimeError=CudaError)))
    m.device, m.host_ctrl = 1, types.SimpleNamespace(array=np.zeros(L.CTRL_WORDS, np.int32))
    m.stream = Stream("running")
    m.check()
    m.stream = Stream("fault")
    with pytest.raises(EngineFailed, match="GPU 1 failed .*cudaErrorLaunchFailure.*restart the replica"):
        m.check()
    m.stream = Stream("ended")
    with pytest.raises(EngineFailed, match="GPU 1 ended without finishing its launch"):
        m.check()
    m.host_ctrl.array[L.CTRL_DONE] = 1  # ended after writing its done word: a normal end
    m.check()


def test_the_peer_timeout_comes_from_the_environment_or_the_default(monkeypatch):
    from replicas.monokernel_tp import PEER_TIMEOUT_S, peer_timeout_s

    monkeypatch.delenv("MK_TP_PEER_TIMEOUT_S", raising=False)
    assert peer_timeout_s() == PEER_TIMEOUT_S == 10.0
    monkeypatch.setenv("MK_TP_PEER_TIMEOUT_S", "2.5")
    assert peer_timeout_s() == 2.5
    for bad in ("0", "-1", "soon", "nan"):
        monkeypatch.setenv("MK_TP_PEER_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="MK_TP_PEER_TIMEOUT_S=.*positive number of seconds"):
            peer_timeout_s()
