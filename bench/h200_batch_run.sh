#!/usr/bin/env bash
# Batched monokernel on ONE H200 (issue 9): gpu tests of the batch build, the B=1 engine's gpu tests
# (the kernel's code is shared), then bench/batch.py (per-request / aggregate tok/s by occupancy and
# the cost of a join) on llama-3.2-1b and llama-3.1-8b. Sequential stages under `timeout`; all under $OUT.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_batch_run.sh")
# BUILDS_1B / BUILDS_8B: batch builds to measure (empty skips that preset); TESTS=0 skips the tests;
# TP_EMU=0 skips the one-GPU tensor-parallel emulation stage (TP_EMU_ARGS: its arguments), TP_TESTS=0
# the emulated TP gpu tests. At most 8 files come back: leave one of the stages out when all run.
set -u
DEADLINE=${DEADLINE:-585}
BUILDS_1B=${BUILDS_1B-8 4 2}
BUILDS_8B=${BUILDS_8B-8}
TESTS=${TESTS:-1}
. bench/device_stage.sh
RES=/tmp/mk_batch; mkdir -p "$RES"
PYTEST="python3 -m pytest -v -m gpu -x $PT --durations=8 -p no:cacheprovider"
# TP emulated on this one GPU (bench/tp_emulate.py: each N in its own worker under its own limit)
TP_EMU_ARGS=${TP_EMU_ARGS:---tp 2 4 8 --preset tiny}
# shellcheck disable=SC2086
[ "${TP_EMU:-1}" = 1 ] && CUDA_DEVICE_MAX_CONNECTIONS=32 stage tp_emulate 120 python3 bench/tp_emulate.py $TP_EMU_ARGS \
  --out "$RES/tp"
[ "$TESTS" = 1 ] && stage batch_tests 170 $PYTEST tests/test_monokernel_batch_gpu.py
# shellcheck disable=SC2086  # build lists split on spaces on purpose
[ -n "$BUILDS_1B" ] && stage bench_1b 200 python3 bench/batch.py --presets llama-3.2-1b --builds $BUILDS_1B --out "$RES/1b"
[ "$TESTS" = 1 ] && stage single_tests 100 $PYTEST tests/test_monokernel_gpu.py
[ "$TESTS" = 1 ] && [ "${TP_TESTS:-1}" = 1 ] && CUDA_DEVICE_MAX_CONNECTIONS=32 stage tp_tests 90 $PYTEST tests/test_tp_gpu.py -k emulated
# shellcheck disable=SC2086
[ -n "$BUILDS_8B" ] && stage bench_8b 150 python3 bench/batch.py --presets llama-3.1-8b --builds $BUILDS_8B --out "$RES/8b"
cp "$RES/tp/tp_emulate.jsonl" "$OUT/" 2>/dev/null; cp "$RES/1b/batch.json" "$OUT/batch_1b.json" 2>/dev/null; cp "$RES/8b/batch.json" "$OUT/batch_8b.json" 2>/dev/null
{ echo "total ${SECONDS}s"; echo; cat "$RES/1b/batch.md" "$RES/8b/batch.md" 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
grep -E "passed|failed|error|Error" "$OUT/batch_tests.log" "$OUT/single_tests.log" "$OUT/tp_tests.log" 2>/dev/null | tail -12
