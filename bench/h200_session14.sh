#!/usr/bin/env bash
# Issue 9, session 14, one H200 (~9 min): fx_pack (csrc/mk_fx_pack.cuh: two slots per int64 accumulator word as
# 32-bit lanes of 2^-16, so the down's and O's atomics carry two slots each and the batch prologues read 4 instead
# of 8 bytes per element and slot). Correctness first (batch and resident gpu tests with it on, against the single
# engine and transformers), then A/Bs at full occupancy. Prediction (timeline of session 12, 1B B = 4 layer 58.3 us):
# the down's atomics + fold add ~-2.4 us, the two prologues ~-0.8, the O atomics ~-0.5 per layer: ~-3.5 us of 58
# -> +5-6% at 1B B = 4; more at B = 8 (twice the atomics and bytes); 8B alike.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_session14.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
MK_BATCH_TEST_LAYOUT=fx_pack=1 stage tb 110 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider \
  tests/test_monokernel_batch_gpu.py
MK_RESIDENT_TEST_LAYOUT=fx_pack=1 stage tr 100 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider \
  tests/test_monokernel_resident_gpu.py
stage ab4 80 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --runs 3 --out /tmp/a4 --variants fx_pack
stage ab8 75 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --runs 3 --out /tmp/a8 --variants fx_pack
stage ab84 90 python3 bench/batch.py --presets llama-3.1-8b --builds 4 --runs 3 --out /tmp/b4 --variants fx_pack
stage ab88 80 python3 bench/batch.py --presets llama-3.1-8b --builds 8 --runs 2 --out /tmp/b8 --variants fx_pack
{ echo "total ${SECONDS}s"; cat /tmp/a4/batch.md /tmp/a8/batch.md /tmp/b4/batch.md /tmp/b8/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; grep -hE "passed|failed|Error" "$OUT"/tb.log "$OUT"/tr.log | tail -6
grep -h '"delta"' "$OUT"/ab*.log
