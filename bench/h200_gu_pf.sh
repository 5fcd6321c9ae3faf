#!/usr/bin/env bash
# Issue 9, session 12, one H200 (~3.5 min, the session's last device minutes): layout option gu_pf (each warp warms
# the part of its gate/up run beyond its weight ring into L2 while the attention chain leaves HBM idle) A/B at B = 4
# of 4: llama-3.2-1b 8 and 16 KB per warp, llama-3.1-8b 16 KB per warp (default = the batch defaults, A B A B;
# tokens must match: the prefetch is only a hint).
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=300, command="bash bench/h200_gu_pf.sh")
set -u
DEADLINE=${DEADLINE:-215}
. bench/device_stage.sh
stage ab1b 100 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --runs 3 --out /tmp/g1 --variants gu_pf=8192 gu_pf=16384
stage ab8b 100 python3 bench/batch.py --presets llama-3.1-8b --builds 4 --runs 2 --out /tmp/g8 --variants gu_pf=16384
{ echo "total ${SECONDS}s"; cat /tmp/g1/batch.md /tmp/g8/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; grep -h '^{"batch"' "$OUT"/ab*.log
