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
