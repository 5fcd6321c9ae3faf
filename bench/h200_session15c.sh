#!/usr/bin/env bash
# Issue 9, session 15, third call (~7 min): pair_dn before it becomes a batch default. Second call (eb6e0f7): batch
# gpu tests 14/14 with it, A/Bs 1B B = 4 +2.1%, B = 8 +2.6%, 8B B = 4 +4.4%. Here: the resident gpu tests and the 8B
# batch gpu tests with it, and repeat A/Bs (1B B = 4, 1B B = 2, 8B B = 8) before the defaults change.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_session15c.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
MK_RESIDENT_TEST_LAYOUT=pair_dn=1 stage tr 110 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider \
  tests/test_monokernel_resident_gpu.py
MK_BATCH_TEST_PRESETS=llama-3.1-8b MK_BATCH_TEST_LAYOUT=pair_dn=1 stage t8 200 python3 -m pytest -q -m gpu -x $PT \
  -p no:cacheprovider tests/test_monokernel_batch_gpu.py
stage ab4 70 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --runs 3 --out /tmp/a4 --variants pair_dn
stage ab2 60 python3 bench/batch.py --presets llama-3.2-1b --builds 2 --runs 3 --out /tmp/a2 --variants pair_dn
stage ab88 90 python3 bench/batch.py --presets llama-3.1-8b --builds 8 --runs 2 --out /tmp/b8 --variants pair_dn
{ echo "total ${SECONDS}s"; cat /tmp/a4/batch.md /tmp/a2/batch.md /tmp/b8/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; grep -hE "passed|failed|Error" "$OUT"/tr.log "$OUT"/t8.log | tail -6
grep -h '"delta"' "$OUT"/ab*.log
