#!/usr/bin/env bash
# Nsight Compute PC sampling of the monokernel (where warps stall), ONE H200, < 5 min:
#   llama-3.2-1b B = 1 (the default engine) and the B = 4 batched engine at 4 requests.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=420, command="bash bench/h200_ncu.sh")
#   LAYOUT=param_value+div32 CFGS=1:b1 bash bench/h200_ncu.sh: one variant, B = 1 only
set -u
DEADLINE=${DEADLINE:-400}
. bench/device_stage.sh
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
echo "ncu: $NCU" >> "$OUT/summary.txt"
export MK_NVRTC_EXTRA=-lineinfo
LAYOUT=${LAYOUT-}
mkdir -p /tmp/ncu
for cfg in ${CFGS:-1:b1 4:b4}; do  # batch:name
  set -- ${cfg/:/ }
  stage ncu_$2 150 "$NCU" --clock-control none --profile-from-start off --kernel-name monokernel --launch-count 2 \
    --section WarpStateStats --section SourceCounters --section SpeedOfLight -f -o "/tmp/prof_$2" \
    python3 bench/ncu_profile.py --preset llama-3.2-1b --batch "$1" --tokens 64 --layout "$LAYOUT"
  stage read_$2 60 python3 bench/ncu_profile.py --report "/tmp/prof_$2.ncu-rep" --out "/tmp/ncu/stalls_$2.json"
  "$NCU" --import "/tmp/prof_$2.ncu-rep" --page details --csv > "/tmp/ncu/details_$2.csv" 2>&1
done
python3 -c "from replicas.monokernel_build import kernel_source; open('/tmp/ncu/kernel_source.cu','w').write(kernel_source())"
# per-function samples (and with two reports what the second adds); everything else in one archive ($OUT keeps
# at most 8 files)
# (ncu caps both reports at the same sample count: the launch durations rescale the second, --details)
DETAILS=""; [ -f /tmp/ncu/details_b1.csv ] && [ -f /tmp/ncu/details_b4.csv ] && DETAILS="--details /tmp/ncu/details_b1.csv /tmp/ncu/details_b4.csv"
python3 bench/ncu_summary.py --source /tmp/ncu/kernel_source.cu $DETAILS /tmp/ncu/stalls_*.json >> "$OUT/summary.txt" 2>&1
tar czf "$OUT/ncu.tgz" -C /tmp/ncu .
cat "$OUT/summary.txt"
