#!/usr/bin/env bash
# Issue 9, session 14, second call (~9 min). fx_pack's first A/B (bench/h200_session14.sh): 8B +4.7% (B = 4) and
# +7.4% (B = 8); 1B +1.5% (B = 4) and -1.2% (B = 8), against a predicted +5-6% on 1B. Here: the 8B batch gpu tests
# with fx_pack (before it becomes the default from hidden 4,096), the 1B A/Bs once more (is 1B's result noise?),
# the 1B B = 4 timelines with and without it (where did the predicted time not go?), and the single-sequence and
# session gpu tests of the tree (session 13's landing check, which found no machine).
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_session14b.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
MK_BATCH_TEST_PRESETS=llama-3.1-8b MK_BATCH_TEST_LAYOUT=fx_pack=1 stage t8b 140 python3 -m pytest -q -m gpu -x $PT \
  -p no:cacheprovider tests/test_monokernel_batch_gpu.py
stage ab4 60 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --runs 3 --out /tmp/a4 --variants fx_pack
stage ab8 50 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --runs 3 --out /tmp/a8 --variants fx_pack
stage tl4 50 python3 bench/timeline_probe.py --batch 4 --requests 4 --out "$OUT/tl4"
stage tl4p 50 python3 bench/timeline_probe.py --batch 4 --requests 4 --options '{"fx_pack": true}' --out "$OUT/tl4p"
stage single 90 python3 -m pytest -q -m gpu $PT -p no:cacheprovider tests/test_monokernel_gpu.py -k "tiny or llama"
stage sessions 80 python3 -m pytest -q -m gpu $PT -p no:cacheprovider tests/test_monokernel_sessions_gpu.py
{ echo "total ${SECONDS}s"; cat /tmp/a4/batch.md /tmp/a8/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; for s in t8b single sessions; do echo "$s: $(grep -hE "passed|failed" "$OUT/$s.log" | tail -1)"; done
grep -h '"delta"' "$OUT"/ab*.log; ls "$OUT"/tl4 "$OUT"/tl4p 2>/dev/null
