#!/usr/bin/env bash
# Issue 9, session 16, fifth call (~3 min, the session's last device time): best_max a batch default. The 1B table
# with the peer on the new defaults, and best_max turned off against them on 1B B = 4 and 8B B = 8 (second A/Bs).
# Prediction: 1B at 4 ~0.795 of B = 1 (call 3: 0.787; +1.1%), at 8 ~0.65; turning best_max off -1% (1B), ~0% (8B).
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=300, command="DEADLINE=280 bash bench/h200_session16e.sh")
set -u
DEADLINE=${DEADLINE:-280}
. bench/device_stage.sh
stage t1 80 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --runs 2 --peer --out /tmp/t1
stage ab4 45 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --runs 3 --out /tmp/a4 --variants best_max=0
stage ab88 90 python3 bench/batch.py --presets llama-3.1-8b --builds 8 --runs 2 --out /tmp/b8 --variants best_max=0
{ echo "total ${SECONDS}s"; cat /tmp/t1/batch.md /tmp/a4/batch.md /tmp/b8/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; grep -h '"delta"' "$OUT"/ab*.log
