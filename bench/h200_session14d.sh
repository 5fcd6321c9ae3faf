#!/usr/bin/env bash
# Issue 9, session 14, fourth call (~3 min): is pair_norm still worth it on 8B now that fx_pack halves the prologues'
# bytes too? pair_norm won +3.3-3.8% (B = 4) and +14.1% (B = 8) in session 13 by splitting each prologue's reads over
# a block pair; with fx_pack those reads are half as large, so its three cluster barriers per prologue may now cost
# more than the split saves (as on 1B). A/B of the new defaults against pair_norm=0.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=400, command="bash bench/h200_session14d.sh")
set -u
DEADLINE=${DEADLINE:-380}
. bench/device_stage.sh
stage p84 90 python3 bench/batch.py --presets llama-3.1-8b --builds 4 --runs 3 --out /tmp/p4 --variants pair_norm=0
stage p88 90 python3 bench/batch.py --presets llama-3.1-8b --builds 8 --runs 2 --out /tmp/p8 --variants pair_norm=0
{ echo "total ${SECONDS}s"; cat /tmp/p4/batch.md /tmp/p8/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; grep -h '"delta"' "$OUT"/p8*.log
