#!/usr/bin/env bash
# Issue 9, session 19, eighth call (~4.5 min). A resident engine now captures every prefill graph shape a join can
# use (PrefillGraphs.capture_all: session suffixes' too, ~30 per slot at max_context 2,048) and uploads them before
# its first launch, so no join captures beside a launch. Runs the resident gpu tests with MK_PREFILL_FUSED=1 (whose
# session test's turn-2 capture waited 0.5 s beside the launch), then on the default (fused off).
# Predictions: fused 10/10 (turn 2 is a queued replay now); default 10/10; capture_all ~4 s per 1B engine (8 slots x
# ~24 new shapes x ~20 ms of host issue), well under 1 s on tiny.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=270, command="DEADLINE=260 bash bench/h200_session19h.sh")
set -u
DEADLINE=${DEADLINE:-260}
. bench/device_stage.sh
LOG="-o log_cli=true --log-cli-level=INFO"
for f in 1 0; do
  MK_PREFILL_FUSED=$f stage tr_f$f 125 python3 -m pytest -q -m gpu $PT -p no:cacheprovider $LOG tests/test_monokernel_resident_gpu.py
done
{ echo "total ${SECONDS}s"
  for f in 1 0; do echo "== fused $f: $(grep -E ' passed| failed' "$OUT/tr_f$f.log" | tail -n 1)"
    grep -E "prefill graphs: [0-9]+ captured in|under way|turns took|^FAILED" "$OUT/tr_f$f.log" | cut -c1-220 | sort | uniq -c | head -n 12; done
} >> "$OUT/summary.txt"
