#!/usr/bin/env bash
# Issue 9, session 19, fourth call (~2.5 min). Call 3: the tiny session test's turn-2 wait (end_capture blocking 0.5 s
# beside the launch) happened with every fused pass and CUDA_MODULE_LOADING=EAGER (run first, on a cold CuPy
# kernel cache), and not with any single pass (runs 2-4, cache warm). Every failing run so far was a process that
# compiled the kernels itself (first on a fresh machine); the unfused passes ran on a warm cache. Is it the cold
# cache, not the fused passes? A: unfused, cold cache (a fresh CUPY_CACHE_DIR); B: fused, warm; C: fused, cold.
# Prediction if the cache is the cause: A fails, B passes, C fails. If fused is: A passes, B and C fail.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=300, command="DEADLINE=290 bash bench/h200_session19d.sh")
set -u
DEADLINE=${DEADLINE:-290}
. bench/device_stage.sh
run1() { stage "$1" 70 python3 -m pytest -q -s -m gpu $PT -p no:cacheprovider -p bench.trace_join_waits \
  tests/test_monokernel_resident_gpu.py -k 'sessions_turns_join and tiny'; }
TRACE_STUCK=1 CUPY_CACHE_DIR=/tmp/cupy_a MK_PREFILL_FUSED=0 run1 A_unfused_cold
TRACE_STUCK=1 CUPY_CACHE_DIR=/tmp/cupy_a MK_PREFILL_FUSED=1 run1 B_fused_warm
TRACE_STUCK=1 CUPY_CACHE_DIR=/tmp/cupy_c MK_PREFILL_FUSED=1 run1 C_fused_cold
{ echo "total ${SECONDS}s"
  for s in A_unfused_cold B_fused_warm C_fused_cold; do echo "== $s: $(grep -E 'passed|failed' "$OUT/$s.log" | tail -n 1)"
    grep -E "turns took|end_capture|under way" "$OUT/$s.log" | cut -c1-200 | head -n 6; done; } >> "$OUT/summary.txt"
