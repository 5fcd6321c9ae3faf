#!/usr/bin/env bash
# Session 11's last one-H200 call (issue 9): the resident engine on the new batch defaults (mma_qkv + mma_o, whose
# resident builds run on 116 SMs with the QKV k-split S = 4): its gpu tests, then the resident B = 4 bench on 1B
# with the peer (join TTFT beyond its own prefill, lone request vs the single engine).
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=450, command="bash bench/h200_session11d.sh")
set -u
DEADLINE=${DEADLINE:-420}
. bench/device_stage.sh
stage res_tests 210 python3 -m pytest -q -m gpu $PT -p no:cacheprovider -rA tests/test_monokernel_resident_gpu.py
stage res_bench 150 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --resident --peer --out /tmp/res
{ echo "total ${SECONDS}s"; cat /tmp/res/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; grep -hE "passed|failed|Error" "$OUT"/res_tests.log | tail -6
