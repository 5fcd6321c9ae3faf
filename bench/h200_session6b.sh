#!/usr/bin/env bash
# Session 6, second call on ONE H200 (issue 3): the two options the timeline probe led to.
#   o_align      fused_attn_o's O units dealt per kv group to whole blocks (the 4 blocks straddling a group
#                boundary were last at the O barrier in 98% of layers, ~2 µs late)
#   zero_spread  the accumulators' zeroing spread over every block (blocks 1..4 were last at the QKV barrier)
# 1. timeline probe v2 (per-block table, %smid) on the default and on o_align+zero_spread
# 2. decode.py A/B on 1B (each, both) and 8B (both); 3. gpu tests vs transformers on both
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_session6b.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
RES=/tmp/mk_s6b; mkdir -p "$RES"
BOTH=o_align+zero_spread
stage tl_default 60 python3 bench/timeline_probe.py --out "$RES/tl0"
stage tl_both 60 python3 bench/timeline_probe.py --options '{"o_align": true, "zero_spread": true}' --out "$RES/tl1"
stage ab_1b 170 python3 bench/decode.py --presets llama-3.2-1b --ab o_align zero_spread $BOTH --runs 3 --new-tokens 256 --out "$RES/1b"
stage ab_8b 120 python3 bench/decode.py --presets llama-3.1-8b --ab $BOTH --runs 3 --new-tokens 256 --out "$RES/8b"
MK_TEST_LAYOUT=o_align=1,zero_spread=1 stage tests 120 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider \
  tests/test_monokernel_gpu.py -k "tiny or llama"
cp "$RES/tl0/timeline.json" "$OUT/tl_default.json" 2>/dev/null; cp "$RES/tl1/timeline.json" "$OUT/tl_both.json" 2>/dev/null
cp "$RES/tl0/timeline.txt" "$OUT/tl_default.txt" 2>/dev/null; cp "$RES/tl1/timeline.txt" "$OUT/tl_both.txt" 2>/dev/null
{ echo "total ${SECONDS}s"; echo; cat "$RES/1b/decode.md" "$RES/8b/decode.md" 2>/dev/null; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; head -30 "$OUT/tl_both.txt"; tail -3 "$OUT/tests.log"
