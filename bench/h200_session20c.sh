#!/usr/bin/env bash
# Issue 9, session 20, third call (~5 min): the join cost with the fused prefill passes on (the default since call 2)
# and off, alternating, 14 joins each, with CUDA_MODULE_LOADING=EAGER as a resident replica runs (batch.py now sets it
# for --resident; calls 1-2 ran lazy, and the engine warned that a kernel loaded at a join waits for the launch).
# Call 2's fused run had a tail (worst +3.7 ms beyond the prefill, a running slot's worst gap 7.7 ms) that call 1's
# fused run did not (+1.74, 2.6 ms). Predictions: medians +0.4..0.9 ms both ways, fused's prefill ~0.7 ms shorter;
# with eager loading no worst gap over ~3 ms (two steps plus a join's hand-over) either way.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=360, command="DEADLINE=345 bash bench/h200_session20c.sh")
set -u
DEADLINE=${DEADLINE:-345}
. bench/device_stage.sh
PEER=--peer; n=0
for f in 1 0 1 0; do
  n=$((n + 1)); MK_PREFILL_FUSED=$f stage j${n}_f$f 80 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --resident \
    $PEER --runs 1 --joins 14 --out /tmp/j${n}_f$f
  PEER=""
done
{ echo "total ${SECONDS}s"
  for d in /tmp/j*_f*; do s=$(basename $d); echo "== $s"; grep -E "module loading|stalled" "$OUT/$s.log" | cut -c1-160 | head -n 2
    grep -E "^\| llama|^joins" $d/batch.md; cp $d/batch.json "$OUT/$s.json"; done
} >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
