#!/usr/bin/env bash
# Where a B = 4 step's time goes, default batch build vs mma_mlp (llama-3.2-1b, 4 requests), and the B = 1
# engine: bench/timeline_probe.py per-segment block means (one H200, ~3 min).
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=400, command="bash bench/h200_timeline_mlp.sh")
set -u
DEADLINE=${DEADLINE:-380}
. bench/device_stage.sh
stage tl_b1 100 python3 bench/timeline_probe.py --out /tmp/tl1
stage tl_b4 120 python3 bench/timeline_probe.py --batch 4 --requests 4 --out /tmp/tl4
stage tl_b4_mlp 120 python3 bench/timeline_probe.py --batch 4 --requests 4 --options '{"mma_mlp": true}' --out /tmp/tl4m
{ echo "total ${SECONDS}s"; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
