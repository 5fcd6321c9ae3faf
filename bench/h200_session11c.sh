#!/usr/bin/env bash
# (Ran once in session 11 at f9876d6: dn_group lost, -0.4% to -5.3%, and was removed; the script needs that commit.)
# Session 11's third one-H200 call (issue 9): layout option dn_group (the down partials of G blocks summed by the
# last of them before the int64 atomics; csrc/mk_mlp_mma.cuh) A/B on the batched engine's defaults: 1B at B = 4
# (G = 2, 4) and B = 8 (G = 4), 8B at B = 4 (G = 4); the batch gpu tests with dn_group=4; the B = 4 timeline with
# it; then the 8B occupancy table with the peer on the defaults.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_session11c.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
stage ab1b4 110 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --runs 3 --out /tmp/a4 --variants dn_group=2 dn_group=4
stage ab1b8 60 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --runs 3 --out /tmp/a8 --variants dn_group=4
stage ab8b4 80 python3 bench/batch.py --presets llama-3.1-8b --builds 4 --runs 3 --out /tmp/b4 --variants dn_group=4
MK_BATCH_TEST_LAYOUT=dn_group=4 stage tests 100 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider \
  tests/test_monokernel_batch_gpu.py -k "tiny or llama"
stage tl_b4_g4 40 python3 bench/timeline_probe.py --batch 4 --requests 4 --options '{"dn_group": 4}' --out /tmp/tlg
stage table8b 200 python3 bench/batch.py --presets llama-3.1-8b --builds 8 --runs 2 --peer --out /tmp/t8
{ echo "total ${SECONDS}s"; cat /tmp/a4/batch.md /tmp/a8/batch.md /tmp/b4/batch.md /tmp/t8/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; grep -hE "passed|failed|Error" "$OUT"/tests.log | tail -6
