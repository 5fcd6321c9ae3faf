#!/usr/bin/env bash
# Session 11's one-H200 call (issue 9 batch speed; x2 was not lent): the mma_o / mma_qkv A/B and their batch gpu
# tests (bench/h200_batch_tc_next.sh), then the per-segment timelines (bench/h200_timeline_mlp.sh).
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_session11.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
stage ab 170 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --runs 3 --out /tmp/q \
  --variants mma_o mma_qkv mma_qkv+mma_o
MK_BATCH_TEST_LAYOUT=mma_qkv=1,mma_o=1 stage tests 130 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider \
  tests/test_monokernel_batch_gpu.py -k "tiny or llama"
stage tl_b1 80 python3 bench/timeline_probe.py --out /tmp/tl1
stage tl_b4 80 python3 bench/timeline_probe.py --batch 4 --requests 4 --out /tmp/tl4
stage tl_b4_qkv_o 80 python3 bench/timeline_probe.py --batch 4 --requests 4 --options '{"mma_qkv": true, "mma_o": true}' \
  --out /tmp/tl4m
{ echo "total ${SECONDS}s"; cat /tmp/q/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; grep -hE "passed|failed|Error" "$OUT"/tests.log | tail -4
