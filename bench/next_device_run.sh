#!/usr/bin/env bash
# The next session's one nvidia-h200-x2 call (< 10 min), everything under $OUT (summary.txt first):
#   1. TP smoke (issue 6; a hang = an exchange-protocol bug)                       both GPUs
#   2. in parallel, one GPU each (issue 3): GPU 0: bench/decode.py --ab, the tuned default vs the plain
#      layout on llama-3.2-1b + llama-3.1-8b; GPU 1: tests/test_monokernel_gpu.py on the default
#   3. TP gpu tests (tests/test_tp_gpu.py)                                           both GPUs
#   4. TP benchmark at TP=2 (+ no-all-reduce build); the TP=1 figures come from stage 2's default
# Every stage runs under `timeout`, cut further so the whole run ends by $DEADLINE seconds.
# $OUT gets 8 files (the device tool returns at most 8): summary.txt (stages, topology, ab.md and
# decode.md tables), the five stage logs, ab.json and decode.json.
# Run from the repository root with `.whl` carried (scripts/fetch_device_wheels.sh makes it).
set -u
: "${OUT:?set OUT}"
DEADLINE=${DEADLINE:-580}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
git log --oneline -1 > "$OUT/summary.txt" 2>/dev/null
RES=/tmp/mk_results; mkdir -p "$RES"  # decode.py's outputs; the jsons are copied to $OUT at the end
# pytest-timeout may be missing on the device (the stage `timeout` bounds the run either way)
PT=""; python3 -c "import pytest_timeout" 2>/dev/null && PT="--timeout 180"
stage() {  # name, seconds, command... (env assignments go before `stage`)
  local name=$1 secs=$2; shift 2
  local left=$((DEADLINE - SECONDS - 5))
  if [ "$left" -lt "$secs" ]; then secs=$left; fi
  if [ "$secs" -lt 15 ]; then echo "$name skipped (out of time)" >> "$OUT/summary.txt"; return; fi
  local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s of ${secs}s (rc 124 = timed out)" >> "$OUT/summary.txt"
}
PYTEST="python3 -m pytest -v -m gpu -x $PT --durations=10 -p no:cacheprovider"

stage tp_smoke 75 python3 bench/tp_smoke.py --tp 2
CUDA_VISIBLE_DEVICES=0 stage ab 230 python3 bench/decode.py --presets llama-3.2-1b llama-3.1-8b \
  --ab fused_mlp=0+fused_attn_o=0+x_perm=0+split_pos=64 --runs 3 --new-tokens 256 --out "$RES" &
CUDA_VISIBLE_DEVICES=1 stage fused_gpu_tests 230 $PYTEST tests/test_monokernel_gpu.py &
wait
stage tp_gpu_tests 140 $PYTEST tests/test_tp_gpu.py
stage tp_bench 120 python3 bench/decode.py --presets llama-3.2-1b llama-3.1-8b --tp 2 --runs 3 \
  --new-tokens 256 --ttft 2000 --no-peer --out "$RES"

cp "$RES/ab.json" "$RES/decode.json" "$OUT/" 2>/dev/null
{ echo "total ${SECONDS}s"; echo; cat "$RES/ab.md" 2>/dev/null; echo; cat "$RES/decode.md" 2>/dev/null
  echo; nvidia-smi topo -m 2>&1; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
tail -4 "$OUT/tp_smoke.log" "$OUT/fused_gpu_tests.log" "$OUT/tp_gpu_tests.log" 2>/dev/null
