#!/usr/bin/env bash
# Issue 9, session 16, second call (~9.5 min): ao_onepass again (first call: +1.2% 1B B = 4, +0.3% 1B B = 8, +1.9%
# 8B B = 4; 8-slot batch gpu tests 14/14 with it): its resident gpu tests, a repeat A/B at 1B B = 4 and B = 2, 8B
# B = 8; then the 8B occupancy table on the pair_dn defaults with the peer (prediction: 8B at 4 ~0.87 of B = 1).
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_session16b.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
MK_RESIDENT_TEST_LAYOUT=ao_onepass=1 stage tr 110 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider \
  tests/test_monokernel_resident_gpu.py
stage ab4 55 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --runs 3 --out /tmp/a4 --variants ao_onepass
stage ab2 45 python3 bench/batch.py --presets llama-3.2-1b --builds 2 --runs 3 --out /tmp/a2 --variants ao_onepass
stage ab88 90 python3 bench/batch.py --presets llama-3.1-8b --builds 8 --runs 2 --out /tmp/b8 --variants ao_onepass
stage t8 200 python3 bench/batch.py --presets llama-3.1-8b --builds 8 --runs 2 --peer --out /tmp/t8
{ echo "total ${SECONDS}s"; tail -n 2 "$OUT/tr.log"; cat /tmp/a4/batch.md /tmp/a2/batch.md /tmp/b8/batch.md /tmp/t8/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; grep -h '"delta"' "$OUT"/ab*.log
