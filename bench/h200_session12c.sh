#!/usr/bin/env bash
# Issue 9, session 12, one H200 (~4.5 min, the session's last device minutes): the llama-3.1-8b occupancy table on
# the batch defaults with fold_x, with copy bandwidth and the transformers peer in the same run.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=320, command="bash bench/h200_session12c.sh")
set -u
DEADLINE=${DEADLINE:-290}
. bench/device_stage.sh
stage table8b 280 python3 bench/batch.py --presets llama-3.1-8b --builds 8 --runs 2 --peer --out /tmp/t8
{ echo "total ${SECONDS}s"; cat /tmp/t8/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; grep -h '^{' "$OUT/table8b.log" | tail -8
