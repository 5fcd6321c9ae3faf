#!/usr/bin/env bash
# Issue 9, session 16, fourth call (~6 min): the batch sampling step. (1) Every batch build now loads the slots'
# cancel flags with the bests (one round trip instead of one per slot behind its branch: the timeline's "stop
# checks + emit", 3.46 us per 1B B = 4 step in call 3). (2) best_max (option, off): the LM head's warp bests as
# 64-bit keys merged with one atomicMax per warp and slot, so each block reads one key per slot after the barrier
# instead of reducing 2,112 bests per slot (6.85 us). Correctness first (batch and resident gpu tests with
# best_max, which also run the cancel change), then A/Bs and the timeline of both builds.
# Prediction: stop checks 3.46 -> ~0.5 us; bests 6.85 -> ~1 us; best_max +0.5..0.7% at 1B B = 4, more at B = 8
# (twice the bests per block), ~+0.2% on 8B (4x longer steps).
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_session16d.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
MK_BATCH_TEST_LAYOUT=best_max=1 stage tb 110 python3 -m pytest -q -x $PT -m gpu -p no:cacheprovider \
  tests/test_monokernel_batch_gpu.py
MK_RESIDENT_TEST_LAYOUT=best_max=1 stage tr 110 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider \
  tests/test_monokernel_resident_gpu.py
stage ab4 50 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --runs 3 --out /tmp/a4 --variants best_max
stage ab8 45 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --runs 2 --out /tmp/a8 --variants best_max
stage tl 35 python3 bench/timeline_probe.py --batch 4 --requests 4 --out /tmp/tl
stage tlb 35 python3 bench/timeline_probe.py --batch 4 --requests 4 --options '{"best_max": true}' --out /tmp/tlb
stage ab84 80 python3 bench/batch.py --presets llama-3.1-8b --builds 4 --runs 2 --out /tmp/b4 --variants best_max
{ echo "total ${SECONDS}s"; tail -n 2 "$OUT/tb.log" "$OUT/tr.log"; cat /tmp/a4/batch.md /tmp/a8/batch.md /tmp/b4/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; grep -h '"delta"' "$OUT"/ab*.log
for f in tl tlb; do grep -E "^grid|lm |sample|embed" "$OUT/$f.log"; done
