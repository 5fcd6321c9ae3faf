#!/usr/bin/env bash
# Issue 9, session 16, third call (~6 min): the batch defaults with pair_dn and ao_onepass (commit after a45efaa):
# 8B batch gpu tests on them; the resident 1B table and the 1B table with the peer; the per-block timeline of 1B
# B = 4 with two new marks inside "sample+emit" (10.75 us per step in session 15: where does it go?); pair_norm on
# 1B B = 4 again (session 14: -1%) now that pair_dn runs the launch in clusters anyway.
# Predictions: 1B B = 4 ~0.785 of B = 1 (call 1: 0.776 on pair_dn, +1.2%); resident 1B at 8 ~5,800 tok/s.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_session16c.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
MK_BATCH_TEST_PRESETS=llama-3.1-8b stage t8 200 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider \
  tests/test_monokernel_batch_gpu.py
stage t1 80 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --runs 2 --peer --out /tmp/t1
stage r8 90 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --resident --peer --out /tmp/r8
stage tl 45 python3 bench/timeline_probe.py --batch 4 --requests 4 --out /tmp/tl
stage ab4 50 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --runs 3 --out /tmp/a4 --variants pair_norm
{ echo "total ${SECONDS}s"; tail -n 2 "$OUT/t8.log"; cat /tmp/t1/batch.md /tmp/r8/batch.md /tmp/a4/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cp -r /tmp/tl "$OUT/tl" 2>/dev/null
cat "$OUT/summary.txt"; grep -h '"delta"' "$OUT"/ab*.log; head -32 "$OUT/tl.log" | tail -30
