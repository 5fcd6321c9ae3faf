"""Resident batch launches (layout option resident; csrc/mk_batch.cuh, replicas/monokernel_resident.py):
requests join a running batch kernel at a step boundary, with no relaunch.

(1) The host's admission words, alone. (2) The real kernel on the CPU emulation
(replicas/monokernel_emu_batch.py; its batch build on 3 blocks, the single build on 4 with its own
fused-down packing): a slot that joins while others decode, at launch step 0 of an empty launch, or
after every slot has finished (the weight stream restarted) gets exactly the tokens the B = 1 kernel
gives it alone; a publication the launch ends before taking is never acknowledged; an idle launch
ends after its idle time. (3) The batched engine's scheduler on that kernel: joins without a
relaunch, exact greedy tokens, seeded sampling as alone, cancel, a failed join's prefill; an agent
session's turns join too, their KV copied out as a slot ends and back in at the next turn's join. Tiny model, greedy unless said; the emulation is exact, so equality.
"""

from __future__ import annotations

import platform
import shutil
import time

import numpy as np
import pytest

from replicas import layout as L
from replicas.checkpoint import preset_config
from replicas.engine import FinishReason, SamplingParams
from replicas.layout import KernelLayout, LayoutError
from replicas.monokernel_resident import Admissions

emu_only = pytest.mark.skipif(shutil.which("g++") is None or platform.machine() not in ("x86_64", "AMD64"),
                              reason="the CPU emulation needs g++ on x86-64 (its fiber switch is x86-64 assembly)")
FUSED = {"fused_mlp": True, "fused_attn_o": True}


# ---- (1) the admission words ----------------------------------------------------------------
def test_admissions_publish_in_order_and_wait_for_the_acknowledgement():
    kctl = np.zeros(L.KCTL_WORDS, np.int32)
    a = Admissions(kctl)
    assert a.consumed and a.settle() == 0
    a.publish(0b100)
    assert (kctl[L.KCTL_ADMIT_MASK], kctl[L.KCTL_ADMIT_SEQ]) == (0b100, 1)
    assert not a.consumed and a.settle() == 0
    with pytest.raises(RuntimeError, match="not acknowledged"):
        a.publish(0b10)  # the kernel reads the mask once per sequence number: no overwrite before the ack
    kctl[L.KCTL_ADMIT_ACK] = 1  # what the kernel writes when the slots join
    assert a.consumed and a.settle() == 0b100 and a.settle() == 0
    a.publish(0b10)
    assert kctl[L.KCTL_ADMIT_SEQ] == 2
    for bad in (0, 1 << L.MAX_BATCH):
        kctl[L.KCTL_ADMIT_ACK] = a.seq
        with pytest.raises(ValueError, match="one bit per slot"):
            a.publish(bad)
    kctl[:] = 0
    a.reset()  # a new launch zeroes the words
    assert a.consumed and a.seq == 0


def test_resident_layouts_flags_and_shared_memory():
    c = preset_config("llama-3.2-1b")
    plain = KernelLayout.from_config(c, 2048, num_sms=116, batch=4, **FUSED)
    res = KernelLayout.from_config(c, 2048, num_sms=116, batch=4, resident=True, **FUSED)
    flags = res.compile_flags()
    assert "-DMK_RESIDENT=1" in flags and f"-DMK_RED_FLOATS={res.red_floats}" in flags
    assert not any("RESIDENT" in f for f in plain.compile_flags())
    # every slot's row (8 bytes a field) and stop ids, 8-byte aligned, on top of the plain build's
    assert res.smem_fixed - plain.smem_fixed == 8 + 4 * (8 * len(L.SLOT_FIELDS) + 4 * L.MAX_STOP_IDS)
    assert res.smem_bytes <= L.SMEM_LIMIT
    assert res.param_fields()[-len(L.RESIDENT_PARAM_FIELDS):] == L.RESIDENT_PARAM_FIELDS
    assert plain.packed_shapes() == res.packed_shapes()
    with pytest.raises(LayoutError, match="resident.*need batch > 1"):
        KernelLayout.from_config(c, 2048, resident=True, **FUSED)


# ---- (2) the kernel on the CPU emulation ----------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    from replicas.model import ModelConfig
    from replicas.monokernel_emu import EmuModel
    from replicas.weights import load_weights

    cfg = ModelConfig.from_pretrained(tiny_checkpoint)
    tensors = load_weights(tiny_checkpoint, cfg, dtype="raw")
    return cfg, tensors, EmuModel(cfg, tensors)


@pytest.fixture(scope="module")
def resident_gpu(tiny):
    from replicas.monokernel_emu_batch import EmuBatchGpu

    cfg, tensors, _ = tiny
    gpu = EmuBatchGpu(cfg, tensors, 4, resident=True)
    assert (gpu.layout.num_sms, gpu.single_layout.num_sms) == (3, 4)  # two grids: two fused-down packings
    return gpu


def _wait(cond, timeout=120.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out waiting for the emulated kernel"
        time.sleep(0.005)


@emu_only
def test_slots_join_while_decoding_at_step_zero_and_after_every_slot_finished(tiny, resident_gpu):
    from replicas.monokernel_batch import SlotSpec
    from replicas.monokernel_prefill import Prefill

    cfg, _, one = tiny
    gpu = resident_gpu
    pre = [Prefill(gpu.slot_view(b), np) for b in range(4)]
    rng = np.random.default_rng(41)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (9, 12, 7, 10)]
    budget = [5, 14, 6, 4]
    done = lambda b: bool(gpu.slot_ctrl(b)[L.CTRL_DONE])

    def join(b):
        x, _ = pre[b].run(prompts[b])
        gpu.prepare_join(b, SlotSpec(start_pos=len(prompts[b]), max_steps=budget[b]), x)
        gpu.admissions.publish(1 << b)
        _wait(lambda: gpu.admissions.settle() == 1 << b)

    launches = gpu.launches
    gpu.launch_slots([None] * 4, fresh={}, idle_ns=int(60e9))  # nothing to decode: it waits
    join(2)  # at step 0
    join(1)  # while slot 2 decodes
    _wait(lambda: done(1) and done(2))
    join(0)  # every slot had finished: the launch was idle
    _wait(lambda: gpu.slot_ctrl(0)[L.CTRL_COUNT] >= 2)
    join(3)  # slot 3 while slot 0 decodes
    _wait(lambda: done(0) and done(3))
    assert not gpu.stream.done  # still resident, idle
    gpu.request_yield()
    gpu.synchronize()
    assert gpu.launches == launches + 1
    for b in range(4):
        assert gpu.slot_tokens(b)[:budget[b]].tolist() == one.generate_greedy(prompts[b], budget[b]), b
        assert int(gpu.slot_ctrl(b)[L.CTRL_STATUS]) == L.STATUS_LENGTH


@emu_only
@pytest.mark.parametrize("extra,sms", [({}, 4), ({"pair_norm": True}, 5), ({"fx_pack": False}, 4)],
                         ids=["defaults", "pair-norm", "int64-words"])
def test_the_batch_defaults_admit_joins_at_step_zero_and_while_decoding(tiny, extra, sms):
    """The resident build with the batched engine's defaults (layout_tuned.TUNED_BATCH: the MLP and the LM head on
    tensor cores, whose joined slots' LM input is the handed-over hidden state; ao_slots, whose combine divided by
    the live slot count while the launch idled): joins at step 0, while another decodes, and after an idle spell
    give the single kernel's greedy tokens (these prompts have no near tie at bf16 level). pair-norm: the same in
    block pairs (4 of 5 blocks: an even grid), the embed prologue after sample + emit and the idle layers included.
    The defaults pack slots 0 and 1 into the same accumulator words (fx_pack), so slot 0 joins beside a finished
    slot 1 (its LM input from the handed-over state, its pair lane from the accumulator); int64-words: one slot
    per word, as before session 14."""
    from replicas.layout_tuned import TUNED_BATCH
    from replicas.monokernel_batch import SlotSpec
    from replicas.monokernel_emu_batch import EmuBatchGpu
    from replicas.monokernel_prefill import Prefill

    cfg, tensors, one = tiny
    gpu = EmuBatchGpu(cfg, tensors, 4, resident=True, layout_options={**TUNED_BATCH, **extra}, num_sms=sms)
    assert gpu.layout.pair_norm is bool(extra.get("pair_norm")) and gpu.layout.fx_pack is extra.get("fx_pack", True)
    assert gpu.layout.mma_mlp and gpu.layout.mma_lm and not gpu.single_layout.mma_mlp
    rng = np.random.default_rng(43)
    prompts = {b: rng.integers(0, cfg.vocab_size, n).tolist() for b, n in ((2, 9), (1, 11), (0, 8))}
    budget = {2: 5, 1: 9, 0: 4}
    done = lambda b: bool(gpu.slot_ctrl(b)[L.CTRL_DONE])

    def join(b):
        x, _ = Prefill(gpu.slot_view(b), np).run(prompts[b])
        gpu.prepare_join(b, SlotSpec(start_pos=len(prompts[b]), max_steps=budget[b]), x)
        gpu.admissions.publish(1 << b)
        _wait(lambda: gpu.admissions.settle() == 1 << b)

    gpu.launch_slots([None] * 4, fresh={}, idle_ns=int(60e9))
    join(2)  # at step 0
    join(1)  # while slot 2 decodes
    _wait(lambda: done(1) and done(2))
    join(0)  # after every slot had finished: the launch idled through empty layers
    _wait(lambda: done(0))
    gpu.request_yield()
    gpu.synchronize()
    for b in (2, 1, 0):
        assert gpu.slot_tokens(b)[:budget[b]].tolist() == one.generate_greedy(prompts[b], budget[b]), b


@emu_only
def test_an_idle_launch_ends_after_its_idle_time_and_a_late_publication_is_not_taken(tiny, resident_gpu):
    from replicas.monokernel_batch import SlotSpec

    cfg, _, _ = tiny
    gpu = resident_gpu
    t0 = time.monotonic()
    gpu.launch_slots([None] * 4, fresh={}, idle_ns=int(0.3e9))
    gpu.synchronize()
    assert 0.25 < time.monotonic() - t0 < 30
    # published after the launch decided to leave (the host asked for the GPU back): not acknowledged,
    # so the scheduler knows the slot never joined and starts it in its next launch
    gpu.launch_slots([None] * 4, fresh={}, idle_ns=int(60e9))
    gpu.request_yield()
    gpu.synchronize()
    gpu.prepare_join(1, SlotSpec(start_pos=3, max_steps=4), np.ones(cfg.hidden_size, np.float32))
    gpu.admissions.publish(0b10)
    assert not gpu.admissions.consumed and gpu.admissions.settle() == 0
    assert gpu.slot_ctrl(1)[L.CTRL_COUNT] == 0


# ---- (3) the batched engine's scheduler -----------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny, resident_gpu):
    from replicas.monokernel_batched import BatchedMonokernelEngine
    from replicas.monokernel_prefill import Prefill

    cfg, _, _ = tiny
    eng = BatchedMonokernelEngine.around(cfg, resident_gpu, lambda view: Prefill(view, np))
    yield eng
    eng.close()


def greedy(n):
    return SamplingParams(max_tokens=n, ignore_eos=True)


@emu_only
def test_requests_join_a_running_batch_launch_without_a_relaunch(tiny, resident_gpu, engine):
    cfg, _, one = tiny
    gpu, eng = resident_gpu, engine
    rng = np.random.default_rng(42)
    pa, pb, pc, pd = (rng.integers(0, cfg.vocab_size, n).tolist() for n in (13, 8, 10, 6))
    a = eng.generate(pa, greedy(30))
    head_a = [next(a)]  # alone: the single-sequence build
    b = eng.generate(pb, greedy(24))
    head_b = [next(b)]  # the join made the single launch yield: now a resident batch launch of both
    launches, joins = gpu.launches, eng.resident_joins
    out_c = list(eng.generate(pc, greedy(5)))
    out_d = list(eng.generate(pd, greedy(4)))
    assert (gpu.launches, eng.resident_joins) == (launches, joins + 2)  # both joined the running launch
    assert head_a + list(a) == one.generate_greedy(pa, 30)
    assert head_b + list(b) == one.generate_greedy(pb, 24)
    assert out_c == one.generate_greedy(pc, 5) and out_d == one.generate_greedy(pd, 4)
    assert len(eng.join_latencies) >= 4


@emu_only
def test_a_joined_request_samples_as_alone_and_cancels_within_a_step(tiny, resident_gpu, engine):
    cfg, _, _ = tiny
    gpu, eng = resident_gpu, engine
    rng = np.random.default_rng(43)
    prompt = rng.integers(0, cfg.vocab_size, 11).tolist()
    seeded = SamplingParams(max_tokens=6, temperature=0.8, top_k=6, seed=9, ignore_eos=True)
    alone = list(eng.generate(prompt, seeded))  # the single build
    x = eng.generate(rng.integers(0, cfg.vocab_size, 7).tolist(), greedy(40))
    y = eng.generate(rng.integers(0, cfg.vocab_size, 9).tolist(), greedy(40))
    next(x), next(y)
    joins = eng.resident_joins
    assert list(eng.generate(prompt, seeded)) == alone
    long_g = eng.generate(prompt, greedy(200))
    got = [next(long_g), next(long_g)]
    long_g.cancel()
    rest = list(long_g)
    assert eng.resident_joins == joins + 2
    assert long_g.finish_reason is FinishReason.CANCELLED and len(got) + len(rest) < 200
    x.cancel(), y.cancel()
    list(x), list(y)


@emu_only
def test_session_turns_join_the_running_launch_with_their_kv_restored(tiny, resident_gpu, engine):
    """A session's turn 1 ends while the launch runs: its rows are copied out at once (before its end is
    sent); turn 2 joins the same launch with them copied back in and only its suffix prefilled; a plain
    request that takes turn 1's freed slot meanwhile does not disturb the stored rows."""
    cfg, _, one = tiny
    gpu, eng = resident_gpu, engine
    rng = np.random.default_rng(44)
    prompt = rng.integers(0, cfg.vocab_size, 12).tolist()
    a = eng.generate(rng.integers(0, cfg.vocab_size, 8).tolist(), greedy(90))  # slot 0
    b = eng.generate(rng.integers(0, cfg.vocab_size, 8).tolist(), greedy(90))  # slot 1
    c = eng.generate(rng.integers(0, cfg.vocab_size, 8).tolist(), greedy(90))  # slot 2: the 4-slot build
    next(a), next(b), next(c)
    launches, joins = gpu.launches, eng.resident_joins
    stored = eng.session_stats()
    g1 = eng.generate(prompt, greedy(6), session_id="res")  # slot 3, joins
    out1 = list(g1)
    assert eng.session_stats().bytes > stored.bytes  # its rows were stored before its end was sent
    plain = list(eng.generate(prompt, greedy(3)))  # slot 3 again: the stored rows are copies
    turn2 = prompt + out1 + rng.integers(0, cfg.vocab_size, 3).tolist()
    g2 = eng.generate(turn2, greedy(4), session_id="res")
    out2 = list(g2)
    assert (gpu.launches, eng.resident_joins) == (launches, joins + 3)  # no relaunch for any of them
    assert g1.reused_tokens == 0 and g2.reused_tokens == len(prompt) + len(out1) - 1
    assert out1 == one.generate_greedy(prompt, 6) and plain == one.generate_greedy(prompt, 3)
    assert out2 == one.generate_greedy(turn2, 4)
    for g in (a, b, c):
        g.cancel()
        list(g)


@emu_only
def test_a_joiner_limited_to_short_prefills_relaunches_long_prompts_and_counts_a_sessions_suffix(
        tiny, resident_gpu, engine):
    """fp32 join mode (Joiner.warm found that tensor-core GEMMs wait for a running launch) takes prompts
    whose prefill is at most `max_join_tokens`: a longer one relaunches (with exact tokens), a session turn
    counts only its suffix beyond the stored rows."""
    cfg, _, one = tiny
    gpu, eng = resident_gpu, engine
    rng = np.random.default_rng(45)
    running = [eng.generate(rng.integers(0, cfg.vocab_size, 8).tolist(), greedy(120)) for _ in range(3)]
    for g in running:
        next(g)
    eng._joiner.max_join_tokens = 10
    try:
        short, long_ = rng.integers(0, cfg.vocab_size, 9).tolist(), rng.integers(0, cfg.vocab_size, 14).tolist()
        launches, joins = gpu.launches, eng.resident_joins
        assert list(eng.generate(short, greedy(3))) == one.generate_greedy(short, 3)
        assert (gpu.launches, eng.resident_joins) == (launches, joins + 1)
        assert list(eng.generate(long_, greedy(3))) == one.generate_greedy(long_, 3)
        assert gpu.launches == launches + 1 and eng.resident_joins == joins + 1  # relaunched, not joined
        prompt = rng.integers(0, cfg.vocab_size, 8).tolist()
        out1 = list(eng.generate(prompt, greedy(5), session_id="short-joins"))
        turn2 = prompt + out1 + rng.integers(0, cfg.vocab_size, 4).tolist()  # 17 tokens, 13 of them stored
        launches, joins = gpu.launches, eng.resident_joins
        g2 = eng.generate(turn2, greedy(3), session_id="short-joins")
        out2 = list(g2)
        assert (gpu.launches, eng.resident_joins) == (launches, joins + 1)
        assert g2.reused_tokens == len(prompt) + len(out1) - 1 and out2 == one.generate_greedy(turn2, 3)
    finally:
        eng._joiner.max_join_tokens = None
        for g in running:
            g.cancel()
            list(g)


@emu_only
def test_a_resident_build_computes_the_batch_builds_numbers(tiny):
    """Teacher forcing through a resident build's slot copies in shared memory: bit-identical logits to the
    plain batch build on the same grid (only where each slot's settings are read from differs)."""
    from tests.test_monokernel_emu_cpu import logits_pair

    cfg, tensors, _ = tiny
    ids = np.random.default_rng(45).integers(0, cfg.vocab_size, 26).tolist()
    want, got, res = logits_pair(cfg, tensors, ids, 4, {"resident": True})
    assert "-DMK_RESIDENT=1" in res.layout.compile_flags()
    assert np.abs(want).max() > 0 and np.array_equal(want, got)


@emu_only
def test_a_join_whose_prefill_fails_ends_that_request_alone(tiny, resident_gpu, engine, monkeypatch):
    cfg, _, one = tiny
    eng = engine
    rng = np.random.default_rng(46)
    ps = [rng.integers(0, cfg.vocab_size, 8).tolist() for _ in range(3)]
    bad, good = rng.integers(0, cfg.vocab_size, 5).tolist(), rng.integers(0, cfg.vocab_size, 6).tolist()
    running = [eng.generate(p, greedy(24)) for p in ps]  # (long enough to outlast both joins)
    heads = [[next(g)] for g in running]
    for pre in eng._prefill:
        real = pre.run

        def run(ids, *a, _real=real, **k):
            if list(ids) == bad:
                raise MemoryError("out of GPU memory in the joiner's prefill (test)")
            return _real(ids, *a, **k)
        monkeypatch.setattr(pre, "run", run)
    joins = eng.resident_joins
    with pytest.raises(MemoryError, match="joiner's prefill"):
        list(eng.generate(bad, greedy(4)))
    assert list(eng.generate(good, greedy(4))) == one.generate_greedy(good, 4)  # its slot was freed for this one
    assert eng.resident_joins == joins + 2
    for p, h, g in zip(ps, heads, running):  # the running requests never noticed
        assert h + list(g) == one.generate_greedy(p, 24)


class _QueuedGraphs:
    """Stands in for a slot's PrefillGraphs on the emulation: prompts of even length have a "captured graph"
    (the scheduler then queues the prefill itself, Joiner.start), odd ones do not (the worker prefills them);
    `fail` makes a replay raise."""

    def __init__(self, pre):
        self.pre, self.calls, self.fail = pre, [], False

    def run(self, ids, start):
        return None  # (Prefill.run: no graph here, it prefills eagerly)

    def replay_captured(self, ids, start, mode):
        if len(ids) % 2:
            return None
        self.calls.append((len(ids), start, mode))
        if self.fail:
            raise RuntimeError("graph replay failed (test)")
        return self.pre.run(ids, start=start)[0]


class _Event:
    """cupy.cuda.Event on the emulation: not done at its first poll, done after (both branches of poll)."""

    def __init__(self, disable_timing=True):
        self.polls = 0

    def record(self, stream=None):
        pass

    @property
    def done(self):
        self.polls += 1
        return self.polls > 1

    def synchronize(self):
        self.polls = 1


@emu_only
def test_a_join_with_a_captured_graph_is_queued_by_the_scheduler_itself(tiny, resident_gpu, engine, monkeypatch):
    """Joiner.start's scheduler-thread path: the prefill replayed on the prefill stream and published when its
    event is done, with no worker; exact tokens, no relaunch, and a failing replay ends that request alone."""
    cfg, _, one = tiny
    gpu, eng = resident_gpu, engine
    monkeypatch.setattr(gpu.cp.cuda, "Event", _Event, raising=False)
    fakes = [_QueuedGraphs(pre) for pre in eng._prefill]
    for pre, fake in zip(eng._prefill, fakes):
        monkeypatch.setattr(pre, "graphs", fake, raising=False)
    rng = np.random.default_rng(47)
    running = [eng.generate(rng.integers(0, cfg.vocab_size, 9).tolist(), greedy(60)) for _ in range(3)]
    for g in running:
        next(g)
    launches, joins = gpu.launches, eng.resident_joins
    even, odd = rng.integers(0, cfg.vocab_size, 10).tolist(), rng.integers(0, cfg.vocab_size, 7).tolist()
    assert list(eng.generate(even, greedy(5))) == one.generate_greedy(even, 5)
    assert list(eng.generate(odd, greedy(5))) == one.generate_greedy(odd, 5)
    assert sum(len(f.calls) for f in fakes) == 1 and [f.calls for f in fakes if f.calls][0][0][:2] == (10, 0)
    assert (gpu.launches, eng.resident_joins) == (launches, joins + 2)
    for f in fakes:
        f.fail = True
    with pytest.raises(RuntimeError, match="graph replay failed"):
        list(eng.generate(even, greedy(3)))
    assert list(eng.generate(odd, greedy(3))) == one.generate_greedy(odd, 3)  # its slot was freed for this one
    for g in running:
        g.cancel()
        list(g)


@emu_only
def test_a_join_that_waits_for_the_launch_makes_it_yield_after_join_stall_s(tiny, resident_gpu, engine, monkeypatch):
    """A join whose prefill cannot finish while the launch runs (on a GPU: a kernel loaded for the first time
    waits for it) would wait for every running request to end; past JOIN_STALL_S the scheduler asks the launch
    to yield, the prefill completes and the request starts in the relaunch. Tokens exact for everyone."""
    import replicas.monokernel_resident as res_mod

    cfg, _, one = tiny
    eng = engine
    monkeypatch.setattr(res_mod, "JOIN_STALL_S", 0.3)
    rng = np.random.default_rng(48)
    ps = [rng.integers(0, cfg.vocab_size, 8).tolist() for _ in range(3)]
    stuck = rng.integers(0, cfg.vocab_size, 5).tolist()
    for pre in eng._prefill:
        real = pre.run

        def run(ids, *a, _real=real, **k):
            if list(ids) == stuck:  # waits for the running launch to end, as a first module load does
                while eng._resident_launch:
                    time.sleep(0.005)
            return _real(ids, *a, **k)
        monkeypatch.setattr(pre, "run", run)
    running = [eng.generate(p, greedy(30)) for p in ps]
    heads = [[next(g)] for g in running]
    launches, stalled = eng.launches, eng.stalled_joins
    g = eng.generate(stuck, greedy(4))
    first = next(g)
    # it started while the running requests still decode (without the yield: only once all three had ended)
    assert sum(r is not None for r in eng._slots) == 4
    assert [first] + list(g) == one.generate_greedy(stuck, 4)
    assert eng.stalled_joins == stalled + 1 and eng.launches == launches + 1
    for p, h, r in zip(ps, heads, running):
        assert h + list(r) == one.generate_greedy(p, 30)


@emu_only
def test_an_idle_resident_launch_hands_the_gpu_back_to_forward_logits_and_close(tiny):
    """idle_s > 0 keeps an empty launch waiting for joins; forward_logits (which needs the GPU) and close()
    must not wait out that idle time."""
    from replicas.monokernel_batched import BatchedMonokernelEngine
    from replicas.monokernel_emu_batch import EmuBatchGpu
    from replicas.monokernel_prefill import Prefill

    cfg, tensors, one = tiny
    gpu = EmuBatchGpu(cfg, tensors, 4, resident=True)
    eng = BatchedMonokernelEngine.around(cfg, gpu, lambda view: Prefill(view, np), idle_s=600.0)
    rng = np.random.default_rng(47)
    ps = [rng.integers(0, cfg.vocab_size, 7).tolist() for _ in range(3)]
    # (a's budget stays under SWITCH_MIN_TOKENS once b ends, so the launch never hands a lone `a` to the single
    # build: with 40 tokens a loaded machine could see b end before a's cancel, and the launch left was a's single
    # one, not the idle resident launch this test needs)
    a = eng.generate(ps[0], greedy(12))
    next(a)
    b = eng.generate(ps[1], greedy(3))  # a batch launch of both (a yield of the single one)
    assert list(b) == one.generate_greedy(ps[1], 3)
    a.cancel()
    list(a)
    _wait(lambda: eng._running and not any(eng._slots) and not gpu.stream.done)  # empty, waiting for joins
    t0 = time.monotonic()
    seq = rng.integers(0, cfg.vocab_size, 20).tolist()
    got = eng.forward_logits(seq)
    assert time.monotonic() - t0 < 60 and got.shape == (20, cfg.vocab_size)
    assert np.abs(got - one.forward_logits(seq)).max() <= 1e-4 * np.abs(got).max()  # (a batch launch, 1 slot)
    c = eng.generate(ps[2], greedy(4))
    assert list(c) == one.generate_greedy(ps[2], 4)
    t0 = time.monotonic()
    eng.close()
    assert time.monotonic() - t0 < 30 and gpu.stream.done
