#!/usr/bin/env bash
# Issue 9, session 14, third call (~9 min): fx_pack as a batch default (layout_tuned.TUNED_BATCH). Its gpu tests ran
# in the first two calls with the option given explicitly (same flags): batch 14/14 (tiny, 1B) and 7/7 (8B),
# resident 10/10. Here the occupancy tables with the transformers peer in the same run: 1B (B = 8 build: 1, 2, 4,
# 8 requests), 8B (the same), and the resident 1B B = 8 table with its join times.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_session14c.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
stage t1 150 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --runs 2 --peer --out /tmp/t1
stage t8 220 python3 bench/batch.py --presets llama-3.1-8b --builds 8 --runs 2 --peer --out /tmp/t8
stage r8 150 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --resident --peer --out /tmp/r8
{ echo "total ${SECONDS}s"; cat /tmp/t1/batch.md /tmp/t8/batch.md /tmp/r8/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cp -r /tmp/r8 "$OUT/r8" 2>/dev/null
cat "$OUT/summary.txt"
