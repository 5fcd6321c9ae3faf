#!/usr/bin/env bash
# Issue 9, session 13, one H200 (~8 min; attn_lanes was removed after it: run it at cff309d). attn_lanes (mk_attention.cuh: a split's scores on lane groups with q in
# registers, 3 shuffles per head instead of 5 per position-head; the weighted values on every thread, positions
# split over thread halves): correctness first (single-sequence and batch gpu tests with it on, against HF), then
# A/Bs. Prediction: at B = 4 a split holds ~4x the positions of B = 1 and the timeline put attention at +1.8 us per
# layer over B = 1; attn_lanes should take ~0.5-0.7 us of that: +1% at 1B B = 4, +1.5-2% at B = 8, ~+0.3% at
# B = 1. Then pair_norm on 8B again (session 13's first call: +3.3% at B = 4 from 2 runs) at B = 4 and 8, and the
# resident B = 8 table with the peer (waiting since session 12).
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_session13.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
MK_TEST_LAYOUT=attn_lanes=1 stage t1 90 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider \
  tests/test_monokernel_gpu.py -k "tiny or llama"
MK_BATCH_TEST_LAYOUT=attn_lanes=1 stage tb 100 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider \
  tests/test_monokernel_batch_gpu.py -k "tiny or llama"
stage ab1 70 python3 bench/decode.py --presets llama-3.2-1b --runs 5 --ab attn_lanes --out /tmp/a1
stage ab4 80 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --runs 3 --out /tmp/a4 --variants attn_lanes
stage ab8 80 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --runs 3 --out /tmp/a8 --variants attn_lanes
stage pn84 90 python3 bench/batch.py --presets llama-3.1-8b --builds 4 --runs 3 --out /tmp/p84 --variants pair_norm attn_lanes
stage pn88 80 python3 bench/batch.py --presets llama-3.1-8b --builds 8 --runs 2 --out /tmp/p88 --variants pair_norm
stage res8 120 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --resident --peer --out /tmp/r8
{ echo "total ${SECONDS}s"; cat /tmp/a1/ab.md /tmp/a4/batch.md /tmp/a8/batch.md /tmp/p84/batch.md /tmp/p88/batch.md \
  /tmp/r8/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cp -r /tmp/r8 "$OUT/r8" 2>/dev/null
cat "$OUT/summary.txt"; grep -hE "passed|failed|Error" "$OUT"/t1.log "$OUT"/tb.log | tail -6
