#!/usr/bin/env bash
# The first GPU call for layout option mma (tensor-core matvecs, replicas/layout_mma.py; issue 9, also
# issue 3's B = 1), ONE H200, everything under $OUT (<= 8 files). Correctness before speed:
#   1. single-engine gpu tests on the mma B = 1 build (vs transformers fp32, the reference engine)
#   2. llama-3.2-1b B = 4 batched engine on mma: per-request tok/s at 1, 2, 4 requests + join cost,
#      against the default single-sequence engine measured in the same run (bench/batch.py --layout)
#   3. batch gpu tests on mma (slots vs the single engine of the same layout)
#   4. B = 1 A/Bs on llama-3.2-1b (bench/decode.py --ab): default vs mma, and default vs a 124-SM grid (the
#      first unknown of NOTES "Joins without a relaunch": decode speed with 8 SMs left to a prefill)
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_mma_next.sh")
# Predictions (csrc/NOTES.md "Tensor-core matvecs"): B = 4 per request 482 -> >= 700 tok/s; B = 1 within
# +-3% of the default; 124 SMs: -0..6% (HBM needs fewer SMs than 132 to saturate); logits within 2e-2.
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
RES=/tmp/mk_mma; mkdir -p "$RES"
MK_TEST_LAYOUT=mma=1 stage mma_tests 170 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider \
  tests/test_monokernel_gpu.py -k "tiny or llama"
stage batch_mma 160 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --layout mma --out "$RES/bm"
MK_BATCH_TEST_LAYOUT=mma=1 stage batch_tests 110 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider \
  tests/test_monokernel_batch_gpu.py -k "tiny or llama"
stage decode_ab 140 python3 bench/decode.py --presets llama-3.2-1b --runs 3 --ab mma num_sms=124 --out "$RES/ab"
{ echo "total ${SECONDS}s"; echo; cat "$RES/bm/batch.md" "$RES/ab/ab.md" 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; tail -3 "$OUT/mma_tests.log" "$OUT/batch_tests.log" 2>/dev/null
