#!/usr/bin/env bash
# Issue 9, session 20, fourth call (~7 min).
# - t8: the batch gpu tests on llama-3.1-8b with the fused prefill passes now the default (head_dim 128, hidden 4,096:
#   shapes tiny and 1B do not have). Prediction: 7 passed (session 17: 7 on the unfused prefill).
# - r8: the 1B resident table once more, 14 joins, now reporting how many tokens reach the host within 0.25 ms after
#   a running slot's worst gap. Prediction: when the gap is ~5 ms, a burst of >= 3 (a host delivery stall: the kernel
#   kept decoding); when ~2.5 ms, 1 (the step boundary a join waits at plus its hand-over).
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=480, command="DEADLINE=465 bash bench/h200_session20d.sh")
set -u
DEADLINE=${DEADLINE:-465}
. bench/device_stage.sh
stage r8 170 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --resident --peer --runs 1 --joins 14 --out /tmp/r8
MK_BATCH_TEST_PRESETS=llama-3.1-8b stage t8 260 python3 -m pytest -q -m gpu $PT -p no:cacheprovider tests/test_monokernel_batch_gpu.py
{ echo "total ${SECONDS}s"
  echo "== t8: $(grep -E ' passed| failed|error' "$OUT/t8.log" | tail -n 1)"; grep -E "^FAILED|^ERROR" "$OUT/t8.log" | cut -c1-200 | head -n 5
  echo "== r8"; cat /tmp/r8/batch.md 2>/dev/null; cp /tmp/r8/batch.json "$OUT/r8.json" 2>/dev/null
} >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
