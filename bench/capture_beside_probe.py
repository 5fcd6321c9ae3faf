"""Where a prefill graph's first capture waits beside a running resident launch (issue 9; csrc/NOTES.md "Joins after
session 18").

    python bench/capture_beside_probe.py [--out DIR]
    MK_PREFILL_FUSED=1 python bench/capture_beside_probe.py ...

A session's next turn prefills only its suffix (start > 0), and its (rows, keys) graph shape is usually new, so it is
captured at first use, beside the launch. In session 18 that turn waited ~0.5 s for the launch (the stall guard's
relaunch) with the fused prefill passes on, and not without them; session 17's linear_add did the same. This probe
runs PrefillGraphs' capture steps for a few such shapes into slot 7 of a resident B = 8 launch of llama-3.2-1b
(random weights) with 7 requests running, and times each on the host: begin_capture, the forward's issue, end_capture
(instantiation included), then the replay on the prefill stream; with the graph pool's bytes before and after, and
whether the launch was still the same one afterwards (a step that waits for the launch shows as seconds here).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (cached positions, new tokens): session suffixes whose graph shapes the engine's warm-up does not capture
SHAPES = ((300, 40), (700, 40), (120, 200))


def capture_steps(cp, eng, slot: int, start: int, new: int) -> dict:
    """One first capture + replay of ids[start:] into `slot`, step by step (host ms), in a thread of its own in the
    joins' GEMM mode on the prefill stream, as a join's worker runs it."""
    from replicas.monokernel_blas import use_gemm_mode
    from replicas.monokernel_prefill import Positions
    from replicas.prefill_graph import graph_shape, pack_inputs

    pre, gpu, res = eng._prefill[slot], eng.gpu, {"start": start, "new": new}

    def run():
        use_gemm_mode(eng._joiner.mode or "tensor")
        graphs = pre.graphs
        shape = graph_shape(new, start, graphs.max_context, graphs.heads)
        res["rows"], res["keys"] = shape.rows, shape.keys
        ids = [(11 + 7 * i) % eng.config.vocab_size for i in range(start + new)]
        with cp.cuda.Device(gpu.device), gpu.prefill_stream:
            s = graphs.arena.stream  # the capture stream the engine's own captures use
            pos = Positions(start=0, count=shape.rows, rows=shape.rows, keys=shape.keys, dyn=graphs.inputs[:2])
            res["pool_mb_before"] = round(graphs.pool.total_bytes() / 1e6, 1)
            t0 = time.perf_counter()
            with cp.cuda.using_allocator(graphs.pool.malloc), s:
                s.begin_capture()
                t1 = time.perf_counter()
                try:
                    x = pre.forward(graphs.inputs[2:2 + shape.rows], pos)
                finally:
                    t2 = time.perf_counter()
                    graph = s.end_capture()
            t3 = time.perf_counter()
            graphs.inputs[:2 + shape.rows].set(pack_inputs(ids, start, shape.rows))
            graph.launch()
            last = x[new - 1].copy()
            gpu.prefill_stream.synchronize()
            t4 = time.perf_counter()
            res["pool_mb_after"] = round(graphs.pool.total_bytes() / 1e6, 1)
            res["ms"] = {"begin_capture": round(1e3 * (t1 - t0), 3), "forward_issue": round(1e3 * (t2 - t1), 3),
                         "end_capture": round(1e3 * (t3 - t2), 3), "replay": round(1e3 * (t4 - t3), 3)}
            res["finite"] = bool(cp.isfinite(last).all())
    t = threading.Thread(target=run)
    t.start()
    t.join()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import cupy as cp

    from bench.prefill_beside_probe import Running

    run = Running(cp)
    eng = run.eng
    out = {"join_mode": eng._joiner.mode if eng._joiner else None, "fused": eng._prefill[7].fused, "beside": []}
    for start, new in SHAPES:
        launches = eng.launches
        row = capture_steps(cp, eng, 7, start, new)
        row["same_launch_after"] = eng.launches == launches and bool(eng._resident_launch)
        out["beside"].append(row)
        print(json.dumps(row), flush=True)
    run.stop()
    print(json.dumps(out, indent=1), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "capture_beside.json").write_text(json.dumps(out, indent=1))
    eng.close()


if __name__ == "__main__":
    main()
