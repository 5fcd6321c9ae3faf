#!/usr/bin/env bash
# Issue 9, session 12, one H200 (< 10 min): the batch defaults with fold_x (layout_tuned.TUNED_BATCH). Batch gpu tests,
# the 1B occupancy table with the peer, the resident 1B engine (7 joins at offsets spread over a step: median and
# worst cost beyond the joiner's prefill), the resident gpu tests, and where the 8B's greedy tokens part between
# fold_x and not (the logit gap there: a near tie or a bug).
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_session12b.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
stage tests 110 python3 -m pytest -q -m gpu $PT -p no:cacheprovider tests/test_monokernel_batch_gpu.py -k "tiny or llama"
stage table1b 170 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --runs 2 --peer --out /tmp/t1
stage res_bench 100 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --resident --runs 2 --out /tmp/res
stage res_tests 130 python3 -m pytest -q -m gpu $PT -p no:cacheprovider -rA tests/test_monokernel_resident_gpu.py
stage part8b 120 python3 bench/batch.py --presets llama-3.1-8b --builds 4 --runs 1 --out /tmp/p8 --variants fold_x=0
{ echo "total ${SECONDS}s"; cat /tmp/t1/batch.md /tmp/res/batch.md /tmp/p8/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cp /tmp/t1/batch.json "$OUT/t1.json" 2>/dev/null; cp /tmp/res/batch.json "$OUT/res.json" 2>/dev/null
cat "$OUT/summary.txt"; grep -hE "passed|failed|Error" "$OUT"/tests.log "$OUT"/res_tests.log | tail -8
