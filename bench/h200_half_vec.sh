#!/usr/bin/env bash
# Issue 9, one H200 (~8 min): layout options half_vec (all-tensor-core batch builds stage their bf16 slot inputs in
# half the shared memory; the weight ring gets the rest: 8B B = 8 9 -> 17 slots per warp, 1B B = 8 17 -> 21, 1B
# B = 4 23 -> 25) and block_best (the LM head's warp bests merged per block: sample + emit reads 132 per slot, not
# 2,112; 10.3 us per B = 4 step in session 11) A/B on the batch defaults, same weights, A B A B; then the batch gpu
# tests with both. fold_x (the residual kept in the int64 accumulators: the prologues read 8 of 12 bytes per element
# and slot) is A/B'd on 1B. Keep what wins on both models with the tests passing (layout_tuned.TUNED_BATCH). (A B = 8
# 8B A/B takes > 95 s.)
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_half_vec.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
stage ab8b8 220 python3 bench/batch.py --presets llama-3.1-8b --builds 8 --runs 3 --out /tmp/r8 --variants half_vec block_best
stage ab1b 200 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --runs 3 --out /tmp/r1 --variants half_vec block_best fold_x half_vec+block_best+fold_x
MK_BATCH_TEST_LAYOUT=half_vec=1,block_best=1,fold_x=1 stage tests 120 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider \
  tests/test_monokernel_batch_gpu.py -k "tiny or llama"
{ echo "total ${SECONDS}s"; cat /tmp/r8/batch.md /tmp/r1/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; grep -hE "passed|failed|Error" "$OUT"/tests.log | tail -6
