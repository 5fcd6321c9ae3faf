#!/usr/bin/env bash
# Issue 9, session 12, one H200 (~8 min): fold_x (+9.4% per request on 1B B = 8 in bench/h200_half_vec.sh) A/B on
# 8B B = 8, 1B B = 4 and 8B B = 4 (default vs fold_x, same weights, A B A B), then the per-block timeline of the
# 1B B = 4 build with fold_x (where the B = 4 layer's time goes now).
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_session12.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
stage ab1b4 100 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --runs 3 --out /tmp/r14 --variants fold_x
stage ab8b8 150 python3 bench/batch.py --presets llama-3.1-8b --builds 8 --runs 3 --out /tmp/r88 --variants fold_x
stage ab8b4 130 python3 bench/batch.py --presets llama-3.1-8b --builds 4 --runs 3 --out /tmp/r84 --variants fold_x
stage tl4 90 python3 bench/timeline_probe.py --batch 4 --requests 4 --options '{"fold_x": true}' --out "$OUT/tl4"
{ echo "total ${SECONDS}s"; cat /tmp/r14/batch.md /tmp/r88/batch.md /tmp/r84/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; tail -60 "$OUT/tl4.log"
