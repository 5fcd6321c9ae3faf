#!/usr/bin/env bash
# Issue 9, session 15, first call (~9 min): the checks session 14 left waiting (csrc/NOTES.md "Device calls
# waiting" item 2). The batch gpu tests on an 8-slot engine (1B's B = 8 build pairs its blocks by default since
# de39596), the resident gpu tests with pair_norm, the resident 1B B = 8 table with pair_norm (joins too), and the
# 1B occupancy table with the per-build pair_norm rule, the transformers peer in the same run.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_session15.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
MK_BATCH_TEST_SLOTS=8 stage bt8 170 python3 -m pytest -q -x $PT -m gpu tests/test_monokernel_batch_gpu.py
MK_RESIDENT_TEST_LAYOUT=pair_norm=1 stage rtp 120 python3 -m pytest -q -x $PT -m gpu tests/test_monokernel_resident_gpu.py
stage t1 140 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --runs 2 --peer --out /tmp/t1
stage r8 140 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --resident --peer --layout pair_norm=1 --out /tmp/r8
{ echo "total ${SECONDS}s"; tail -n 2 "$OUT/bt8.log" "$OUT/rtp.log"; cat /tmp/t1/batch.md /tmp/r8/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cp -r /tmp/r8 "$OUT/r8" 2>/dev/null
cat "$OUT/summary.txt"
