#!/usr/bin/env bash
# Issue 3, layout option fused_attn_o (O-proj inside attention) and fused_mlp+fused_attn_o: one
# nvidia-h200-x2 call (< 10 min), kept out of next_device_run.sh, whose stages already fill 565 of
# its 580 s. Everything under $OUT (summary.txt first); run from the repo root with `.whl` carried.
#   GPU 0: bench/decode.py --ab on llama-3.2-1b + llama-3.1-8b: default vs fused_mlp vs fused_attn_o vs both
#   GPU 1: tests/test_monokernel_gpu.py on the combined build, then on fused_attn_o alone
set -u
: "${OUT:?set OUT}"
DEADLINE=${DEADLINE:-580}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
git log --oneline -1 > "$OUT/summary.txt" 2>/dev/null
RES=/tmp/mk_results; mkdir -p "$RES"
PT=""; python3 -c "import pytest_timeout" 2>/dev/null && PT="--timeout 180"
stage() {  # name, seconds, command... (env assignments go before `stage`)
  local name=$1 secs=$2; shift 2
  local left=$((DEADLINE - SECONDS - 5))
  if [ "$left" -lt "$secs" ]; then secs=$left; fi
  if [ "$secs" -lt 15 ]; then echo "$name skipped (out of time)" >> "$OUT/summary.txt"; return; fi
  local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t0))s of ${secs}s (rc 124 = timed out)" >> "$OUT/summary.txt"
}
PYTEST="python3 -m pytest -v -m gpu -x $PT --durations=10 -p no:cacheprovider"
# 1B first: if the 8B's builds run out of time, the 1B table is in ab_1b.log / ab_1b/ab.md
CUDA_VISIBLE_DEVICES=0 stage ab_1b 200 python3 bench/decode.py --presets llama-3.2-1b \
  --ab fused_mlp fused_attn_o fused_mlp+fused_attn_o --runs 3 --new-tokens 256 --out "$RES/1b" \
  && CUDA_VISIBLE_DEVICES=0 stage ab_8b 350 python3 bench/decode.py --presets llama-3.1-8b \
  --ab fused_mlp fused_mlp+fused_attn_o --runs 3 --new-tokens 256 --out "$RES/8b" &
CUDA_VISIBLE_DEVICES=1 MK_TEST_LAYOUT=fused_mlp,fused_attn_o stage both_gpu_tests 280 $PYTEST tests/test_monokernel_gpu.py \
  && CUDA_VISIBLE_DEVICES=1 MK_TEST_LAYOUT=fused_attn_o stage attn_o_gpu_tests 270 $PYTEST tests/test_monokernel_gpu.py &
wait
cp "$RES/1b/ab.json" "$OUT/ab_1b.json" 2>/dev/null; cp "$RES/8b/ab.json" "$OUT/ab_8b.json" 2>/dev/null
{ echo "total ${SECONDS}s"; echo; cat "$RES/1b/ab.md" "$RES/8b/ab.md" 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
tail -4 "$OUT/both_gpu_tests.log" "$OUT/attn_o_gpu_tests.log" 2>/dev/null
