#!/usr/bin/env bash
# Session 9: CUDA-graph prefill (replicas/prefill_graph.py). 1. its gpu tests (replay == eager pass, both GEMM
# modes, fresh prompts and session suffixes; padding rows never stored); 2. bench/prefill_probe.py (wall / host /
# GPU ms per length; eager figures of the same probe before graphs: 32 tokens 18.4 / 18.3 / 1.86 ms);
# 3. TTFT with copy bandwidth and the transformers peer (bench/decode.py, 1B); 4. session turn-2 TTFT
# (bench/mk_sessions.py); 5. the engine's gpu tests vs transformers (graphs on); 6. resident tests, join probe
# and bench (joins' prefill from graphs on the 16 free SMs). Predictions: 32-token prefill wall ~2-2.5 ms (GPU
# 1.9 ms), TTFT 32 tokens 10.8 -> ~3 ms; turn-2 with reuse 14.4 -> ~4 ms; a 40-token join's TTFT 31 -> ~8 ms.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_graphs.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
stage graph_tests 120 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider -rA tests/test_prefill_graph_gpu.py
stage probe 60 python3 bench/prefill_probe.py --out /tmp/pp
stage ttft 100 python3 bench/decode.py --presets llama-3.2-1b --runs 1 --new-tokens 256 --ttft 32 512 2000 --out /tmp/dec
stage sessions 60 python3 bench/mk_sessions.py --out /tmp/ms
stage res 140 bash -c "python3 bench/resident_probe.py --lengths 40 60 300 --out /tmp/rp && python3 bench/batch.py --presets llama-3.2-1b --builds 4 --resident --out /tmp/rb"
stage mk_tests 100 python3 -m pytest -q -m gpu $PT -p no:cacheprovider tests/test_monokernel_gpu.py
stage res_tests 150 python3 -m pytest -q -m gpu $PT -p no:cacheprovider -rA tests/test_monokernel_resident_gpu.py
{ echo "total ${SECONDS}s"; cat /tmp/dec/decode.md /tmp/ms/mk_sessions.md /tmp/rp/probe.json /tmp/rb/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; grep -hE "passed|failed" "$OUT"/*tests.log | tail -6
