#!/usr/bin/env bash
# Issue 9's batch speed on ONE H200: layout options norm_once, mma_mlp (the fused MLP on tensor cores,
# replicas/layout_mma_mlp.py) and mma_lm (the LM head on tensor cores), llama-3.2-1b:
#   1. B = 4 at 4 requests: the default batch build vs each variant, same weights, A B A B, and whether every
#      slot's greedy tokens match (bench/batch.py --variants)
#   2. the batch gpu tests with the batch builds on all three (slots vs the single engine and transformers)
#   3. the occupancy table of the resident B = 4 engine on all three, with copy bandwidth and the transformers peer
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_mma_mlp.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
RES=/tmp/mk_mlp; mkdir -p "$RES"
ALL=mma_mlp+mma_lm+norm_once
stage ab1b 200 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --runs 3 --out "$RES/ab" \
  --variants norm_once mma_mlp+norm_once $ALL
MK_BATCH_TEST_LAYOUT=mma_mlp=1,mma_lm=1,norm_once=1 stage tests 130 python3 -m pytest -q -m gpu -x $PT \
  -p no:cacheprovider tests/test_monokernel_batch_gpu.py -k "tiny or llama"
stage table 160 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --layout $ALL --resident --peer --out "$RES/t"
{ echo "total ${SECONDS}s"; cat "$RES/ab/batch.md" "$RES/t/batch.md" 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; grep -hE "passed|failed|Error" "$OUT"/tests.log | tail -4
