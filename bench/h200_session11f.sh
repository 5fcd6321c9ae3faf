#!/usr/bin/env bash
# (Ran at beb5af3, where the halving was the default: the 1B gpu tests passed 7/7 on it, both A/Bs hit their stage
# limits. The halving is now layout option half_vec, off: bench/h200_half_vec.sh is the A/B to run.)
# Session 11's last call (~4 min of device time left): with all four of mma_qkv/mma_o/mma_mlp/mma_lm on, a batch
# build's staged inputs are all bf16, so they now take half the shared memory and the weight ring gets the rest
# (8B B = 8: 9 -> 17 slots per warp; 1B B = 8: 17 -> 21). A/B against the old depth through max_ring (same code),
# then the batch gpu tests on 1B.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=240, command="bash bench/h200_session11f.sh")
set -u
DEADLINE=${DEADLINE:-225}
. bench/device_stage.sh
stage ab8b8 95 python3 bench/batch.py --presets llama-3.1-8b --builds 8 --runs 3 --out /tmp/r8 --variants max_ring=9
stage tests 70 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider tests/test_monokernel_batch_gpu.py -k "llama"
stage ab1b8 50 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --runs 3 --out /tmp/r1 --variants max_ring=17
{ echo "total ${SECONDS}s"; cat /tmp/r8/batch.md /tmp/r1/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; grep -hE "passed|failed|Error" "$OUT"/tests.log | tail -6
