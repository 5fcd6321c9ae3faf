#!/usr/bin/env bash
# Issue 9, session 13, second call (~6 min): pair_norm is the batch default from hidden 4,096 now (layout_tuned.py
# PAIR_NORM_MIN_HIDDEN). Its first run on llama-3.1-8b as a default: the batch gpu tests on 8B (slots against the
# single engine and transformers), then the 8B table at B = 1, 2, 4, 8 with the roofline and the peer in the same run.
# Prediction (session 13's A/Bs): B = 4 ~203 tok/s per request (0.78-0.80 of B = 1), B = 8 ~170 (0.65).
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_session13b.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
MK_BATCH_TEST_PRESETS=llama-3.1-8b stage tb8 300 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider \
  tests/test_monokernel_batch_gpu.py
stage t8 230 python3 bench/batch.py --presets llama-3.1-8b --builds 8 --runs 2 --peer --out /tmp/t8
{ echo "total ${SECONDS}s"; cat /tmp/t8/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; grep -hE "passed|failed|Error" "$OUT"/tb8.log | tail -6
