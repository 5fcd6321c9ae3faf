#!/usr/bin/env bash
# Issue 9, next session's first call (~5 min, written in session 18): (1) the resident gpu tests in full on the final
# default (MK_PREFILL_FUSED off; only the session test ran on it in session 18: 2 passed); (2) where a session
# suffix's first graph capture waits beside the launch, unfused and fused (bench/capture_beside_probe.py).
# Predictions: resident 10/10; unfused: every step of a capture well under 100 ms and the same launch after; fused:
# one step (which one is the question) takes ~0.5 s or the launch is not the same after.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=420, command="DEADLINE=410 bash bench/h200_session19.sh")
set -u
DEADLINE=${DEADLINE:-410}
. bench/device_stage.sh
stage tr 130 python3 -m pytest -q -m gpu $PT -p no:cacheprovider tests/test_monokernel_resident_gpu.py
for f in 0 1; do MK_PREFILL_FUSED=$f stage cb_f$f 60 python3 bench/capture_beside_probe.py --out /tmp/cb_f$f; done
{ echo "total ${SECONDS}s"; echo "tr: $(grep -E 'passed|failed' "$OUT/tr.log" | tail -n 1)"
  for f in 0 1; do echo "fused $f:"; grep -E '^\{"start"' "$OUT/cb_f$f.log"; done; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
