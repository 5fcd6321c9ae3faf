#!/usr/bin/env bash
# Issue 9, the next resident call (written in session 8, ~6 min): 1. the mma.sync join GEMM's gpu tests
# (tests/test_prefill_gemm_gpu.py: float64 reference, determinism, runs beside a kernel on 116 SMs) and the
# resident gpu tests (fixed after session 8's 4/6 run; both join GEMM modes vs the tensor-core prefill);
# 2. the probe (which join mode the engine picked, join TTFTs for 40 / 60 / 300 / 1500 tokens); 3. the bench
# (per-request tok/s at 1 / 2 / 4 of 4, the join's cost beyond its prefill, peer and copy bandwidth).
# Predictions: the mma GEMM passes and runs beside (no clusters); the engine picks "mma"; a 40-token join's
# prefill ~3-6 ms on 16 SMs (fp32: 50-60 ms), so join TTFT ~15 ms and beyond-prefill <= 1 ms; 300 tokens joins.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_resident4.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
RES=/tmp/mk_res4; mkdir -p "$RES"
stage gemm_tests 120 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider tests/test_prefill_gemm_gpu.py
stage res_tests 200 python3 -m pytest -q -m gpu $PT -p no:cacheprovider -rA tests/test_monokernel_resident_gpu.py
stage probe 80 python3 bench/resident_probe.py --lengths 40 60 300 1500 --out "$RES/p"
stage res_bench 150 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --resident --peer --out "$RES/res"
{ echo "total ${SECONDS}s"; echo; cat "$RES/p/probe.json" 2>/dev/null; echo; cat "$RES/res/batch.md" 2>/dev/null; } >> "$OUT/summary.txt"
cp "$RES/res/batch.json" "$OUT/resident.json" 2>/dev/null
cat "$OUT/summary.txt"; grep -h "resident joins: GEMM" "$OUT"/*.log | sort -u | head -3
grep -hE "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/gemm_tests.log" "$OUT/res_tests.log" | tail -20
