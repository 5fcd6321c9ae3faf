#!/usr/bin/env bash
# Issue 6's device run on nvidia-h200-x2, one call (< 10 min): carried wheels, GPU topology, a
# bounded TP smoke run (a hang = an exchange-protocol bug), the TP gpu tests, the TP benchmark.
# Everything lands in $OUT (summary.txt first). Run from the repository root with `.whl` carried.
set -u
: "${OUT:?set OUT}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
git log --oneline -1 > "$OUT/summary.txt" 2>/dev/null
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
stage() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s (rc 124 = timed out)" >> "$OUT/summary.txt"
}
stage smoke 90 python3 bench/tp_smoke.py --tp 2
stage gpu_tests 230 python3 -m pytest -q -m gpu tests/test_tp_gpu.py -x --timeout 180 --durations=10 -p no:cacheprovider
stage bench 240 python3 bench/decode.py --presets llama-3.2-1b qwen3-1.7b llama-3.1-8b --tp 1 2 --runs 3 \
  --new-tokens 256 --ttft --no-peer --out "$OUT"
cat "$OUT/summary.txt"; tail -5 "$OUT/smoke.log" "$OUT/gpu_tests.log"; cat "$OUT/decode.md" 2>/dev/null
