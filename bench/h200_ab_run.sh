#!/usr/bin/env bash
# Issue 3 on ONE H200 (kind nvidia-h200; x2 not lent): A/B of the layout options fused_mlp,
# fused_attn_o and both against the default, then the monokernel gpu tests on the combined build.
# Sequential stages under `timeout`, cut to a $DEADLINE-second budget; everything under $OUT.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_ab_run.sh")
set -u
: "${OUT:?set OUT}"
DEADLINE=${DEADLINE:-585}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
git log --oneline -1 > "$OUT/summary.txt" 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$OUT/summary.txt" 2>&1
RES=/tmp/mk_results; mkdir -p "$RES"
PT=""; python3 -c "import pytest_timeout" 2>/dev/null && PT="--timeout 150"
stage() {  # name, seconds, command... (env assignments go before `stage`)
  local name=$1 secs=$2; shift 2
  local left=$((DEADLINE - SECONDS - 5))
  if [ "$left" -lt "$secs" ]; then secs=$left; fi
  if [ "$secs" -lt 15 ]; then echo "$name skipped (out of time)" >> "$OUT/summary.txt"; return; fi
  local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t0))s of ${secs}s (rc 124 = timed out)" >> "$OUT/summary.txt"
}
PYTEST="python3 -m pytest -v -m gpu $PT --durations=8 -p no:cacheprovider"
stage ab_1b ${AB1B_S:-190} python3 bench/decode.py --presets llama-3.2-1b \
  --ab fused_mlp fused_attn_o fused_mlp+fused_attn_o --runs 3 --new-tokens 256 --out "$RES/1b"
MK_TEST_LAYOUT=fused_mlp,fused_attn_o stage both_gpu_tests ${TESTS_S:-230} $PYTEST tests/test_monokernel_gpu.py
stage ab_8b ${AB8B_S:-200} python3 bench/decode.py --presets llama-3.1-8b \
  --ab fused_mlp+fused_attn_o --runs 3 --new-tokens 256 --out "$RES/8b"
cp "$RES/1b/ab.json" "$OUT/ab_1b.json" 2>/dev/null; cp "$RES/8b/ab.json" "$OUT/ab_8b.json" 2>/dev/null
{ echo "total ${SECONDS}s"; echo; cat "$RES/1b/ab.md" "$RES/8b/ab.md" 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
grep -E "passed|failed|error" "$OUT/both_gpu_tests.log" | tail -5
