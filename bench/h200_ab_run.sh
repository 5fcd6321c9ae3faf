#!/usr/bin/env bash
# Layout A/B on ONE H200 (kind nvidia-h200): bench/decode.py --ab on llama-3.2-1b and llama-3.1-8b
# (default build vs each variant, same random weights, A B A B), then the monokernel gpu tests on
# one variant. Sequential stages under `timeout`, cut to a $DEADLINE-second budget; all under $OUT.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600,
#       command="AB_1B='split_pos=32 x_perm=0' AB_8B='' TEST_LAYOUT=x_perm=0 bash bench/h200_ab_run.sh")
# Variant names: decode.py --ab syntax ('+' joins options, NAME=N sets an integer one); TEST_LAYOUT:
# options for tests/test_monokernel_gpu.py (MK_TEST_LAYOUT; empty = the default, none = skip); an empty
# variant list skips its A/B stage.
set -u
DEADLINE=${DEADLINE:-585}
PLAIN=fused_mlp=0+fused_attn_o=0+x_perm=0+split_pos=64  # the untuned layout
AB_1B=${AB_1B-$PLAIN}
AB_8B=${AB_8B-$PLAIN}
TEST_LAYOUT=${TEST_LAYOUT-}
. bench/device_stage.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$OUT/summary.txt" 2>&1
RES=/tmp/mk_results; mkdir -p "$RES"
# shellcheck disable=SC2086  # the variant lists split on spaces on purpose
[ -n "$AB_1B" ] && stage ab_1b 240 python3 bench/decode.py --presets llama-3.2-1b --ab $AB_1B \
  --runs 3 --new-tokens 256 --out "$RES/1b"
[ "$TEST_LAYOUT" != none ] && MK_TEST_LAYOUT=$TEST_LAYOUT stage gpu_tests 150 \
  python3 -m pytest -v -m gpu $PT --durations=5 -p no:cacheprovider tests/test_monokernel_gpu.py
# shellcheck disable=SC2086
[ -n "$AB_8B" ] && stage ab_8b 200 python3 bench/decode.py --presets llama-3.1-8b --ab $AB_8B \
  --runs 3 --new-tokens 256 --out "$RES/8b"
cp "$RES/1b/ab.json" "$OUT/ab_1b.json" 2>/dev/null; cp "$RES/8b/ab.json" "$OUT/ab_8b.json" 2>/dev/null
{ echo "total ${SECONDS}s"; echo; cat "$RES/1b/ab.md" "$RES/8b/ab.md" 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
grep -E "passed|failed|error" "$OUT/gpu_tests.log" 2>/dev/null | tail -5
