#!/usr/bin/env bash
# Issue 3 on ONE H200, second A/B: the fused default candidate (fused_mlp+fused_attn_o, whose freed
# shared memory now deepens the weight ring) against kv_bulk (K/V tiles by TMA bulk copy, so
# attention stops waiting for the weight ring) and l2_at_attn (gate/up L2 prefetch during the
# attention chain, budgets 16/32/48 MB), then gpu tests on the kv_bulk build.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_ab2_run.sh")
set -u
: "${OUT:?set OUT}"
DEADLINE=${DEADLINE:-585}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
git log --oneline -1 > "$OUT/summary.txt" 2>/dev/null
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
B=fused_mlp+fused_attn_o
L2=$B+kv_bulk+l2_at_attn+l2_budget_mb
stage ab_1b 240 python3 bench/decode.py --presets llama-3.2-1b --runs 3 --new-tokens 256 --out "$RES/1b" \
  --ab $B $B+max_ring=24 $B+kv_bulk kv_bulk $L2=16 $L2=32 $L2=48 $B+l2_at_attn+l2_budget_mb=32
stage ab_8b 170 python3 bench/decode.py --presets llama-3.1-8b --runs 3 --new-tokens 256 --out "$RES/8b" \
  --ab $B $B+kv_bulk $L2=32
MK_TEST_LAYOUT=fused_mlp,fused_attn_o,kv_bulk stage kvb_gpu_tests 150 \
  python3 -m pytest -v -m gpu $PT --durations=5 -p no:cacheprovider tests/test_monokernel_gpu.py
cp "$RES/1b/ab.json" "$OUT/ab_1b.json" 2>/dev/null; cp "$RES/8b/ab.json" "$OUT/ab_8b.json" 2>/dev/null
{ echo "total ${SECONDS}s"; echo; cat "$RES/1b/ab.md" "$RES/8b/ab.md" 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
grep -E "passed|failed|error" "$OUT/kvb_gpu_tests.log" | tail -5
