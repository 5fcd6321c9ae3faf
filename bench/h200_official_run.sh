#!/usr/bin/env bash
# The recorded figures on ONE H200: bench/decode.py with the engine's default layout (copy-bandwidth
# roofline + transformers static-cache peer in the same run, TTFT), a short A/B of neighbours of the
# default, then the monokernel gpu tests on the default. Everything under $OUT.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_official_run.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$OUT/summary.txt" 2>&1
stage decode 300 python3 bench/decode.py --presets llama-3.2-1b llama-3.1-8b --runs 5 --ttft 32 512 2000 --out "$OUT/dec"
stage ab_1b 100 python3 bench/decode.py --presets llama-3.2-1b --runs 3 --new-tokens 256 --out "$OUT/ab" \
  --ab split_pos=8 split_pos=32 fused_mlp=0+fused_attn_o=0+x_perm=0+split_pos=64
stage gpu_tests 150 python3 -m pytest -v -m gpu $PT --durations=5 -p no:cacheprovider tests/test_monokernel_gpu.py
{ echo "total ${SECONDS}s"; echo; cat "$OUT/dec/decode.md" "$OUT/ab/ab.md" 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
grep -E "passed|failed|error" "$OUT/gpu_tests.log" 2>/dev/null | tail -3
