#!/usr/bin/env bash
# Issue 9, next session, one H200 (~7 min): first bench/cluster_probe.py (does a cooperative grid launch in clusters
# of 2, and what do pairs save on the prologue and atomics patterns), then layout option pair_norm (the batch
# prologues' L2 reads split over block pairs, DSMEM; built and CPU-emulated in session 12) A/B at B = 4 of 4 on
# llama-3.2-1b and llama-3.1-8b and at B = 8 on 1B, then the batch gpu tests with it. Prediction: ~+2.5% at 1B
# B = 4 (33 prologues per step at ~1.9-2.4 us, about a third of that saved), more at B = 8. If the probe's
# cooperative cluster launch fails, the A/Bs fail at their first launch: read cp.log first.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_pair_norm.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
stage cp 60 python3 bench/cluster_probe.py --out "$OUT/cp"
# the launch path the probe found working: CuPy's cooperative launch with the compiled-in cluster shape, else
# cuLaunchKernelEx (replicas/cluster_launch.py)
MK_CLUSTER_LAUNCH=$(python3 -c "
import json, sys
r = json.load(open(sys.argv[1]))['launch']
print('cupy' if r.get('cupy_cooperative_cluster_dims_2') == 'ok' or r.get('ex_cooperative_cluster_dims_2') != 'ok' else 'ex')
" "$OUT/cp/cluster_probe.json" 2>/dev/null || echo cupy)
export MK_CLUSTER_LAUNCH; echo "MK_CLUSTER_LAUNCH=$MK_CLUSTER_LAUNCH" >> "$OUT/summary.txt"
stage ab1b4 100 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --runs 3 --out /tmp/p14 --variants pair_norm
stage ab1b8 100 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --runs 3 --out /tmp/p18 --variants pair_norm
stage ab8b4 130 python3 bench/batch.py --presets llama-3.1-8b --builds 4 --runs 2 --out /tmp/p84 --variants pair_norm
MK_BATCH_TEST_LAYOUT=pair_norm=1 stage tests 120 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider \
  tests/test_monokernel_batch_gpu.py -k "tiny or llama"
{ echo "total ${SECONDS}s"; cat /tmp/p14/batch.md /tmp/p18/batch.md /tmp/p84/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; tail -30 "$OUT/cp.log"; grep -hE "passed|failed|Error" "$OUT"/tests.log | tail -6
