#!/usr/bin/env bash
# Session 6, fourth call on ONE H200 (issue 3): sm_shares calibrated by the kernel itself (each block's LM-head
# time over 8 steps of one launch at engine start; the separate probes of call 3/4 picked the wrong blocks).
# 1. timeline probe on sm_shares (do the fast SMs still wait?); 2. A/B on 1B and 8B;
# 3. gpu tests vs transformers on sm_shares, and the batch gpu tests on it;
# 4. the official decode run (512 tokens, peer, TTFT) on the default, or with sm_shares if the 1B A/B gained > 0.5%
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_session6d.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
RES=/tmp/mk_s6c; mkdir -p "$RES"
stage tl_shares 60 python3 bench/timeline_probe.py --options '{"sm_shares": true}' --out "$RES/tl"
stage ab_1b 90 python3 bench/decode.py --presets llama-3.2-1b --ab sm_shares --runs 3 --new-tokens 256 --out "$RES/1b"
stage ab_8b 90 python3 bench/decode.py --presets llama-3.1-8b --ab sm_shares --runs 3 --new-tokens 256 --out "$RES/8b"
MK_TEST_LAYOUT=sm_shares=1 stage tests 100 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider \
  tests/test_monokernel_gpu.py -k "tiny or llama"
LAYOUT=$(python3 - "$RES/1b/ab.json" <<'PY'
import json, sys
try:
    import statistics
    rows = json.load(open(sys.argv[1]))
    d = {k: statistics.median([x for r in rows if r["layout"] == k for x in r["runs"]]) for k in ("default", "sm_shares")}
    print("sm_shares" if d["sm_shares"] > 1.005 * d["default"] else "")
except Exception:
    print("")
PY
)
echo "official layout: '${LAYOUT}'" >> "$OUT/summary.txt"
stage official 240 python3 bench/decode.py --presets llama-3.2-1b llama-3.1-8b --runs 5 --ttft 32 512 2000 \
  ${LAYOUT:+--layout $LAYOUT} --out "$RES/dec"
cp "$RES/tl/timeline.json" "$OUT/tl_shares.json" 2>/dev/null; cp "$RES/tl/timeline.txt" "$OUT/tl_shares.txt" 2>/dev/null
cp "$RES/dec/decode.json" "$OUT/" 2>/dev/null
{ echo "total ${SECONDS}s"; echo; cat "$RES/1b/ab.md" "$RES/8b/ab.md" "$RES/dec/decode.md" 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; head -4 "$OUT/tl_shares.txt"; grep -E "^(lm|gate|down|mlp)" "$OUT/tl_shares.txt"
grep -E "barrier" "$OUT/tl_shares.txt"; tail -n 2 "$OUT/tests.log"
