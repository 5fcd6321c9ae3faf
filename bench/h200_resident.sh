#!/usr/bin/env bash
# Issue 9's resident kernel and act_bf16 on ONE H200 (after h200_next_single.sh if both fit; ~9.5 minutes):
# 1. gpu tests: resident builds (116 SMs, their own fused-down packing) vs the single engine and transformers,
#    requests and session turns joining the running launch; 2. bench: B = 4 resident, per-request tok/s at 1/2/4
#    and the join's cost beyond the joiner's prefill (3 running, the 4th joins), peer and copy bandwidth in the
#    same run; 3. act_bf16 A/B at 4 of 4 (its "default" arm is the plain 132-SM B = 4 build: the resident table's
#    same-run reference) and its tolerance-based batch gpu tests.
# Predictions: resident per-request speed at 4 of 4 within ~5% of the 132-SM build (HBM-bound; 116 SMs may still
# saturate it); join cost beyond prefill <= 1 step (~1.7 ms at B = 4) with no relaunch; the joiner's prefill
# slower on 16 SMs (weights at maybe 1 TB/s: ~3 ms for 1B) and the running slots' worst gap ~1 step, not ~15 ms.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_resident.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
RES=/tmp/mk_res; mkdir -p "$RES"
stage res_tests 170 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider tests/test_monokernel_resident_gpu.py
stage res_bench 200 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --resident --peer --out "$RES/res"
# act_bf16 (batch builds' matvec inputs in bf16: half the per-slot shared-memory input reads, which bound B > 1).
# Prediction: +15..25% per request at 4 of 4 (the per-slot ~330 us/step falls by a third or more). Its slots part
# from the fp32 single engine at bf16 level, so only the tests that compare by tolerance / near-tie margin run.
stage bf16_ab 100 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --variants act_bf16 --out "$RES/bf16"
MK_BATCH_TEST_LAYOUT=act_bf16=1 stage bf16_tests 90 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider \
  tests/test_monokernel_batch_gpu.py -k "llama and (teacher or greedy or joins)"
{ echo "total ${SECONDS}s"; echo; cat "$RES/res/batch.md" "$RES/bf16/batch.md" 2>/dev/null; } >> "$OUT/summary.txt"
cp "$RES/res/batch.json" "$OUT/resident.json" 2>/dev/null; cp "$RES/bf16/batch.json" "$OUT/bf16.json" 2>/dev/null
cat "$OUT/summary.txt"; tail -n 3 "$OUT/res_tests.log" "$OUT/bf16_tests.log"
