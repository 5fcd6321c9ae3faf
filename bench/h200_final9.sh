#!/usr/bin/env bash
# Session 9's last call: the official decode + TTFT figures with graph prefill (1B and 8B, copy bandwidth and the
# transformers peer in the same run), the batch gpu tests (graphs on every slot's prefill), and the 8B B = 8
# occupancy table (issue 9's missing row).
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=500, command="DEADLINE=480 bash bench/h200_final9.sh")
set -u
DEADLINE=${DEADLINE:-480}
. bench/device_stage.sh
stage decode 230 python3 bench/decode.py --presets llama-3.2-1b llama-3.1-8b --runs 3 --ttft 32 512 2000 --out /tmp/dec
stage batch_tests 80 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider tests/test_monokernel_batch_gpu.py -k "tiny or llama"
stage batch8b 140 python3 bench/batch.py --presets llama-3.1-8b --builds 8 --runs 2 --out /tmp/b8
{ echo "total ${SECONDS}s"; cat /tmp/dec/decode.md /tmp/b8/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; grep -hE "passed|failed" "$OUT"/batch_tests.log | tail -2
