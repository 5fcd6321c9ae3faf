#!/usr/bin/env bash
# The next session's one nvidia-h200-x2 call (< 10 min), everything under $OUT (summary.txt first):
#   1. TP smoke (issue 6; a hang = an exchange-protocol bug)                       both GPUs
#   2. in parallel, one GPU each (issue 3): GPU 0: bench/decode.py --ab, the tuned default vs the plain
#      layout on llama-3.2-1b + llama-3.1-8b; GPU 1: tests/test_monokernel_gpu.py on the default
#   3. TP gpu tests (tests/test_tp_gpu.py)                                           both GPUs
#   4. TP benchmark at TP=2 (+ no-all-reduce build); the TP=1 figures come from stage 2's default
# Every stage runs under `timeout`, cut further so the whole run ends by $DEADLINE seconds.
# $OUT gets 8 files (the device tool returns at most 8): summary.txt (stages, topology, ab.md and
# decode.md tables), the five stage logs, ab.json and decode.json.
# Run from the repository root with `.whl` carried (scripts/fetch_device_wheels.sh makes it).
set -u
DEADLINE=${DEADLINE:-580}
. bench/device_stage.sh
RES=/tmp/mk_results; mkdir -p "$RES"  # decode.py's outputs; the jsons are copied to $OUT at the end
PYTEST="python3 -m pytest -v -m gpu -x $PT --durations=10 -p no:cacheprovider"

stage tp_smoke 75 python3 bench/tp_smoke.py --tp 2
CUDA_VISIBLE_DEVICES=0 stage ab 230 python3 bench/decode.py --presets llama-3.2-1b llama-3.1-8b \
  --ab fused_mlp=0+fused_attn_o=0+x_perm=0+split_pos=64 --runs 3 --new-tokens 256 --out "$RES" &
CUDA_VISIBLE_DEVICES=1 stage fused_gpu_tests 230 $PYTEST tests/test_monokernel_gpu.py &
wait
stage tp_gpu_tests 140 $PYTEST tests/test_tp_gpu.py
stage tp_bench 120 python3 bench/decode.py --presets llama-3.2-1b llama-3.1-8b --tp 2 --runs 3 \
  --new-tokens 256 --ttft 2000 --no-peer --out "$RES"

cp "$RES/ab.json" "$RES/decode.json" "$OUT/" 2>/dev/null
{ echo "total ${SECONDS}s"; echo; cat "$RES/ab.md" 2>/dev/null; echo; cat "$RES/decode.md" 2>/dev/null
  echo; nvidia-smi topo -m 2>&1; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
tail -4 "$OUT/tp_smoke.log" "$OUT/fused_gpu_tests.log" "$OUT/tp_gpu_tests.log" 2>/dev/null
