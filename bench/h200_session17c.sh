#!/usr/bin/env bash
# Issue 9, session 17, third call (~4.5 min). Call 2 found the join's row staging (pageable copies) taking 0.2-0.8 ms
# before the prefill, on the critical path; it is now two async copies from pinned staging. The mma join GEMM's
# split-K parts are summed straight into the residual for o and down (linear_add: one kernel, not a sum then an add).
# Predictions: stage_join < 0.05 ms; the join's prefill beside the launch 9.04 -> ~8.5 ms (32 fewer kernels);
# beyond the prefill less the idle engine's ~0.6 ms median (call 2: ~1.05 in the timeline, +0.81 in batch.py).
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=420, command="DEADLINE=400 bash bench/h200_session17c.sh")
set -u
DEADLINE=${DEADLINE:-400}
. bench/device_stage.sh
stage pg 60 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider tests/test_prefill_gemm_gpu.py
stage tr 120 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider tests/test_monokernel_resident_gpu.py
stage jt 60 python3 bench/join_timeline.py --joins 14 --out /tmp/jt
stage r8 90 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --resident --peer --out /tmp/r8
{ echo "total ${SECONDS}s"; tail -n 2 "$OUT/pg.log" "$OUT/tr.log"; tail -n 1 "$OUT/jt.log"; cat /tmp/r8/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cp -r /tmp/jt "$OUT/jt" 2>/dev/null; cp /tmp/r8/batch.json "$OUT/r8.json" 2>/dev/null
cat "$OUT/summary.txt"
