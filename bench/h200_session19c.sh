#!/usr/bin/env bash
# Issue 9, session 19, third call (~3 min). Call 2b: with MK_PREFILL_FUSED=1 the tiny session test's turn 2 blocks
# 500 ms in PrefillGraphs._capture's s.end_capture() (cudaStreamEndCapture + cudaGraphInstantiate) beside the running
# launch, until the stall guard's yield; no CuPy module is built then. Which fused pass makes instantiation wait?
# Runs: every fused pass with CUDA_MODULE_LOADING=EAGER (if it passes: a lazily loaded function in the graph), then
# each pass alone (MK_PREFILL_FUSED_OPS=add / rms / kv).
# Prediction: EAGER passes (lazy loading at instantiate); of the single passes, only the one whose kernel the graph
# first instantiates beside the launch fails (guess: add, mk_add_parts, split-K linears).
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=300, command="DEADLINE=290 bash bench/h200_session19c.sh")
set -u
DEADLINE=${DEADLINE:-290}
. bench/device_stage.sh
run1() { stage "$1" 60 python3 -m pytest -q -s -m gpu $PT -p no:cacheprovider -p bench.trace_join_waits \
  tests/test_monokernel_resident_gpu.py -k 'sessions_turns_join and tiny'; }
TRACE_STUCK=1 CUDA_MODULE_LOADING=EAGER MK_PREFILL_FUSED=1 run1 eager
for ops in add rms kv; do TRACE_STUCK=1 MK_PREFILL_FUSED=1 MK_PREFILL_FUSED_OPS=$ops run1 only_$ops; done
{ echo "total ${SECONDS}s"
  for s in eager only_add only_rms only_kv; do echo "== $s: $(grep -E 'passed|failed' "$OUT/$s.log" | tail -n 1)"
    grep -E "turns took|end_capture|under way" "$OUT/$s.log" | cut -c1-200 | head -n 6; done; } >> "$OUT/summary.txt"
