#!/usr/bin/env bash
# The next batch-speed call on ONE H200 (issue 9), everything under $OUT (<= 8 files):
#   1. bench/mma_probe.py: CUDA-core vs tensor-core batched matvec at B = 1..8 (decides the redesign)
#   2. ao_slots A/B on llama-3.2-1b, B=4 at 4 requests (bench/batch.py --variants)
#   3. sub-builds: llama-3.2-1b B=8 engine with the B=2/4 builds, occupancy 1..8 (bench/batch.py --sub-builds)
#   4. batch gpu tests on ao_slots, 5. batch gpu tests with sub-builds
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_batch_next.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
RES=/tmp/mk_next; mkdir -p "$RES"
PYTEST="python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider tests/test_monokernel_batch_gpu.py"
stage probe 120 python3 bench/mma_probe.py --out "$RES/probe"
stage ao_ab 150 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --variants ao_slots --out "$RES/ab"
stage sub_bench 120 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --out "$RES/sub"
MK_BATCH_TEST_LAYOUT=ao_slots=1 stage ao_tests 100 $PYTEST
MK_BATCH_SUB_BUILDS=1 stage sub_tests 100 $PYTEST
cp "$RES/probe/mma_probe.json" "$OUT/" 2>/dev/null
{ echo "total ${SECONDS}s"; echo; cat "$RES/ab/batch.md" "$RES/sub/batch.md" 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; grep -h '"design"' "$OUT/probe.log" 2>/dev/null; tail -2 "$OUT/ao_tests.log" "$OUT/sub_tests.log" 2>/dev/null
