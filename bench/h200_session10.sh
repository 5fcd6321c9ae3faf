#!/usr/bin/env bash
# Session 10's last call (issue 9), ONE H200: the batched engine's new defaults (layout_tuned.TUNED_BATCH: the MLP
# and the LM head on tensor cores, norm_once):
#   1. the batch gpu tests on those defaults (tiny and llama-3.2-1b: slots vs the single engine and transformers)
#   2. the occupancy table, llama-3.2-1b and llama-3.1-8b, B = 8 engine with its B = 2 / 4 builds, 1 / 2 / 4 / 8
#      requests, copy bandwidth and the transformers peer in the same run
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_session10.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
stage tests 120 python3 -m pytest -q -m gpu $PT -p no:cacheprovider tests/test_monokernel_batch_gpu.py -k "tiny or llama"
stage table 400 python3 bench/batch.py --presets llama-3.2-1b llama-3.1-8b --builds 8 --runs 2 --peer --out /tmp/s10
{ echo "total ${SECONDS}s"; cat /tmp/s10/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; grep -hE "passed|failed|Error" "$OUT"/tests.log | tail -6
