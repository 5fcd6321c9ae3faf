#!/usr/bin/env bash
# Session 6, fourth call on ONE H200 (issue 3): the sm_shares calibration probe against the kernel's own
# per-block timeline (the plain-load probe picked the wrong blocks in call 3), then, if the ring probe
# finds the kernel's fast blocks, the sm_shares A/B and its gpu tests again.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_session6d.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
RES=/tmp/mk_s6d; mkdir -p "$RES"
stage tl_default 60 python3 bench/timeline_probe.py --out "$RES/tl"
stage sm_probe 60 python3 bench/sm_probe_check.py --timeline "$RES/tl/timeline.json" --out "$RES/smp"
AGREE=$(python3 -c "import json; print(json.load(open('$RES/smp/sm_probe.json'))['ring_4MB'].get('agree_with_kernel', 0))" 2>/dev/null || echo 0)
echo "ring probe agrees with the kernel on $AGREE blocks" >> "$OUT/summary.txt"
if [ "${AGREE:-0}" -lt 124 ]; then DEADLINE=$SECONDS; fi  # the calibration misses the kernel's fast SMs: stop here
stage tl_shares 60 python3 bench/timeline_probe.py --options '{"sm_shares": true}' --out "$RES/tl2"
stage ab_1b 90 python3 bench/decode.py --presets llama-3.2-1b --ab sm_shares --runs 3 --new-tokens 256 --out "$RES/1b"
stage ab_8b 90 python3 bench/decode.py --presets llama-3.1-8b --ab sm_shares --runs 3 --new-tokens 256 --out "$RES/8b"
MK_TEST_LAYOUT=sm_shares=1 stage tests 100 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider \
  tests/test_monokernel_gpu.py -k "tiny or llama"
cp "$RES/smp/sm_probe.json" "$OUT/" 2>/dev/null; cp "$RES/tl2/timeline.json" "$OUT/tl_shares.json" 2>/dev/null
cp "$RES/tl/timeline.json" "$OUT/tl_default.json" 2>/dev/null
{ echo "total ${SECONDS}s"; echo; cat "$RES/1b/ab.md" "$RES/8b/ab.md" 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; grep -v times_us "$OUT/sm_probe.log" | tail -8; head -3 "$RES/tl2/timeline.txt"
grep -E "^(lm matvec|lm barrier|gate/up|down |mlp barrier)" "$RES/tl2/timeline.txt"; tail -n 2 "$OUT/tests.log"
