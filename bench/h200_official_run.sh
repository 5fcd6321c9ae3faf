#!/usr/bin/env bash
# The recorded figures on ONE H200: bench/decode.py with the engine's default layout (copy-bandwidth
# roofline + transformers static-cache peer in the same run, TTFT), the monokernel gpu tests on the
# default, then the batched engine's occupancy table (B = 4 and 8 builds, join cost) and its gpu tests.
# Everything under $OUT.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_official_run.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$OUT/summary.txt" 2>&1
stage decode 300 python3 bench/decode.py --presets llama-3.2-1b llama-3.1-8b --runs 5 --ttft 32 512 2000 --out "$OUT/dec"
stage gpu_tests 120 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider tests/test_monokernel_gpu.py
stage batch 90 python3 bench/batch.py --presets llama-3.2-1b --builds 4 8 --out "$OUT/b"
stage batch_tests 70 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider tests/test_monokernel_batch_gpu.py -k "tiny or llama"
{ echo "total ${SECONDS}s"; echo; cat "$OUT/dec/decode.md" "$OUT/b/batch.md" 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
grep -hE "passed|failed|error" "$OUT/gpu_tests.log" "$OUT/batch_tests.log" 2>/dev/null | tail -4
