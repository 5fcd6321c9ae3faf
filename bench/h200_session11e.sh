#!/usr/bin/env bash
# Session 11: the resident gpu tests again after aligning their oracles with the tensor-core batch defaults.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=200, command="bash bench/h200_session11e.sh")
set -u
DEADLINE=${DEADLINE:-190}
. bench/device_stage.sh
stage res_tests 180 python3 -m pytest -q -m gpu $PT -p no:cacheprovider -rA tests/test_monokernel_resident_gpu.py
cat "$OUT/summary.txt"; grep -hE "^(PASSED|FAILED|E  )|passed|failed" "$OUT"/res_tests.log | tail -20
