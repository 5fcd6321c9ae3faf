"""Per-block timeline of the monokernel's phases (llama-3.2-1b shape, random weights, one GPU).

    python bench/timeline_probe.py [--preset llama-3.2-1b] [--options '{"batch": 4}'] --out $OUT/tl

Builds the engine's default layout with -DMK_TIMELINE=1 (csrc/mk_timeline.cuh: thread 0 of every block
stores %globaltimer at 16 marks per layer for 64 decode steps), runs one greedy generation and prints,
per segment between marks, the mean over blocks and the spread of the per-block means (p10 / p50 /
p90 / max), and per grid barrier the arrival spread (last minus first block), the release latency
(last arrival to first exit) and which blocks arrive last. Writes timeline.json (and the raw marks as
timeline.npy) under --out. Probe builds only: the marks cost a few stores per phase.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STEP0, STEPS, MARKS, BASE = 32, 64, 16, 16  # csrc/mk_timeline.cuh defaults
LAYER_MARKS = ["layer start", "qkv prologue", "qkv arrive", "qkv exit", "attn q/k/v gathered", "attn roped",
               "attn tiles done", "attn published", "o inputs staged", "o arrive", "o exit", "mlp prologue",
               "gate/up done", "down done", "mlp arrive", "mlp exit"]
# (name, from mark, to mark); attention marks exist only on blocks with an attention item
SEGMENTS = [("qkv prologue", 0, 1), ("qkv matvec", 1, 2), ("qkv barrier", 2, 3), ("attn gather", 3, 4),
            ("attn rope", 4, 5), ("attn tiles", 5, 6), ("attn publish", 6, 7), ("o wait+stage (after attn)", 7, 8),
            ("o wait+stage (no attn item)", 3, 8), ("o matvec", 8, 9), ("o barrier", 9, 10),
            ("mlp prologue", 10, 11), ("gate/up", 11, 12), ("down", 12, 13), ("down atomics", 13, 14),
            ("mlp barrier", 14, 15)]
BARRIERS = [("qkv", 2, 3), ("o", 9, 10), ("mlp", 14, 15)]
LM_SEGMENTS = [("lm prologue", 0, 1), ("lm matvec", 1, 2), ("lm barrier", 2, 3), ("sample+emit", 3, 4),
               ("embed prologue", 4, 5), ("sample: bests reduced", 3, 6), ("sample: stop checks + emit", 6, 7),
               ("sample: to the layers", 7, 4)]  # (marks 6, 7: batch builds only)


def summarize(ts: np.ndarray, layers: int) -> dict:
    """ts: [grid, steps, layers + 1, MARKS] ns (0 = not recorded)."""
    grid = ts.shape[0]
    lay = ts[:, :, :layers].astype(np.float64)  # [grid, steps, layers, marks]
    out: dict = {"grid": grid, "steps": ts.shape[1], "segments_us": {}, "barriers": {}, "lm_us": {}}

    def seg(arr, a, b, skip_layer0=False):
        x, y = arr[..., a], arr[..., b]
        ok = (x > 0) & (y > 0)
        if skip_layer0:
            ok[:, :, 0] = False
        d = np.where(ok, (y - x) / 1e3, np.nan)
        with warnings.catch_warnings():  # blocks without any sample of this segment: NaN, dropped below
            warnings.simplefilter("ignore", RuntimeWarning)
            per_block = np.nanmean(d.reshape(grid, -1), axis=1)
        have = ~np.isnan(per_block)
        if not have.any():
            return None
        pb = per_block[have]
        return {"mean": round(float(np.nanmean(d)), 3), "blocks": int(have.sum()),
                "per_block": [None if np.isnan(v) else round(float(v), 3) for v in per_block],
                "p10": round(float(np.percentile(pb, 10)), 3), "p50": round(float(np.percentile(pb, 50)), 3),
                "p90": round(float(np.percentile(pb, 90)), 3), "max": round(float(pb.max()), 3),
                "slowest_blocks": [int(i) for i in np.flatnonzero(have)[np.argsort(-pb)[:6]]]}

    for name, a, b in SEGMENTS:
        arr = lay
        if name.endswith("(no attn item)"):  # blocks that never published a split
            arr = np.where((lay[..., 7] == 0)[..., None], lay, 0)
        r = seg(arr, a, b, skip_layer0=name == "qkv prologue")
        if r:
            out["segments_us"][name] = r
    for name, a, b in LM_SEGMENTS:
        r = seg(ts[:, :, layers:layers + 1].astype(np.float64), a, b)
        if r:
            out["lm_us"][name] = r
    for name, arr_m, exit_m in BARRIERS:
        arrive, leave = lay[..., arr_m], lay[..., exit_m]  # [grid, steps, layers]
        last = arrive.max(axis=0)
        spread = (last - arrive.min(axis=0)) / 1e3
        release = (leave.min(axis=0) - last) / 1e3
        exit_spread = (leave.max(axis=0) - leave.min(axis=0)) / 1e3
        late = np.bincount(arrive.argmax(axis=0).ravel(), minlength=grid)
        out["barriers"][name] = {
            "arrival_spread_us": round(float(spread.mean()), 3), "release_latency_us": round(float(release.mean()), 3),
            "exit_spread_us": round(float(exit_spread.mean()), 3),
            "last_arrivers": {int(i): int(late[i]) for i in np.argsort(-late)[:8]}}
    # the layer's critical path: MLP exit to MLP exit, from the median block's view
    ex = np.median(lay[..., 15], axis=0)  # [steps, layers]
    out["layer_us_median_block"] = round(float(np.mean(np.diff(ex, axis=1))) / 1e3, 3)
    return out


def report(s: dict) -> str:
    lines = [f"grid {s['grid']} blocks, {s['steps']} steps; layer (MLP exit to exit) {s['layer_us_median_block']} us; "
             f"probe build {s.get('tok_s_probe_build')} tok/s; block -> SM the same in both launches: "
             f"{s.get('smid_same_both_launches')}"]
    lines.append(f"{'segment':32s} {'mean':>7s} {'p10':>7s} {'p50':>7s} {'p90':>7s} {'max':>7s} blocks  slowest")
    for table in ("segments_us", "lm_us"):
        for name, r in s[table].items():
            lines.append(f"{name:32s} {r['mean']:7.2f} {r['p10']:7.2f} {r['p50']:7.2f} {r['p90']:7.2f} {r['max']:7.2f} "
                         f"{r['blocks']:5d}  {r['slowest_blocks']}")
    for name, b in s["barriers"].items():
        lines.append(f"barrier {name}: arrival spread {b['arrival_spread_us']} us, release {b['release_latency_us']} us, "
                     f"exit spread {b['exit_spread_us']} us, last arrivers {b['last_arrivers']}")
    return "\n".join(lines)


def run_together(eng, n: int, n_new: int) -> tuple[float, int]:
    """n greedy requests on the batched engine at once: (seconds from the last first token to the end, tokens
    of one request)."""
    import threading
    import time

    from replicas.engine import SamplingParams

    q = SamplingParams(max_tokens=n_new, ignore_eos=True)
    gens = [eng.generate([(100 + 37 * k + i) % 1000 for i in range(32)], q) for k in range(n)]
    firsts = [next(g) for g in gens]
    t0, counts = time.perf_counter(), [1] * n

    def drain(k):
        counts[k] += sum(1 for _ in gens[k])

    threads = [threading.Thread(target=drain, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    del firsts
    return time.perf_counter() - t0, min(counts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--options", default="{}", help="layout options (JSON) on top of the engine default")
    ap.add_argument("--batch", type=int, default=1,
                    help="B > 1: the batched engine (B slots), with --requests of them decoding together")
    ap.add_argument("--requests", type=int, default=0, help="concurrent requests on the batched engine (default B)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    os.environ["MK_NVRTC_EXTRA"] = (os.environ.get("MK_NVRTC_EXTRA", "") + " -DMK_TIMELINE=1").strip()
    import cupy as cp

    from bench.decode import random_tensors, time_generation
    from replicas.checkpoint import preset_config
    from replicas.monokernel import MonokernelEngine

    config = preset_config(args.preset)
    opts = json.loads(args.options) or None
    if args.batch > 1:
        from replicas.monokernel_batched import BatchedMonokernelEngine

        eng = BatchedMonokernelEngine(config, random_tensors(cp, config), batch=args.batch, max_context=4096,
                                      layout_options=opts)
    else:
        eng = MonokernelEngine(config, random_tensors(cp, config), max_context=4096, layout_options=opts)
    prompt = list(range(100, 132))
    time_generation(eng, prompt, 32)  # compile + warm-up
    grid, layers = eng.gpu.layout.num_sms, config.num_hidden_layers
    rows = grid * STEPS * (layers + 1) * MARKS
    smids = []
    for _ in range(2):  # a second launch: does every block land on the same SM again?
        eng.profile = cp.zeros(BASE + rows + grid, cp.uint64)
        if args.batch > 1:  # the requests join within the first steps; the launch holding all of them records
            dt, n = run_together(eng, args.requests or args.batch, STEP0 + STEPS + 8)
        else:
            dt, n, _ = time_generation(eng, prompt, STEP0 + STEPS + 8)
        smids.append(cp.asnumpy(eng.profile[BASE + rows:]).astype(int).tolist())
    ts = cp.asnumpy(eng.profile[BASE:BASE + rows]).reshape(grid, STEPS, layers + 1, MARKS)
    eng.profile = None
    s = summarize(ts, layers)
    s.update(preset=args.preset, options=json.loads(args.options), batch=args.batch,
             requests=(args.requests or args.batch) if args.batch > 1 else 1, tok_s_probe_build=round((n - 1) / dt, 1),
             smid=smids[-1], smid_same_both_launches=smids[0] == smids[1])
    args.out.mkdir(parents=True, exist_ok=True)
    np.save(args.out / "timeline.npy", ts)
    (args.out / "timeline.json").write_text(json.dumps(s, indent=1))
    text = report(s)
    (args.out / "timeline.txt").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
