#!/usr/bin/env bash
# Session 6, last call on ONE H200 (issue 9): the batched engine on the new defaults (o_align + zero_spread
# joined gu_il + ao_slots + sub_builds): all batch gpu tests, and the B = 4 occupancy figures.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=300, command="bash bench/h200_session6f.sh")
set -u
DEADLINE=${DEADLINE:-280}
. bench/device_stage.sh
stage batch_tests 120 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider tests/test_monokernel_batch_gpu.py
stage batch_bench 120 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --out /tmp/mk_s6f
{ echo "total ${SECONDS}s"; echo; cat /tmp/mk_s6f/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; tail -n 2 "$OUT/batch_tests.log"
