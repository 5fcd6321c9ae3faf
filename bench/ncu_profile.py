"""Where the monokernel's warps stall: one decode launch under Nsight Compute's PC sampling.

    ncu --clock-control none --profile-from-start off --kernel-name monokernel --launch-count 2 \
        --section WarpStateStats --section SourceCounters -f -o $OUT/prof \
        python3 bench/ncu_profile.py --preset llama-3.2-1b --batch 1
    python3 bench/ncu_profile.py --report $OUT/prof.ncu-rep --out $OUT/stalls.json

The first form builds the engine on random weights (MK_NVRTC_EXTRA=-lineinfo for source lines),
warms it up (compile, first launch), then opens the profiler range for one generation (batch > 1:
that many requests started together on the batched engine of build B). The second form reads the
report with ncu's Python module and writes each SASS instruction's sampled stall reasons with its
source line of the assembled kernel (replicas.monokernel_build.kernel_source()).
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run(preset: str, batch: int, tokens: int, layout: str = "") -> None:
    import cupy as cp

    from bench.decode import ab_options, random_tensors, time_generation
    from replicas.checkpoint import preset_config

    config = preset_config(preset)
    tensors = random_tensors(cp, config)
    prompt = [(100 + i * 7) % config.vocab_size for i in range(32)]
    opts = ab_options(layout) if layout else None
    if batch == 1:
        from replicas.monokernel import MonokernelEngine
        eng = MonokernelEngine(config, tensors, max_context=2048, layout_options=opts)
        go = lambda: time_generation(eng, prompt, tokens)  # noqa: E731
    else:
        from bench.batch import run_together
        from replicas.monokernel_batched import BatchedMonokernelEngine
        eng = BatchedMonokernelEngine(config, tensors, batch=batch, max_context=2048, layout_options=opts)
        ps = [[(100 + 37 * k + i) % config.vocab_size for i in range(32)] for k in range(batch)]
        go = lambda: run_together(eng, ps, tokens)  # noqa: E731
    go()
    go()
    cp.cuda.Device().synchronize()
    cp.cuda.profiler.start()
    go()
    cp.cuda.Device().synchronize()
    cp.cuda.profiler.stop()
    print("profiled", preset, "batch", batch, flush=True)


def read(report: str, out: str) -> None:
    for d in sorted(glob.glob("/opt/nvidia/nsight-compute/*/extras/python")) + sorted(
            glob.glob("/usr/local/cuda*/nsight-compute*/extras/python")):
        sys.path.insert(0, d)
    import ncu_report

    ctx = ncu_report.load_report(report)
    res = []
    for r in range(ctx.num_ranges()):
        rng = ctx.range_by_idx(r)
        for a in range(rng.num_actions()):
            act = rng.action_by_idx(a)
            entry = {"kernel": act.name(), "metrics": {}, "per_pc": {}}
            for name in act.metric_names():
                m = act.metric_by_name(name)
                try:
                    n = m.num_instances()
                except Exception:  # noqa: BLE001
                    n = 0
                if n == 0:
                    try:
                        v = m.as_double()
                    except Exception:  # noqa: BLE001
                        v = m.as_string()
                    if any(k in name for k in ("pcsamp", "warp", "duration", "dram__", "lts__", "sm__thr", "gpu__time",
                                               "stall", "launch__", "smsp__inst")):
                        entry["metrics"][name] = v
                    continue
                if "pcsamp" not in name and "inst_executed" not in name:
                    continue
                corr = m.correlation_ids()
                for i in range(n):
                    pc = corr.as_uint64(i)
                    v = m.as_uint64(i)
                    if v:
                        entry["per_pc"].setdefault(str(pc), {})[name] = v
            for pc in list(entry["per_pc"]):
                info = entry["per_pc"][pc]
                try:
                    info["sass"] = act.sass_by_pc(int(pc))
                except Exception:  # noqa: BLE001
                    pass
                try:
                    si = act.source_info(int(pc))
                    info["line"] = si.line()
                    info["file"] = si.file_name()
                except Exception:  # noqa: BLE001
                    pass
            res.append(entry)
    Path(out).write_text(json.dumps(res))
    print("wrote", out, [len(e["per_pc"]) for e in res])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--layout", default="", help="layout options (bench/decode.py --ab syntax)")
    ap.add_argument("--report", default="")
    ap.add_argument("--out", default="stalls.json")
    args = ap.parse_args()
    if args.report:
        read(args.report, args.out)
    else:
        run(args.preset, args.batch, args.tokens, args.layout)


if __name__ == "__main__":
    main()
