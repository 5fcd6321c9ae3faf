#!/usr/bin/env bash
# The next single-GPU call (issue 3), ONE H200: layout option dn_passes (the fused down's rows in N parts, each
# part's int64 atomics issued when it is done, so they drain while the rest streams; session 6 found the MLP
# barrier's 2.9 µs release to be those atomics: 0.76 µs without them, RESULTS.md "fx_group").
# Prediction: release 2.9 -> ~1.5 µs, +1..2% on 1B, less on 8B.
# 1. A/B on 1B (N = 2, 3) and 8B (N = 2); 2. gpu tests on N = 2; 3. timeline on N = 2;
# 4. the official decode run with the best N if it gained > 0.5% on 1B (else the default)
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_next_single.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
RES=/tmp/mk_next1; mkdir -p "$RES"
stage ab_1b 110 python3 bench/decode.py --presets llama-3.2-1b --ab dn_passes=2 dn_passes=3 --runs 3 --new-tokens 256 --out "$RES/1b"
stage ab_8b 80 python3 bench/decode.py --presets llama-3.1-8b --ab dn_passes=2 --runs 3 --new-tokens 256 --out "$RES/8b"
MK_TEST_LAYOUT=dn_passes=2 stage tests 100 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider \
  tests/test_monokernel_gpu.py -k "tiny or llama"
stage tl 40 python3 bench/timeline_probe.py --options '{"dn_passes": 2}' --out "$RES/tl"
LAYOUT=$(python3 - "$RES/1b/ab.json" <<'PY'
import json, statistics, sys
try:
    rows = json.load(open(sys.argv[1]))
    med = {k: statistics.median([x for r in rows if r["layout"] == k for x in r["runs"]])
           for k in {r["layout"] for r in rows}}
    best = max(med, key=med.get)
    print(best if best != "default" and med[best] > 1.005 * med["default"] else "")
except Exception:
    print("")
PY
)
echo "official layout: '${LAYOUT}'" >> "$OUT/summary.txt"
stage official 240 python3 bench/decode.py --presets llama-3.2-1b llama-3.1-8b --runs 5 --ttft 32 512 2000 \
  ${LAYOUT:+--layout $LAYOUT} --out "$RES/dec"
cp "$RES/tl/timeline.json" "$OUT/tl_dn.json" 2>/dev/null; cp "$RES/dec/decode.json" "$OUT/" 2>/dev/null
{ echo "total ${SECONDS}s"; echo; cat "$RES/1b/ab.md" "$RES/8b/ab.md" "$RES/dec/decode.md" 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; grep -E "^(gate|down|mlp|lm)|^barrier" "$RES/tl/timeline.txt"; tail -n 2 "$OUT/tests.log"
