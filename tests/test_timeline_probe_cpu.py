"""bench/timeline_probe.py's analysis on a synthetic timeline with known answers (the probe build itself
runs on the GPU: csrc/mk_timeline.cuh)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.timeline_probe import MARKS, report, summarize  # noqa: E402


def synthetic(grid=8, steps=4, layers=3, late_block=5, late_ns=2000):
    """Every mark 1 µs after the previous one, block `late_block` arriving late_ns late at the O barrier
    (mark 9) and every block leaving each barrier 700 ns after the last arrival."""
    ts = np.zeros((grid, steps, layers + 1, MARKS), np.uint64)
    t = 10_000_000
    for s in range(steps):
        for layer in range(layers):
            row = np.zeros((grid, MARKS))
            for m in range(MARKS):
                row[:, m] = t
                if m == 9:
                    row[late_block, m] += late_ns
                if m in (3, 10, 15):  # barrier exits: 700 ns after the last arrival
                    row[:, m] = row[:, m - 1].max() + 700
                t = int(row[:, m].max()) + 1000
            row[grid // 2:, 4:8] = 0  # half the blocks have no attention item
            ts[:, s, layer] = row.astype(np.uint64)
        ts[:, s, layers, :6] = np.arange(6)[None] * 1000 + t
        t += 10_000
    return ts


def test_the_late_block_and_the_release_latency_come_out():
    s = summarize(synthetic(), 3)
    o = s["barriers"]["o"]
    assert abs(o["arrival_spread_us"] - 2.0) < 1e-6 and abs(o["release_latency_us"] - 0.7) < 1e-6
    assert max(o["last_arrivers"], key=o["last_arrivers"].get) == 5 and o["last_arrivers"][5] == 4 * 3
    seg = s["segments_us"]
    assert seg["attn gather"]["blocks"] == 4 and seg["o wait+stage (no attn item)"]["blocks"] == 4
    assert seg["o matvec"]["slowest_blocks"][0] == 5 and abs(seg["o matvec"]["max"] - 3.0) < 1e-6
    text = report(s)
    assert "barrier o: arrival spread 2.0 us, release 0.7 us" in text and "lm matvec" in text
