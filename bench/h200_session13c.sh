#!/usr/bin/env bash
# Session 13's last call (~5 min): the gpu tests of the single, batch, resident and session paths on the commit that
# lands (attn_lanes removed, pair_norm the batch default from hidden 4,096), so the stop's state is checked on a GPU.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_session13c.sh")
set -u
DEADLINE=${DEADLINE:-400}
. bench/device_stage.sh
stage single 100 python3 -m pytest -q -m gpu $PT -p no:cacheprovider tests/test_monokernel_gpu.py -k "tiny or llama"
stage batch 100 python3 -m pytest -q -m gpu $PT -p no:cacheprovider tests/test_monokernel_batch_gpu.py
stage resident 100 python3 -m pytest -q -m gpu $PT -p no:cacheprovider tests/test_monokernel_resident_gpu.py
stage sessions 80 python3 -m pytest -q -m gpu $PT -p no:cacheprovider tests/test_monokernel_sessions_gpu.py
echo "total ${SECONDS}s" >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; for s in single batch resident sessions; do echo "$s: $(grep -hE "passed|failed" "$OUT/$s.log" | tail -1)"; done
grep -hE "^FAILED|Error" "$OUT"/*.log | head -10
