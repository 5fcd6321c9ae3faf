#!/usr/bin/env bash
# Issue 9, session 19, seventh call (~1.5 min). Calls 6/6b: while the tiny session test's turn 2 sits 0.5 s in
# end_capture, every other thread is idle (no GIL holder) and no garbage collection runs: the wait is inside
# cudaStreamEndCapture / cudaGraphInstantiate. Call 5's probe saw no wait for any fused subset at other shapes.
# This captures the test's exact turn-2 shape (start 315, 41 new tokens: rows 64, keys 512) in the join worker's
# thread on the prefill stream, inside a tiny resident launch: all fused, none, all again.
# Prediction: all fused waits (~the launch's idle_s, 2 s) at this shape, none does not; if nothing waits, the test's
# preceding steps (session store / restore, the turn-1 replay) are part of the cause.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=120, command="DEADLINE=110 bash bench/h200_session19g.sh")
set -u
DEADLINE=${DEADLINE:-110}
. bench/device_stage.sh
stage ib2 90 python3 bench/instantiate_beside_probe.py --turn2 --out /tmp/ib2
{ echo "total ${SECONDS}s"; grep -E '^\{"(kernels|ops)' "$OUT/ib2.log"; grep -iE "error|Trace" "$OUT/ib2.log" | tail -n 3; } >> "$OUT/summary.txt"
