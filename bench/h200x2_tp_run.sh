#!/usr/bin/env bash
# Issue 6 on nvidia-h200-x2, one call (< 10 min), everything under $OUT (summary.txt first):
#   1. TP smoke on tiny (a hang = an exchange-protocol bug)
#   2. TP gpu tests (tests/test_tp_gpu.py: TP=2 vs TP=1, reference, transformers; greedy, seeded, cancel)
#   3. bench/decode.py: TP=1 vs TP=2 (+ skip-all-reduce build) for llama-3.2-1b, qwen3-1.7b, llama-3.1-8b,
#      copy-bandwidth roofline and the transformers static-cache peer in the same run
# Run from the repository root with `.whl` carried (scripts/fetch_device_wheels.sh makes it).
set -u
DEADLINE=${DEADLINE:-580}
. bench/device_stage.sh
RES=/tmp/mk_results; mkdir -p "$RES"
PYTEST="python3 -m pytest -v -m gpu $PT --durations=10 -p no:cacheprovider"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
stage tp_smoke 75 python3 bench/tp_smoke.py --tp 2
stage tp_gpu_tests 170 $PYTEST tests/test_tp_gpu.py
stage tp_bench 300 python3 bench/decode.py --presets llama-3.2-1b qwen3-1.7b llama-3.1-8b --tp 1 2 --runs 3 \
  --new-tokens 256 --ttft 2000 --out "$RES"
cp "$RES/decode.json" "$OUT/" 2>/dev/null
{ echo "total ${SECONDS}s"; echo; cat "$RES/decode.md" 2>/dev/null; echo; cat "$OUT/topo.txt"; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
tail -5 "$OUT/tp_smoke.log" "$OUT/tp_gpu_tests.log" 2>/dev/null
