#!/usr/bin/env bash
# Issue 9, layout option mma_qkv (QKV on tensor cores, block-tiled k-split, csrc/mk_block_mma.cuh) on ONE H200,
# on top of the batched engine's defaults (layout_tuned.TUNED_BATCH), llama-3.2-1b:
#   1. B = 4 at 4 requests: defaults vs + mma_qkv, same weights, A B A B, whether every slot's greedy tokens match
#   2. the batch gpu tests with mma_qkv (slots vs the single engine and transformers)
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=270, command="DEADLINE=200 bash bench/h200_mma_qkv.sh")
set -u
DEADLINE=${DEADLINE:-300}
. bench/device_stage.sh
stage ab 90 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --runs 3 --variants mma_qkv --out /tmp/q
MK_BATCH_TEST_LAYOUT=mma_qkv=1 stage tests 95 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider \
  tests/test_monokernel_batch_gpu.py -k "tiny or llama"
{ echo "total ${SECONDS}s"; cat /tmp/q/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; grep -hE "passed|failed|Error" "$OUT"/tests.log | tail -4
