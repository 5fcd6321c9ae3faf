#!/usr/bin/env bash
# Issue 9, session 19, fifth call (~1.5 min). Calls 2-4: the tiny session test's turn 2 blocks 0.5 s in end_capture
# beside the resident launch with all three fused prefill passes, not with one alone, not unfused, warm or cold cache,
# eager module loading or not. bench/instantiate_beside_probe.py splits end_capture into cudaStreamEndCapture and
# cudaGraphInstantiate, for kernel chains of 1..300 nodes and each subset of the fused passes, beside a plain hold
# kernel and inside a real tiny resident launch.
# Prediction: the wait is in instantiate, for small graphs only (the all-fused tiny graph has the fewest nodes), beside
# both the hold and the launch; chains show a node-count threshold.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=200, command="DEADLINE=190 bash bench/h200_session19e.sh")
set -u
DEADLINE=${DEADLINE:-190}
. bench/device_stage.sh
stage ib 150 python3 bench/instantiate_beside_probe.py --out /tmp/ib
{ echo "total ${SECONDS}s"; grep -E '^\{"(kernels|ops)' "$OUT/ib.log"; tail -n 5 "$OUT/ib.log" | grep -iE "error|Trace" ; } >> "$OUT/summary.txt"
