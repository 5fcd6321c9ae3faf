"""When does a CUDA graph's capture or instantiation wait for a kernel running beside it? (issue 9; csrc/NOTES.md
"Joins after session 19")

    python bench/instantiate_beside_probe.py [--out DIR]

Session 19 found a session suffix's first prefill graph on the tiny model blocking 0.5 s in end_capture beside a
resident launch, with all three fused prefill passes on (MK_PREFILL_FUSED) and with none of them alone. This times
cudaStreamEndCapture, cudaGraphInstantiate and the first launch separately, host-side, for:
  chains: N launches of one trivial kernel beside a plain kernel holding 116 SMs (bench's hold kernel, 0.4 s);
  hold:   the tiny model's prefill graphs beside that hold, for each subset of the fused passes;
  launch: the same inside a real resident B = 8 launch of the tiny model (3 requests decoding).
A step that waits for the kernel beside it shows as ~its remaining time (hundreds of ms), or as `waited`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SUBSETS = [frozenset(c) for n in range(4) for c in itertools.combinations(("rms", "kv", "add"), n)]
_ADD1 = r'extern "C" __global__ void probe_add1(float* x, int n) { int i = blockIdx.x * 256 + threadIdx.x; if (i < n) x[i] += 1.f; }'


def timed_capture(cp, stream, issue) -> dict:
    """Capture issue() on `stream` (relaxed mode), then end, instantiate and launch it once: host ms per step."""
    rt = cp.cuda.runtime
    t0 = time.perf_counter()
    stream.begin_capture()
    try:
        issue()
    finally:
        t1 = time.perf_counter()
        graph = rt.streamEndCapture(stream.ptr)
    t2 = time.perf_counter()
    exe = rt.graphInstantiate(graph)
    t3 = time.perf_counter()
    rt.graphLaunch(exe, stream.ptr)
    stream.synchronize()
    t4 = time.perf_counter()
    rt.graphExecDestroy(exe)
    rt.graphDestroy(graph)
    return {"issue": round(1e3 * (t1 - t0), 2), "end_capture": round(1e3 * (t2 - t1), 2),
            "instantiate": round(1e3 * (t3 - t2), 2), "launch+run": round(1e3 * (t4 - t3), 2)}


def beside_hold(cp, sms: int, fn, hold_s: float = 0.4) -> dict:
    """fn() while a plain kernel holds `sms` SMs for up to hold_s; whether the hold still ran when it returned."""
    from replicas.concurrency_check import _hold_kernel

    kernel, smem = _hold_kernel(cp)
    busy = cp.cuda.Stream(non_blocking=True)
    stop = cp.zeros(1, cp.int32)
    cp.cuda.get_current_stream().synchronize()
    with busy:
        kernel((sms,), (32,), (stop, np.int64(int(hold_s * 1e9))), shared_mem=smem)
    time.sleep(0.005)
    row = fn()
    row["waited"] = bool(busy.done)
    stop.fill(1)
    busy.synchronize()
    return row


def chains(cp, sms: int) -> list:
    k = cp.RawKernel(_ADD1, "probe_add1")
    x = cp.zeros(1 << 16, cp.float32)
    k((256,), (256,), (x, np.int32(x.size)))  # loaded before any hold
    s = cp.cuda.Stream(non_blocking=True)
    out = []
    for n in (1, 3, 10, 30, 100, 300):
        def issue(n=n):
            with s:
                for _ in range(n):
                    k((256,), (256,), (x, np.int32(x.size)))
        out.append({"kernels": n, **beside_hold(cp, sms, lambda: timed_capture(cp, s, issue))})
        print(json.dumps(out[-1]), flush=True)
    return out


def prefill_capture(cp, pre, ops: frozenset, start: int, new: int) -> dict:
    """Capture slot prefill `pre`'s forward for (start, new) with fused passes `ops`, as PrefillGraphs does."""
    from replicas.monokernel_prefill import Positions
    from replicas.prefill_graph import graph_shape

    pre.fused_ops = ops
    g = pre.graphs
    shape = graph_shape(new, start, g.max_context, g.heads)
    s = cp.cuda.Stream(non_blocking=True)
    pos = Positions(start=0, count=shape.rows, rows=shape.rows, keys=shape.keys, dyn=g.inputs[:2])

    def issue():
        with cp.cuda.using_allocator(g.pool.malloc), s:
            pre.forward(g.inputs[2:2 + shape.rows], pos)
    row = {"ops": "+".join(sorted(ops)) or "none", "rows": shape.rows, "keys": shape.keys}
    row.update(timed_capture(cp, s, issue))
    return row


def shapes():
    """Distinct (start, new) session suffixes: a new graph shape for every capture."""
    for keys in (128, 256, 512, 1024, 2048):
        for new in (9, 20, 40, 100):
            start = keys // 2 + 1
            yield start, new


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--turn2", action="store_true", help="only the session test's turn-2 shape (start 315, 41 new "
                    "tokens) inside the launch: all fused, none, all again")
    args = ap.parse_args()
    import cupy as cp

    from replicas.checkpoint import make_checkpoint
    from replicas.engine import SamplingParams
    from replicas.monokernel_batched import BatchedMonokernelEngine
    from replicas.monokernel_blas import use_gemm_mode
    from replicas.monokernel_resident import PREFILL_SMS

    path = make_checkpoint("tiny", tempfile.mkdtemp(), seed=0, dtype="bf16")
    eng = BatchedMonokernelEngine.from_pretrained(path, batch=8, max_context=2048, resident=True, idle_s=2.0)
    sms = eng.gpu.layout.num_sms
    assert sms == eng.gpu.single_layout.num_sms - PREFILL_SMS
    out = {"sms_held": sms, "join_mode": eng._joiner.mode, "chains": [] if args.turn2 else chains(cp, sms)}
    use_gemm_mode(eng._joiner.mode or "tensor")
    it = shapes()
    pre = eng._prefill[7]
    out["hold"] = []
    every = frozenset(("rms", "kv", "add"))
    subsets = [every, frozenset(), every] if args.turn2 else SUBSETS
    if args.turn2:
        it = iter([(315, 41)] * 3)
    with cp.cuda.Device(eng.gpu.device):
        for ops in ([] if args.turn2 else SUBSETS):
            start, new = next(it)
            out["hold"].append(beside_hold(cp, sms, lambda: prefill_capture(cp, pre, ops, start, new)))
            print(json.dumps(out["hold"][-1]), flush=True)
    # inside a real resident launch: 3 requests decoding (slots 0-2), captures into slot 7
    gens = [eng.generate([(5 + 31 * k + i) % eng.config.vocab_size for i in range(20)],
                         SamplingParams(max_tokens=1900, ignore_eos=True)) for k in range(3)]
    for g in gens:
        next(g)
    out["launch"] = []
    with cp.cuda.Device(eng.gpu.device):
        for ops in subsets:
            start, new = next(it)
            launches = eng.launches
            if args.turn2:  # in the join worker's thread, on the prefill stream, as the engine's joins run
                def in_worker(ops=ops, start=start, new=new):
                    with cp.cuda.Device(eng.gpu.device), eng.gpu.prefill_stream:
                        return prefill_capture(cp, pre, ops, start, new)
                row = eng._joiner._pool.submit(in_worker).result()
            else:
                row = prefill_capture(cp, pre, ops, start, new)
            row["same_launch"] = eng.launches == launches and bool(eng._resident_launch)
            out["launch"].append(row)
            print(json.dumps(row), flush=True)
    for g in gens:
        g.cancel()
    print(json.dumps(out, indent=1), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "instantiate_beside.json").write_text(json.dumps(out, indent=1))
    eng.close()


if __name__ == "__main__":
    main()
