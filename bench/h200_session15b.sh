#!/usr/bin/env bash
# Issue 9, session 15, second call (~9 min): pair_dn (csrc/mk_mlp_mma.cuh: blocks in clusters of two; each writes its
# h slice into both blocks' shared memory, and each downs half the output rows over the pair's h rows, so the down
# issues half the fixed-point atomics). Correctness first (batch gpu tests with it, tiny + 1B, against the single
# engine and transformers), then A/Bs at full occupancy and a timeline. Prediction (session 14's timeline, 1B B = 4
# layer 55.05 us: fx_pack's halving of the atomics netted -3.2 us per layer): the down and its atomics -1.5, the MLP
# barrier and the prologues' wait behind the drain -0.5, the cluster barrier +0.3..0.5: ~-1.5..-2 us per layer ->
# +2..3% at 1B B = 4; 1B B = 8 (with pair_norm, twice the atomics per block) +3..4%; 8B B = 4 +1.5..2.5%.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_session15b.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
MK_BATCH_TEST_LAYOUT=pair_dn=1 stage tb 110 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider \
  tests/test_monokernel_batch_gpu.py
stage ab4 80 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --runs 3 --out /tmp/a4 --variants pair_dn
stage ab8 75 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --runs 3 --out /tmp/a8 --variants pair_dn
stage ab84 100 python3 bench/batch.py --presets llama-3.1-8b --builds 4 --runs 3 --out /tmp/b4 --variants pair_dn
stage tl 45 python3 bench/timeline_probe.py --batch 4 --requests 4 --options '{"pair_dn": true}' --out /tmp/tl
{ echo "total ${SECONDS}s"; cat /tmp/a4/batch.md /tmp/a8/batch.md /tmp/b4/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cp -r /tmp/tl "$OUT/tl" 2>/dev/null
cat "$OUT/summary.txt"; grep -hE "passed|failed|Error" "$OUT"/tb.log | tail -6
grep -h '"delta"' "$OUT"/ab*.log
