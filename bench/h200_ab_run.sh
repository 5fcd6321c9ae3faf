#!/usr/bin/env bash
# Layout A/B on ONE H200 (kind nvidia-h200): bench/decode.py --ab on llama-3.2-1b and llama-3.1-8b
# (default build vs each variant, same random weights, A B A B), then the monokernel gpu tests on
# one variant. Sequential stages under `timeout`, cut to a $DEADLINE-second budget; all under $OUT.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600,
#       command="AB_1B='fused_mlp+fused_attn_o ...' AB_8B='...' TEST_LAYOUT=fused_mlp,fused_attn_o bash bench/h200_ab_run.sh")
# Variant names: decode.py --ab syntax ('+' joins options, NAME=N sets an integer one); TEST_LAYOUT:
# comma-separated boolean options for tests/test_monokernel_gpu.py (MK_TEST_LAYOUT); empty skips a stage.
set -u
: "${OUT:?set OUT}"
DEADLINE=${DEADLINE:-585}
AB_1B=${AB_1B-fused_mlp fused_attn_o fused_mlp+fused_attn_o}
AB_8B=${AB_8B-fused_mlp+fused_attn_o}
TEST_LAYOUT=${TEST_LAYOUT-fused_mlp,fused_attn_o}
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
# shellcheck disable=SC2086  # the variant lists split on spaces on purpose
[ -n "$AB_1B" ] && stage ab_1b 240 python3 bench/decode.py --presets llama-3.2-1b --ab $AB_1B \
  --runs 3 --new-tokens 256 --out "$RES/1b"
[ -n "$TEST_LAYOUT" ] && MK_TEST_LAYOUT=$TEST_LAYOUT stage gpu_tests 150 \
  python3 -m pytest -v -m gpu $PT --durations=5 -p no:cacheprovider tests/test_monokernel_gpu.py
# shellcheck disable=SC2086
[ -n "$AB_8B" ] && stage ab_8b 200 python3 bench/decode.py --presets llama-3.1-8b --ab $AB_8B \
  --runs 3 --new-tokens 256 --out "$RES/8b"
cp "$RES/1b/ab.json" "$OUT/ab_1b.json" 2>/dev/null; cp "$RES/8b/ab.json" "$OUT/ab_8b.json" 2>/dev/null
{ echo "total ${SECONDS}s"; echo; cat "$RES/1b/ab.md" "$RES/8b/ab.md" 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
grep -E "passed|failed|error" "$OUT/gpu_tests.log" 2>/dev/null | tail -5
