#!/usr/bin/env bash
# Issue 9, session 16, first call (~9.5 min). (1) ao_onepass (csrc/mk_attn_o.cuh): the batch O stage's split
# statistics and outputs in one dependent L2 round trip (online softmax per thread) instead of two with a block
# barrier and the split weights in shared memory between them. Correctness first: the 8-slot batch gpu tests with
# it (tiny, 1B; 1B's B = 8 build also pairs for pair_norm and pair_dn, the batch defaults since commit afc0a12),
# then A/Bs at full occupancy. Prediction (session 15's timeline, 1B B = 4: o wait+stage 5.45 us per layer): one
# L2 round trip + two block barriers + the weights pass, ~0.7..1.0 us per layer -> +1..1.5% at 1B B = 4, less at
# B = 8 (2 splits a slot), 8B similar. (2) The 1B occupancy table on the pair_dn defaults with the peer.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_session16.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
MK_BATCH_TEST_SLOTS=8 MK_BATCH_TEST_LAYOUT=ao_onepass=1 stage bt8 150 python3 -m pytest -q -x $PT -m gpu \
  -p no:cacheprovider tests/test_monokernel_batch_gpu.py
stage ab4 60 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --runs 3 --out /tmp/a4 --variants ao_onepass
stage ab8 50 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --runs 2 --out /tmp/a8 --variants ao_onepass
stage ab84 90 python3 bench/batch.py --presets llama-3.1-8b --builds 4 --runs 2 --out /tmp/b4 --variants ao_onepass
stage t1 100 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --runs 2 --peer --out /tmp/t1
{ echo "total ${SECONDS}s"; tail -n 2 "$OUT/bt8.log"; cat /tmp/a4/batch.md /tmp/a8/batch.md /tmp/b4/batch.md /tmp/t1/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; grep -h '"delta"' "$OUT"/ab*.log
