#!/usr/bin/env bash
# Issue 9, session 19, sixth call (~1.5 min). Call 5 (bench/instantiate_beside_probe.py): no capture step waits beside a
# hold kernel or inside a real tiny resident launch, for any subset of the fused passes (every step < 1 ms). So the
# session test's 0.5 s on `s.end_capture()` is not the driver's instantiate waiting for the launch: likely the worker
# waiting to get the GIL back while another thread holds it in a blocking call. The watcher now also prints every
# other thread's stack when the worker is stuck.
# (First run of this call: every other thread idle meanwhile, so the 0.5 s is inside end_capture's C calls.)
# Now also every garbage collection >= 1 ms. Hypothesis: a cyclic GC triggered by end_capture's object allocations
# runs a finalizer that synchronizes the device (cudaFree / cudaFreeHost) and so waits for the launch; the fused
# passes only shift when the GC threshold is crossed. Prediction: a [gc] line in mk-join-prefill_0 of ~500 ms.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=150, command="DEADLINE=140 bash bench/h200_session19f.sh")
set -u
DEADLINE=${DEADLINE:-140}
. bench/device_stage.sh
TRACE_GC=1 TRACE_STUCK=1 MK_PREFILL_FUSED=1 stage tsf 110 python3 -m pytest -q -s -m gpu $PT -p no:cacheprovider \
  -p bench.trace_join_waits tests/test_monokernel_resident_gpu.py -k 'sessions_turns_join and tiny'
{ echo "total ${SECONDS}s"; echo "$(grep -E 'passed|failed' "$OUT/tsf.log" | tail -n 1)"
  grep -E "\[stuck\]|\[gc\]|end_capture|turns took" "$OUT/tsf.log" | grep -v "compileProgram" | cut -c1-330 | tail -n 60; } >> "$OUT/summary.txt"
