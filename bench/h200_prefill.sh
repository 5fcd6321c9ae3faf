#!/usr/bin/env bash
# Session 9: where the prefill's time goes (host launch cost vs GPU, per GEMM mode; bench/prefill_probe.py)
# and the join GEMM modes' logits test at the 1e-2 bound. ~3 min.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=420, command="bash bench/h200_prefill.sh")
set -u
DEADLINE=${DEADLINE:-400}
. bench/device_stage.sh
stage prefill_probe 200 python3 bench/prefill_probe.py --out "$OUT"
stage mode_tests 150 python3 -m pytest -q -m gpu $PT -p no:cacheprovider -rA -k join_gemm_modes tests/test_monokernel_resident_gpu.py
cat "$OUT/summary.txt"; grep -E "passed|failed" "$OUT/mode_tests.log" | tail -3
