#!/usr/bin/env bash
# Issue 9, second resident call (session 8). The first (h200_resident.sh) found a join's prefill taking
# 1,731 ms instead of 9 (it waited for the running launch to end: the join relaunched). Suspects: CUDA
# modules loaded during the launch (each slot's Prefill made its own kernel objects; lazy loading of cuBLAS
# GEMMs), the worker thread's first cuBLAS handle. Fixed by shared prefill kernels, a warm-up in the join
# worker before the first launch, and CUDA_MODULE_LOADING=EAGER for resident engines.
# 1. probe arms: lazy without / with warm-up, eager; 2. resident gpu tests; 3. resident bench (join cost).
# Predictions: lazy without warm-up: the first join still slow (>100 ms) or relaunched; lazy with warm-up:
# warmed-size joins ~prefill (10-30 ms on 16 SMs), unseen sizes maybe slow; eager: every join joins.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_resident2.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
RES=/tmp/mk_res2; mkdir -p "$RES"
stage probe_lazy_nowarm 70 python3 bench/resident_probe.py --no-warm --out "$RES/p1"
stage probe_lazy_warm 70 python3 bench/resident_probe.py --out "$RES/p2"
CUDA_MODULE_LOADING=EAGER stage probe_eager 90 python3 bench/resident_probe.py --out "$RES/p3"
stage res_tests 170 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider tests/test_monokernel_resident_gpu.py
stage res_bench 150 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --resident --peer --out "$RES/res"
{ echo "total ${SECONDS}s"; echo; for p in p1 p2 p3; do cat "$RES/$p/probe.json" 2>/dev/null; echo; done
  cat "$RES/res/batch.md" 2>/dev/null; } >> "$OUT/summary.txt"
cp "$RES/res/batch.json" "$OUT/resident.json" 2>/dev/null
cat "$OUT/summary.txt"; tail -n 30 "$OUT/res_tests.log"; tail -n 5 "$OUT"/probe_*.log
