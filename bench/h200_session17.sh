#!/usr/bin/env bash
# Issue 9, session 17, first call (~8 min): where a resident join's time goes beyond its prefill (target <= 1 ms;
# session 16: +1.36 ms median, worst +2.44, at B = 8 with 7 running), then the tables on the session-16 defaults
# with their peer (session 16's last call lost its peer to the stage limit) and the 8B batch gpu tests with best_max.
# Predictions: publish -> acknowledgement ~U[0, step] (median ~0.6 ms of a 1.17 ms step), acknowledgement -> first
# token ~0.2 ms (LM head, sampling, the drain), prepare_join < 0.2 ms; 1B at 4 ~0.79 of B = 1; resident B = 1 ~0.99.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_session17.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
stage jt 70 python3 bench/join_timeline.py --joins 14 --out /tmp/jt
stage t1 110 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --runs 2 --peer --out /tmp/t1
stage r8 110 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --resident --peer --out /tmp/r8
MK_BATCH_TEST_PRESETS=llama-3.1-8b stage t8 200 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider \
  tests/test_monokernel_batch_gpu.py
{ echo "total ${SECONDS}s"; tail -n 2 "$OUT/t8.log"; tail -n 1 "$OUT/jt.log"; cat /tmp/t1/batch.md /tmp/r8/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cp -r /tmp/jt "$OUT/jt" 2>/dev/null; cp /tmp/t1/batch.json "$OUT/t1.json" 2>/dev/null; cp /tmp/r8/batch.json "$OUT/r8.json" 2>/dev/null
cat "$OUT/summary.txt"
