#!/usr/bin/env bash
# Session 6, first call on ONE H200 (issues 3 and 9), everything under $OUT:
#   1. bench/timeline_probe.py: per-block phase timeline of the 1B default kernel (where the chain and the
#      MLP's barrier wait go; -DMK_TIMELINE=1 probe build)
#   2. all batch gpu tests on the batched engine's combined defaults (gu_il + ao_slots + sub_builds)
#   3. bench/batch.py --builds 4 8 on those defaults, with the peer (HF static cache) in the same run
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_session6.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
RES=/tmp/mk_s6; mkdir -p "$RES"
stage timeline 120 python3 bench/timeline_probe.py --out "$RES/tl"
stage batch_tests 200 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider tests/test_monokernel_batch_gpu.py
stage batch_bench 240 python3 bench/batch.py --presets llama-3.2-1b --builds 4 8 --peer --out "$RES/batch"
cp "$RES/tl/timeline.txt" "$RES/tl/timeline.json" "$OUT/" 2>/dev/null
cp "$RES/batch/batch.json" "$OUT/" 2>/dev/null
{ echo "total ${SECONDS}s"; echo; cat "$RES/batch/batch.md" 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; cat "$OUT/timeline.txt" 2>/dev/null; tail -3 "$OUT/batch_tests.log"
