#!/usr/bin/env bash
# Issue 9, session 17, fifth call (~3 min; the session's last 286 s of device time: no table). Call 4: with the row staging on the scheduler's thread, the worker still
# started the prefill 0.1-0.5 ms after the pick (the thread handoff waits for the GIL), and the session test's turn 2
# waited 4.4 s for the running launch to end (a relaunch) since call 3's linear_add (reverted here: back to call 2's
# split-K sums, which passed 10/10). Now a join whose prefill graph is captured is queued by the scheduler itself
# (row, replay, hidden-state copy, event) and published when its event is done: no worker, no handoff.
# Predictions: resident gpu tests 10/10; the pick -> publish path has no thread handoff; beyond the prefill less the
# idle engine's ~0.7 ms median (call 4: ~1.0 in the timeline, +1.12 in batch.py).
# (The batch.py resident table with its peer is not re-run: the kernel is unchanged since call 1.)
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=185, command="DEADLINE=180 bash bench/h200_session17e.sh")
set -u
DEADLINE=${DEADLINE:-180}
. bench/device_stage.sh
stage tr 120 python3 -m pytest -q -m gpu $PT -p no:cacheprovider tests/test_monokernel_resident_gpu.py
stage jt 40 python3 bench/join_timeline.py --joins 14 --out /tmp/jt
{ echo "total ${SECONDS}s"; grep -E "passed|failed|Error|single launches" "$OUT/tr.log" | tail -n 6; tail -n 1 "$OUT/jt.log"; } >> "$OUT/summary.txt"
cp -r /tmp/jt "$OUT/jt" 2>/dev/null
cat "$OUT/summary.txt"
