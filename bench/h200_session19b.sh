#!/usr/bin/env bash
# Issue 9, session 19, second call (~3 min). Call 1: resident gpu tests 10/10 on the default (fused off); the capture
# probe found no slow capture step, fused or not (pool unchanged, every step < 30 ms), but its launch was not the same
# one afterwards, so it may not have run beside a launch. Session 18's failures were the *tiny* session test (third
# of `..F....`). Hypothesis: a CuPy module compiled/loaded for the first time inside turn 2's prefill (fused only),
# whose load waits for the running launch. This traces every CuPy module build with its thread, call site and
# wall time, in the session test alone, fused then unfused, with the engine's warnings live.
# Call 2 found no module build during turn 2 (fused stalls 0.5 s on tiny, unfused passes); this call adds a watcher
# printing the join worker's stack when it stays on one line for 150 ms (the blocking call).
# Prediction: fused: one [stuck] stack inside PrefillGraphs._capture (a CUDA call in forward or end_capture); unfused: none.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=300, command="DEADLINE=290 bash bench/h200_session19b.sh")
set -u
DEADLINE=${DEADLINE:-290}
. bench/device_stage.sh
LOGCLI="-o log_cli=true --log-cli-level=WARNING --log-cli-format=%(asctime)s.%(msecs)03d_%(name)s_%(message)s --log-cli-date-format=%H:%M:%S"
for f in 1; do
  TRACE_STUCK=1 MK_PREFILL_FUSED=$f stage ts_f$f 110 python3 -m pytest -q -s -m gpu $PT -p no:cacheprovider -p bench.trace_join_waits \
    $LOGCLI tests/test_monokernel_resident_gpu.py -k 'sessions_turns_join and tiny'
done
{ echo "total ${SECONDS}s"
  for f in 1; do echo "== fused $f: $(grep -E 'passed|failed' "$OUT/ts_f$f.log" | tail -n 1)"
    grep -E "module-load.*thread=[^M]|under way|stuck|File|^    |turns took|PASSED|FAILED" "$OUT/ts_f$f.log" | cut -c1-400 | head -n 150; done; } >> "$OUT/summary.txt"
