#!/usr/bin/env bash
# Issue 9, session 16, first call (~9.5 min): the batch defaults with pair_dn (layout_tuned.batch_options, commit
# afc0a12): the 8-slot batch gpu tests (tiny, 1B: 1B's B = 8 build pairs for pair_norm and pair_dn), the occupancy
# tables of 1B and 8B and the resident 1B table, each with the transformers peer and the copy roofline in the same
# run; then, if time is left, pair_norm on 1B B = 4 again now that pair_dn clusters the launch anyway.
# Prediction: 1B per request at 4 ~0.775 of B = 1 (session 15: 0.762, +1..2%), aggregate at 8 ~6,300 tok/s;
# 8B at 4 ~0.87 (session 14: 0.834, +4%); resident 1B at 8 ~5,700.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_session16.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
MK_BATCH_TEST_SLOTS=8 stage bt8 150 python3 -m pytest -q -x $PT -m gpu -p no:cacheprovider tests/test_monokernel_batch_gpu.py
stage t1 100 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --runs 2 --peer --out /tmp/t1
stage r8 100 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --resident --peer --out /tmp/r8
stage t8 170 python3 bench/batch.py --presets llama-3.1-8b --builds 8 --runs 2 --peer --out /tmp/t8
stage ab4 60 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --runs 3 --out /tmp/a4 --variants pair_norm
{ echo "total ${SECONDS}s"; tail -n 2 "$OUT/bt8.log"; cat /tmp/t1/batch.md /tmp/r8/batch.md /tmp/t8/batch.md /tmp/a4/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
