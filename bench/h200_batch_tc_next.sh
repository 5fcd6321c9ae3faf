#!/usr/bin/env bash
# Issue 9, the next batch-speed call on ONE H200 (~4 min): layout options mma_qkv and mma_o (QKV and the O-proj
# block-tiled on tensor cores, csrc/mk_block_mma.cuh; built and emulated in session 10, never run on a GPU), on top
# of the batched engine's defaults (layout_tuned.TUNED_BATCH), llama-3.2-1b:
#   1. B = 4 at 4 requests: defaults vs + mma_o, + mma_qkv, + both; same weights, A B A B, whether every slot's
#      greedy tokens match
#   2. the batch gpu tests with both (slots vs the single engine and transformers)
# Whichever wins with the tests passing goes into TUNED_BATCH (replicas/layout_tuned.py).
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=400, command="bash bench/h200_batch_tc_next.sh")
set -u
DEADLINE=${DEADLINE:-380}
. bench/device_stage.sh
stage ab 170 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --runs 3 --out /tmp/q \
  --variants mma_o mma_qkv mma_qkv+mma_o
MK_BATCH_TEST_LAYOUT=mma_qkv=1,mma_o=1 stage tests 120 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider \
  tests/test_monokernel_batch_gpu.py -k "tiny or llama"
{ echo "total ${SECONDS}s"; cat /tmp/q/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; grep -hE "passed|failed|Error" "$OUT"/tests.log | tail -4
