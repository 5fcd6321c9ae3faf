#!/usr/bin/env bash
# Issue 9, third resident call (session 8): the joins' prefill checked at engine start to run beside a kernel
# holding the launch's SMs (replicas/concurrency_check.py), bf16 tensor cores with cuBLAS's SM target set to
# the free SMs, else fp32 SIMT GEMMs (bench/gemm_concurrency_probe.py: tensor-core GEMMs of some shapes waited).
# Predictions: the SM target alone may not avoid the waiting shapes (then mode fp32); every join joins
# (0 relaunches in the gpu test); join cost beyond prefill <= 1 ms; fp32 prefill of 40 tokens ~15-25 ms.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_resident3.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
RES=/tmp/mk_res3; mkdir -p "$RES"
stage probe 80 python3 bench/resident_probe.py --lengths 40 60 300 --out "$RES/p"
stage res_tests 200 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider tests/test_monokernel_resident_gpu.py
stage res_bench 150 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --resident --peer --out "$RES/res"
{ echo "total ${SECONDS}s"; echo; cat "$RES/p/probe.json" 2>/dev/null; echo; cat "$RES/res/batch.md" 2>/dev/null; } >> "$OUT/summary.txt"
cp "$RES/res/batch.json" "$OUT/resident.json" 2>/dev/null
cat "$OUT/summary.txt"; grep -h "resident joins" "$OUT"/*.log | head -5; tail -n 30 "$OUT/res_tests.log"
