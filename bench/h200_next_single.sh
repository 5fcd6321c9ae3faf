#!/usr/bin/env bash
# The next single-GPU call (issue 3), ONE H200, three candidates from session 6's timeline probe:
#   dn_passes=N  the fused down's rows in N parts, each part's int64 atomics issued when it is done, so they drain
#                while the rest streams (the MLP barrier's 2.9 µs release is those atomics: 0.76 µs without them,
#                RESULTS.md "fx_group"). Prediction: release 2.9 -> ~1.5 µs, +1..2% on 1B, less on 8B.
#   norm_early   the prologues' RMSNorm weights loaded with the residual, not after the block reduction (QKV / MLP
#                prologues 2.0 / 1.85 µs with per-layer weights, the LM head's 0.93 µs). Prediction: -0.8 µs per
#                prologue, +2..3% on 1B, +1% on 8B, batch builds too; bit-identical tokens.
#   ao_preload   the O stage loads the attention splits' outputs before their statistics' round trip (2.5 µs per
#                layer). Prediction: -0.5..-0.8 µs per layer, +1..1.5% on 1B; spills 16 -> 40 bytes (1B).
# 1. A/B on 1B and 8B; 2. gpu tests on both; 3. batch A/B (B = 4) and batch gpu tests on norm_early;
# 4. timelines: the batched engine at 4 of 4 slots (issue 9's per-slot costs), the candidates together; 5. the official decode run with the best 1B variant if it gained > 0.5% (else the default)
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_next_single.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
RES=/tmp/mk_next1; mkdir -p "$RES"
stage ab_1b 150 python3 bench/decode.py --presets llama-3.2-1b --ab dn_passes=2 norm_early ao_preload norm_early+ao_preload norm_early+ao_preload+dn_passes=2 --runs 3 --new-tokens 256 --out "$RES/1b"
stage ab_8b 80 python3 bench/decode.py --presets llama-3.1-8b --ab norm_early+ao_preload norm_early+ao_preload+dn_passes=2 --runs 3 --new-tokens 256 --out "$RES/8b"
MK_TEST_LAYOUT=norm_early=1,ao_preload=1,dn_passes=2 stage tests 100 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider \
  tests/test_monokernel_gpu.py -k "tiny or llama"
stage batch_ab 60 python3 bench/batch.py --presets llama-3.2-1b --builds 4 --variants norm_early --out "$RES/b4"
MK_BATCH_TEST_LAYOUT=norm_early=1 stage batch_tests 90 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider \
  tests/test_monokernel_batch_gpu.py -k "llama"
stage tl_b4 40 python3 bench/timeline_probe.py --batch 4 --requests 4 --out "$RES/tlb4"  # issue 9: per-slot costs
stage tl 40 python3 bench/timeline_probe.py --options '{"dn_passes": 2, "norm_early": true, "ao_preload": true}' --out "$RES/tl"
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
cp "$RES/tl/timeline.json" "$OUT/tl_dn.json" 2>/dev/null; cp "$RES/tlb4/timeline.json" "$OUT/tl_b4.json" 2>/dev/null; cp "$RES/dec/decode.json" "$OUT/" 2>/dev/null
{ echo "total ${SECONDS}s"; echo; cat "$RES/1b/ab.md" "$RES/8b/ab.md" "$RES/b4/batch.md" "$RES/dec/decode.md" 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; grep -E "^(gate|down|mlp|lm)|^barrier" "$RES/tl/timeline.txt"; tail -n 2 "$OUT/tests.log" "$OUT/batch_tests.log"
