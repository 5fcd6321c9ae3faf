#!/usr/bin/env bash
# Where a B = 4 step's time goes (llama-3.2-1b, 4 requests): bench/timeline_probe.py per-segment block means of the
# B = 1 engine, the batched engine's defaults (layout_tuned.TUNED_BATCH since session 10; session 10 ran this with
# the CUDA-core defaults and with mma_mlp) and the defaults + mma_qkv + mma_o (one H200, ~1 min warm).
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=400, command="bash bench/h200_timeline_mlp.sh")
set -u
DEADLINE=${DEADLINE:-380}
. bench/device_stage.sh
stage tl_b1 100 python3 bench/timeline_probe.py --out /tmp/tl1
stage tl_b4 120 python3 bench/timeline_probe.py --batch 4 --requests 4 --out /tmp/tl4
stage tl_b4_qkv_o 120 python3 bench/timeline_probe.py --batch 4 --requests 4 --options '{"mma_qkv": true, "mma_o": true}' \
  --out /tmp/tl4m
{ echo "total ${SECONDS}s"; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
