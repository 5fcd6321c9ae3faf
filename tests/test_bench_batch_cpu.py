"""bench/batch.py's measurement helpers on a stand-in engine (the device runs them on the GPU engines, where a
bug would cost a device call): the join sampler's arithmetic and the A/B's parting diagnostic."""

from __future__ import annotations

import threading
import time

import numpy as np

from bench import batch


class _Prefill:
    def __init__(self, seconds):
        self.seconds = seconds

    def run(self, ids, **_):
        time.sleep(self.seconds)
        return None


class SteppingEngine:
    """Tokens every `step` seconds; a request's first token comes `prefill` seconds after its submit plus the
    wait for the next step boundary (a join)."""

    def __init__(self, step=0.004, prefill=0.003):
        self.step, self._prefill, self.t0 = step, [_Prefill(prefill)], time.perf_counter()
        self.lock = threading.Lock()

    def generate(self, prompt, params):
        self._prefill[0].run(prompt)
        # wait for the next step boundary, then one token per step
        k = int((time.perf_counter() - self.t0) / self.step) + 1
        for i in range(params.max_tokens):
            time.sleep(max(0.0, self.t0 + (k + i) * self.step - time.perf_counter()))
            yield 7


def test_join_cost_reports_each_joins_wait_beyond_its_prefill():
    eng = SteppingEngine()
    res = batch.join_cost(eng, [1, 2, 3], [[4, 5]], n_new=150, joins=5)
    assert res["joins"] == 5 and len(res["join_overhead_beyond_prefill_all_ms"]) == 5
    assert res["running_throughout"]
    assert abs(res["step_ms"] - 4.0) < 1.5
    # an idle request waits for a boundary too, so the join adds ~0 beyond it here, never a whole extra step
    assert abs(res["join_overhead_beyond_prefill_ms"]) < 4.0
    assert res["join_overhead_beyond_prefill_max_ms"] == max(res["join_overhead_beyond_prefill_all_ms"])
    assert 2.5 <= res["prefill_joining_ms"] <= 6.0  # the stand-in's 3 ms prefill, found through _prefill


def test_partings_finds_the_first_differing_token_and_its_logit_gap():
    class Logits:
        def forward_logits(self, ids):
            row = np.zeros((len(ids), 10), np.float32)
            row[-1, :] = [0, 0, 9.9, 10, 0, 0, 0, 0, 0, 0]
            return row

    got = batch.partings(Logits(), [[1], [2]], [[3, 3, 3], [5, 3]], [[3, 3, 3], [5, 2]])
    assert got == [{"slot": 1, "step": 1, "gap": 0.01}]  # (10 - 9.9) / 10


class _FakeEvent:
    clock = [0.0]

    def record(self):
        self.t = self.clock[0]

    def synchronize(self):
        pass


def test_queued_replays_count_their_gpu_seconds_in_the_prefill_sums():
    """A join the resident scheduler queued (PrefillGraphs.replay_captured, not waited for) is timed by events
    and sums with the synchronous prefills' seconds, as join_cost's sums need."""
    from types import SimpleNamespace

    cp = SimpleNamespace(cuda=SimpleNamespace(Event=_FakeEvent, get_elapsed_time=lambda a, b: 1e3 * (b.t - a.t)))
    g = batch._GpuSeconds(cp)
    _FakeEvent.clock[0] = 0.009  # the replay ran 9 ms on the GPU
    g.end.record()
    assert abs(sum([0.002, g]) - 0.011) < 1e-12 and abs(sum([g]) - 0.009) < 1e-12 and float(g) == 0.009


def test_the_join_timeline_probe_on_the_emulated_resident_engine():
    """bench/join_timeline.py's probe on the kernel's CPU emulation (tiny model, B = 4, 3 running): every join
    enters the running launch, and each row carries the handover's stamps and its 'beyond the prefill'."""
    import platform
    import shutil
    import tempfile

    import pytest

    if shutil.which("g++") is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the CPU emulation needs g++ on x86-64")
    from bench.join_timeline import probe
    from replicas.checkpoint import make_checkpoint
    from replicas.model import ModelConfig
    from replicas.monokernel_batched import BatchedMonokernelEngine
    from replicas.monokernel_emu_batch import EmuBatchGpu
    from replicas.monokernel_prefill import Prefill
    from replicas.weights import load_weights

    path = make_checkpoint("tiny", tempfile.mkdtemp(), seed=0, dtype="bf16")
    cfg = ModelConfig.from_pretrained(path)
    eng = BatchedMonokernelEngine.around(cfg, EmuBatchGpu(cfg, load_weights(path, cfg, dtype="raw"), 4, resident=True),
                                         lambda view: Prefill(view, np))
    try:
        summary, joins, idle = probe(eng, cfg.vocab_size, 4, 2, 300)
    finally:
        eng.close()
    assert summary["resident_joins"] == 2 and len(joins) == 2 and len(idle) == 3
    for row in joins:
        labels = [what for _, what in row["timeline_ms"]]
        for want in ("picked start", "stage_join start", "prefill start", "publish end", "ack seen start",
                     "first token"):
            assert want in labels, (want, labels)
        assert 0 < row["prefill_ms"] < row["ttft_ms"] and row["beyond_prefill_ms"] > 0
        assert row["publish_to_ack_ms"] >= 0 and row["ack_to_token_ms"] > 0
    assert len(summary["join_beyond_prefill_less_idle_ms"]) == 2
