#!/usr/bin/env bash
# Session 11's second one-H200 call (issue 9): the batched engine's new defaults (TUNED_BATCH + mma_qkv + mma_o,
# reduce_best_slots and the batched emit): batch gpu tests, the 8B A/B of mma_qkv + mma_o, the B = 4 timeline
# (sample + emit was 14.3 us per step), the 1B occupancy table with the peer.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_session11b.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
stage tests 130 python3 -m pytest -q -m gpu $PT -p no:cacheprovider tests/test_monokernel_batch_gpu.py -k "tiny or llama"
stage tl_b4 60 python3 bench/timeline_probe.py --batch 4 --requests 4 --out /tmp/tl4
stage ab8b 150 python3 bench/batch.py --presets llama-3.1-8b --builds 4 --runs 3 --out /tmp/q8 --variants mma_qkv=0+mma_o=0
stage table1b 200 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --runs 2 --peer --out /tmp/t1
{ echo "total ${SECONDS}s"; cat /tmp/q8/batch.md /tmp/t1/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; grep -hE "passed|failed|Error" "$OUT"/tests.log | tail -6
