"""The batched engine's scheduler on the CPU: `BatchedMonokernelEngine` (replicas/monokernel_batched.py)
with real threads on a numpy stand-in GPU whose "kernel" thread keeps the real kernel's host protocol
(csrc/monokernel.cu's step loop: per-slot CTRL words, cancel, stops, budget, yield at a step boundary)
and emits token n of a slot as a hash of the KV rows in that slot's cache before it (the prefill writes
a row per prompt token, derived from the token and its position; the kernel writes one per token it
feeds back, not for the one that ends the generation): any lost, repeated or misplaced token, a wrong
resume position, a prompt in the wrong slot or a wrong KV row (e.g. an agent session's restored prefix,
tests/test_monokernel_batched_sessions_cpu.py) changes a request's output. Batch layouts and builds:
tests/test_monokernel_batch_layout_cpu.py; the CUDA side: tests/test_monokernel_batch_gpu.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
import types
from contextlib import nullcontext

import numpy as np
import pytest

from replicas import layout as L
from replicas.checkpoint import preset_config
from replicas.engine import EngineBusy, FinishReason, InvalidRequest, SamplingParams
from replicas.monokernel import sampling_mode
from replicas.monokernel_batched import BatchedMonokernelEngine

CFG = preset_config("tiny")
MAX_CTX = 512
STEP_S = 5e-4  # one decode step of the stand-in kernel
FX_PER_STEP = 4  # fused-MLP turns per step (one per layer): what exit_state() reports


KV_SHAPE = (2, 1, MAX_CTX, 2)  # one slot's stand-in KV cache, [L][kv_heads][max_ctx][D] uint16


def kv_rows(ids, start: int = 0):
    """The stand-in model's K and V rows [L][kv_heads][len(ids)][D] of tokens `ids` at positions start.."""
    t = np.asarray(ids, np.int64)[None, None, :, None]
    p = np.arange(start, start + len(ids))[None, None, :, None]
    lhd = np.arange(KV_SHAPE[0])[:, None, None, None] * 7 + np.arange(KV_SHAPE[3])[None, None, None, :] * 3
    return (t * 7919 + p * 31 + lhd) % 65521, (t * 104729 + p * 17 + lhd * 5) % 65519


def token(k, v, n: int, mode: int = L.MODE_GREEDY, seed: int = 0) -> int:
    """Token n of a generation whose cache holds K/V rows k, v before it (the stand-in kernel's
    "model"); sampled slots also depend on the seed."""
    key = np.asarray([n, mode, seed if mode != L.MODE_GREEDY else 0], np.int64)
    h = hashlib.blake2b(key.tobytes(), digest_size=8)
    for rows in (k, v):
        h.update(np.ascontiguousarray(rows, np.uint16).tobytes())
    return int.from_bytes(h.digest(), "little") % CFG.vocab_size


def expected(prompt, params: SamplingParams):
    """(tokens, finish reason, stop id) a correct engine gives this request."""
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(CFG.eos_token_ids))
    out = []
    for n in range(min(params.max_tokens, MAX_CTX - len(prompt))):
        t = token(*kv_rows(list(prompt) + out), n, sampling_mode(params), params.seed or 0)
        if t in stops:
            return out, FinishReason.STOP, t
        out.append(t)
    return out, FinishReason.LENGTH, None


class FakeStream(nullcontext):
    done = True  # no launch on it


class FaultedStream(nullcontext):
    """The stream of a launch that faulted: CUDA reports the (sticky) error to every query."""

    @property
    def done(self):
        raise RuntimeError("cudaErrorLaunchFailure: unspecified launch failure")


class FakeKv(np.ndarray):
    """A slot's KV cache (and its slices): a copy taken while a launch runs is an error (on the GPU it
    allocates device memory while the persistent kernel holds it)."""

    def __array_finalize__(self, obj):
        self.gpu = getattr(obj, "gpu", None)

    def copy(self, order="C"):
        if not self.gpu.stream.done:
            self.gpu.errors.append("KV copied while a launch runs")
        return np.asarray(self).copy(order)


class FakeBatchGpu:
    """BatchGpuModel where BatchedMonokernelEngine uses it; a launch starts a "kernel" thread.

    A slot's GPU state is (its prompt, the index of the next token): a launch either resumes it
    as the last launch left it, or starts it from a given hidden state (the prefill's, or
    `hidden_state()` of an earlier launch). Also checks what the real GPU would silently get wrong
    (`errors`, asserted empty at teardown): a prefill or launch while a launch runs, a slot resumed
    without state or at another position than its state, a hidden state from elsewhere, a slot table
    that does not match the prompt in the slot, a wrong fx_turn0."""

    def __init__(self, batch: int, step_s: float = STEP_S):
        self.batch, self.max_context, self.device, self.step_s = batch, MAX_CTX, 0, step_s
        self.stream = FakeStream()
        self.cp = types.SimpleNamespace(cuda=types.SimpleNamespace(
            Device=lambda d: nullcontext(), memory=types.SimpleNamespace(OutOfMemoryError=MemoryError)))
        self.host_ctrl = np.zeros(batch * L.CTRL_WORDS, np.int32)
        self.host_tokens = np.zeros(batch * MAX_CTX, np.int32)
        self.host_kctl = np.zeros(4, np.int32)
        garbage = np.random.default_rng(batch)  # rows nothing wrote yet: a read of one changes the token
        self.views = [types.SimpleNamespace(prompt=None, k_cache=self._kv(garbage), v_cache=self._kv(garbage))
                      for _ in range(batch)]  # slot b's KV cache (and the prompt prefilled into it)
        self.state: list[tuple | None] = [None] * batch  # ("h", prompt, next token index) per slot
        self.launches: list[dict[int, int]] = []  # slot -> step0, per launch
        self.prefilled: list[tuple] = []
        self.prefill_starts: list[int] = []  # per prefill: the first position it computed (cached before)
        self.finished: dict[tuple, int] = {}  # prompt -> the status its slot ended with
        self.yields = 0
        self.fault_at_step: int | None = None  # the next launch faults at this step (FaultedStream)
        self.errors: list[str] = []
        self.prefill_gate, self.in_prefill = threading.Event(), threading.Event()
        self.prefill_gate.set()
        self._exit, self._thread = (0, 0), None

    def _kv(self, rng):
        kv = rng.integers(0, 65535, KV_SHAPE, np.uint16).view(FakeKv)
        kv.gpu = self
        return kv

    def slot_view(self, b):
        return self.views[b]

    def slot_ctrl(self, b):
        return self.host_ctrl[b * L.CTRL_WORDS:(b + 1) * L.CTRL_WORDS]

    def slot_tokens(self, b):
        return self.host_tokens[b * MAX_CTX:(b + 1) * MAX_CTX]

    def request_yield(self):
        self.host_kctl[L.KCTL_YIELD] = 1

    def launch_slots(self, slots, *, fresh, fx_turn0=0, logits=None, profile=None, idle_ns=0):
        if len(slots) != self.batch:
            raise ValueError(f"{len(slots)} slot specs for a batch of {self.batch}")
        live = {b: s for b, s in enumerate(slots) if s is not None}
        if any(b not in fresh for b in live) and fx_turn0 != self._exit[0]:
            self.errors.append(f"fx_turn0={fx_turn0}, the last launch left {self._exit[0]}")
        self._launch(live, fresh, fx_turn0)
        return self.batch  # (one build: every launch holds all slots)

    def launch_single(self, b, s, x_last, profile=None):
        self._launch({b: s}, {b: x_last}, 0)

    def hidden_state(self, b, single=False):
        if self.state[b] is None:
            self.errors.append(f"hidden state of slot {b}, which has none")
        return self.state[b]

    def _launch(self, live, fresh, fx_turn0):
        if not self.stream.done:
            self.errors.append("launch while a launch runs")
        for b, s in list(live.items()):
            if len(s.stop_ids) > L.MAX_STOP_IDS:
                raise ValueError(f"at most {L.MAX_STOP_IDS} stop token ids per slot")
            prompt = self.views[b].prompt
            if prompt is None or s.start_pos != len(prompt):
                self.errors.append(f"slot {b}: start_pos {s.start_pos} for a prompt of {prompt and len(prompt)}")
            if b in fresh:
                self.state[b] = fresh[b]
            if self.state[b] != ("h", prompt, s.step0):
                self.errors.append(f"slot {b} starts at token {s.step0} from state {self.state[b]}")
            if s.step0 == 0:  # a new generation: clean control words
                self.slot_ctrl(b)[:] = 0
            self.slot_ctrl(b)[L.CTRL_DONE] = 0
            live[b] = dataclasses.replace(s, stop_ids=tuple(s.stop_ids))  # the slot table is fixed for a launch
        self.host_kctl[:] = 0
        self.launches.append({b: s.step0 for b, s in live.items()})
        self.stream.done = False
        self._thread = threading.Thread(target=self._kernel, args=(live, fx_turn0), daemon=True)
        self._thread.start()

    def _kernel(self, live, fx_turn0):
        step = 0
        while True:
            if step == self.fault_at_step:
                self.stream = FaultedStream()
                return
            if step > 0 and self.host_kctl[L.KCTL_YIELD]:  # exit at a step boundary; slots keep their state
                self.yields += 1
                break
            time.sleep(self.step_s)
            for b, s in list(live.items()):
                ctrl, n, view = self.slot_ctrl(b), s.step0 + step, self.views[b]
                prompt, pos = view.prompt, s.start_pos + n  # token n reads rows [0, pos)
                tok = token(view.k_cache[:, :, :pos], view.v_cache[:, :, :pos], n, s.mode, s.seed)
                last = n + 1 >= s.max_steps or s.start_pos + n + 1 >= MAX_CTX
                status = (L.STATUS_CANCELLED if ctrl[L.CTRL_CANCEL] else L.STATUS_STOP if tok in s.stop_ids
                          else L.STATUS_LENGTH if last else 0)
                if status not in (L.STATUS_CANCELLED, L.STATUS_STOP):
                    self.slot_tokens(b)[n] = tok
                    ctrl[L.CTRL_COUNT] = n + 1
                if status:
                    ctrl[L.CTRL_STOP_TOKEN], ctrl[L.CTRL_STATUS], ctrl[L.CTRL_DONE] = tok, status, 1
                    self.finished[prompt] = status
                    self.state[b] = None
                    del live[b]
                else:
                    view.k_cache[:, :, pos:pos + 1], view.v_cache[:, :, pos:pos + 1] = kv_rows([tok], pos)
                    self.state[b] = ("h", prompt, n + 1)  # token n went through the layers
            if not live:
                break
            step += 1
        self._exit = (fx_turn0 + FX_PER_STEP * step, step)
        self.stream.done = True

    def synchronize(self):
        if self._thread is not None:
            self._thread.join()

    def exit_state(self):
        return self._exit


class FakePrefill:
    """Prefill of one slot: writes the KV rows of ids[start:] into the slot's cache (rows [0, start) are
    the caller's: a session's restored prefix); waits while prefill_gate is clear."""

    def __init__(self, gpu: FakeBatchGpu, view):
        self.gpu, self.view = gpu, view

    def run(self, ids, all_logits=False, start=0):
        gpu = self.gpu
        if not gpu.stream.done:
            gpu.errors.append("prefill while a launch holds the SMs")
        gpu.in_prefill.set()
        assert gpu.prefill_gate.wait(5)
        gpu.prefilled.append(tuple(ids))
        gpu.prefill_starts.append(start)
        self.view.k_cache[:, :, start:len(ids)], self.view.v_cache[:, :, start:len(ids)] = kv_rows(ids[start:], start)
        self.view.prompt = tuple(ids)
        return ("h", tuple(ids), 0), None


@pytest.fixture
def make():
    built = []

    def build(batch: int = 4, step_s: float = STEP_S, **session_limits):
        gpu = FakeBatchGpu(batch, step_s)
        eng = BatchedMonokernelEngine.around(CFG, gpu, lambda view: FakePrefill(gpu, view), **session_limits)
        built.append((eng, gpu))
        return eng, gpu

    yield build
    for eng, gpu in built:
        gpu.prefill_gate.set()
        eng.close()
        assert not eng._thread.is_alive()
        assert gpu.errors == []


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab_size, int(rng.integers(3, 40))).tolist() for _ in range(n)]


def assert_exact(gen, tokens, prompt, params):
    want, reason, stop = expected(prompt, params)
    assert tokens == want
    assert (gen.finish_reason, gen.stop_token_id) == (reason, stop)


@pytest.mark.parametrize("batch", [2, 4, 8])
def test_concurrent_requests_each_get_their_own_tokens(make, batch):
    eng, gpu = make(batch)
    ps = prompts(batch, batch)
    ps[-1] = (ps[-1] * MAX_CTX)[:MAX_CTX - 6]  # reaches the end of the context window after 6 tokens
    qs = [SamplingParams(max_tokens=20 + 7 * i, ignore_eos=True) for i in range(batch)]
    qs[0] = SamplingParams(max_tokens=25, temperature=0.8, seed=5, ignore_eos=True)  # a sampled slot: its seed
    gens = [eng.generate(p, q) for p, q in zip(ps, qs)]
    for g, p, q in zip(gens, ps, qs):
        out = list(g)
        assert_exact(g, out, p, q)
        assert g.finish_reason is FinishReason.LENGTH
    assert gens[-1].num_tokens == 6


def test_joins_resume_running_slots_exactly(make):
    eng, gpu = make(4)
    ps, q = prompts(4, 1), SamplingParams(max_tokens=150, ignore_eos=True)
    first = [eng.generate(p, q) for p in ps[:2]]
    heads = [[next(g) for _ in range(10)] for g in first]
    late = [eng.generate(p, q) for p in ps[2:]]  # join while the first two decode
    outs = [h + list(g) for h, g in zip(heads, first)] + [list(g) for g in late]
    for g, o, p in zip(first + late, outs, ps):
        assert_exact(g, o, p, q)
    assert len(gpu.launches) >= 2 and gpu.yields >= 1
    assert any(max(launch.values()) > 0 for launch in gpu.launches)  # some slot really resumed mid-generation


def test_a_faulted_launch_fails_its_requests_and_every_later_one(make):
    """A launch that faults (the stream reports CUDA's sticky error): each running request ends with EngineFailed
    after the tokens it already had, and the engine refuses every later request the same way, since nothing
    runs on that GPU again (the replica turns NOT_SERVING on it and must be restarted)."""
    from replicas.engine import EngineFailed

    eng, gpu = make(4)
    ps, q = prompts(2, 9), SamplingParams(max_tokens=60, ignore_eos=True)
    gpu.fault_at_step = 5
    gens = [eng.generate(p, q) for p in ps]
    for g, p in zip(gens, ps):
        got = []
        with pytest.raises(EngineFailed, match="GPU 0 failed .*cudaErrorLaunchFailure.*restart the replica"):
            for tok in g:
                got.append(tok)
        assert got == expected(p, q)[0][:len(got)] and len(got) <= 5
    with pytest.raises(EngineFailed, match="restart the replica"):
        eng.generate(ps[0], q)
    assert eng.failed and not any(eng._slots)


def test_cancel_ends_one_slot_and_its_slot_is_reused(make):
    eng, gpu = make(4)
    ps, q = prompts(5, 2), SamplingParams(max_tokens=300, ignore_eos=True)
    gens = [eng.generate(p, q) for p in ps[:4]]
    with pytest.raises(EngineBusy, match="all 4 slots of the batched monokernel are busy"):
        eng.generate(ps[4], q)
    got = [next(gens[1]) for _ in range(3)]
    gens[1].cancel()
    got += list(gens[1])
    assert gens[1].finish_reason is FinishReason.CANCELLED
    assert 3 <= len(got) < 300 and got == expected(ps[1], q)[0][:len(got)]
    late = eng.generate(ps[4], q)  # the freed slot, at once, while the other three still decode
    for g, p in zip((gens[0], gens[2], gens[3], late), (ps[0], ps[2], ps[3], ps[4])):
        assert_exact(g, list(g), p, q)
    assert gpu.finished[tuple(ps[1])] == L.STATUS_CANCELLED  # the kernel dropped the slot


def test_stop_tokens_end_a_slot_without_yielding_them(make):
    eng, gpu = make(3)
    p, other = prompts(2, 3)
    want = expected(p, SamplingParams(max_tokens=60, ignore_eos=True))[0]
    j = next(i for i in range(10, 60) if want[i] not in want[:i])
    q = SamplingParams(max_tokens=60, stop_token_ids=[want[j]], ignore_eos=True)
    # a prompt whose sequence meets one of the model's EOS ids: EOS stops unless ignore_eos
    eos_p = next(pp for s in range(1000) for pp in prompts(1, 100 + s)
                 if expected(pp, SamplingParams(max_tokens=60))[1] is FinishReason.STOP)
    g, e, o = (eng.generate(p, q), eng.generate(eos_p, SamplingParams(max_tokens=60)),
               eng.generate(other, SamplingParams(max_tokens=60, ignore_eos=True)))
    out = list(g)
    assert out == want[:j] and g.finish_reason is FinishReason.STOP and g.stop_token_id == want[j]
    assert_exact(e, list(e), eos_p, SamplingParams(max_tokens=60))
    assert e.stop_token_id in CFG.eos_token_ids
    assert_exact(o, list(o), other, SamplingParams(max_tokens=60, ignore_eos=True))


def test_busy_counts_requests_being_admitted_and_a_cancel_before_admission_ends_it(make):
    eng, gpu = make(2)
    pa, pb, pc = prompts(3, 4)
    q = SamplingParams(max_tokens=40, ignore_eos=True)
    gpu.prefill_gate.clear()
    a = eng.generate(pa, q)
    assert gpu.in_prefill.wait(2)  # the scheduler is inside a's prefill
    b = eng.generate(pb, q)
    with pytest.raises(EngineBusy, match="all 2 slots"):  # a (being prefilled) and b hold both
        eng.generate(pc, q)
    b.cancel()  # before it was admitted (and before anyone iterated it)
    gpu.prefill_gate.set()
    assert list(b) == [] and b.finish_reason is FinishReason.CANCELLED
    assert_exact(a, list(a), pa, q)
    assert tuple(pb) not in gpu.prefilled  # dropped without running


def test_closing_a_generation_frees_its_slot(make):
    eng, gpu = make(2, step_s=2e-3)  # slower steps: a slot left busy would stay busy ~1 s
    ps, long = prompts(4, 5), SamplingParams(max_tokens=400, ignore_eos=True)
    g1 = eng.generate(ps[0], long)
    got = [next(g1), next(g1)]
    g1.close()  # the client went away mid-stream
    g2 = eng.generate(ps[1], long)
    g2.close()  # ... or before its first token
    assert g1.finish_reason is g2.finish_reason is FinishReason.CANCELLED
    assert got == expected(ps[0], long)[0][:2]
    q = SamplingParams(max_tokens=20, ignore_eos=True)
    gens = []
    end = time.monotonic() + 0.3
    while len(gens) < 2:  # both slots free again within a few steps
        try:
            gens.append(eng.generate(ps[2 + len(gens)], q))
        except EngineBusy:
            assert time.monotonic() < end, "a closed generation still holds its slot"
            time.sleep(1e-3)
    for g, p in zip(gens, ps[2:]):
        assert_exact(g, list(g), p, q)
    assert gpu.finished[tuple(ps[0])] == L.STATUS_CANCELLED  # not decoded on for nobody
    assert tuple(ps[1]) not in gpu.prefilled or gpu.finished[tuple(ps[1])] == L.STATUS_CANCELLED


def test_a_dropped_generation_frees_its_slot(make):
    import gc

    eng, gpu = make(1, step_s=2e-3)
    p, long = prompts(2, 9), SamplingParams(max_tokens=400, ignore_eos=True)
    eng.generate(p[0], long)  # never iterated nor closed: garbage
    gc.collect()
    q = SamplingParams(max_tokens=10, ignore_eos=True)
    end = time.monotonic() + 0.3
    while True:  # the one slot is free again within a few steps, not after 400
        try:
            g = eng.generate(p[1], q)
            break
        except EngineBusy:
            assert time.monotonic() < end, "a dropped generation still holds the slot"
            time.sleep(1e-3)
    assert_exact(g, list(g), p[1], q)


def test_invalid_requests_are_refused_before_anything_runs(make):
    eng, gpu = make(2)
    q = SamplingParams(max_tokens=8, ignore_eos=True)
    bad = [([], q, "empty"), ([1, CFG.vocab_size], q, "outside the vocabulary"), ([-1], q, "outside"),
           ([1] * MAX_CTX, q, "context window"),
           ([1, 2], SamplingParams(max_tokens=8, stop_token_ids=range(L.MAX_STOP_IDS + 1), ignore_eos=True),
            "at most 16"),
           ([1, 2], SamplingParams(max_tokens=8, stop_token_ids=[CFG.vocab_size]), "stop token id")]
    for ids, params, msg in bad:
        with pytest.raises(InvalidRequest, match=msg):
            eng.generate(ids, params)
    with pytest.raises(InvalidRequest, match="3 sequences for 2 slots"):
        eng.forward_logits_slots([[1, 2]] * 3)
    time.sleep(0.02)
    assert gpu.launches == [] and gpu.prefilled == []
    assert_exact(g := eng.generate([1, 2], q), list(g), [1, 2], q)  # and the engine still serves


def test_forward_logits_needs_an_idle_engine(make):
    eng, gpu = make(2)
    q = SamplingParams(max_tokens=300, ignore_eos=True)
    g = eng.generate([5, 6, 7], q)
    first = next(g)
    with pytest.raises(EngineBusy, match="idle"):
        eng.forward_logits([1, 2, 3])
    g.cancel()
    rest = list(g)
    assert g.finish_reason is FinishReason.CANCELLED
    assert [first] + rest == expected([5, 6, 7], q)[0][:1 + len(rest)]


def test_close_ends_pending_requests_with_an_error_and_stops_the_thread(make):
    eng, gpu = make(2)
    pa, pb = prompts(2, 6)
    q = SamplingParams(max_tokens=30, ignore_eos=True)
    gpu.prefill_gate.clear()
    a = eng.generate(pa, q)
    assert gpu.in_prefill.wait(2)
    b = eng.generate(pb, q)  # pending behind a's prefill
    threading.Timer(0.05, gpu.prefill_gate.set).start()  # a's prefill ends after close() began
    t0 = time.perf_counter()
    eng.close()
    assert time.perf_counter() - t0 < 5 and not eng._thread.is_alive()
    assert_exact(a, list(a), pa, q)  # what was running finishes
    with pytest.raises(EngineBusy, match="closed before this request started"):
        list(b)
    assert tuple(pb) not in gpu.prefilled
    with pytest.raises(EngineBusy, match="closed"):
        eng.generate(pa, q)
