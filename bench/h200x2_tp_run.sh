#!/usr/bin/env bash
# Issue 6 on nvidia-h200-x2, one call (< 10 min), everything under $OUT (summary.txt first):
#   1. TP smoke on tiny (a hang = an exchange-protocol bug; a dead peer now times out: MK_TP_PEER_TIMEOUT_S)
#   2. TP gpu tests (tests/test_tp_gpu.py: TP=2 vs TP=1, reference, transformers; greedy, seeded, cancel)
#   3. bench/decode.py: TP=1 vs TP=2 (+ the skip-all-reduce build) for $PRESETS, with the copy-bandwidth
#      roofline and the transformers static-cache peer in the same run
# Two calls cover issue 6's three models (the 8B's random weights, shards and peer take minutes on their own):
#   run(kind="nvidia-h200-x2", carry=[".whl"], timeout_s=600, command="bash bench/h200x2_tp_run.sh")
#   run(kind="nvidia-h200-x2", carry=[".whl"], timeout_s=600,
#       command="STAGES=bench PRESETS=llama-3.1-8b bash bench/h200x2_tp_run.sh")
# Issue 7 on nvidia-h200-x8 (tiny has 4 heads: the smoke runs llama-3.2-1b at TP=8):
#   command="SMOKE_TP=8 SMOKE_PRESET=llama-3.2-1b TP_SIZES='1 2 4 8' bash bench/h200x2_tp_run.sh", then with
#   STAGES=bench PRESETS=llama-3.1-8b as above
# Run from the repository root with `.whl` carried (scripts/fetch_device_wheels.sh makes it).
set -u
DEADLINE=${DEADLINE:-580}
PRESETS=${PRESETS:-llama-3.2-1b qwen3-1.7b}
STAGES=${STAGES:-smoke tests bench}
SMOKE_TP=${SMOKE_TP:-2}
SMOKE_PRESET=${SMOKE_PRESET:-tiny}
TP_SIZES=${TP_SIZES:-1 2}
export MK_TP_PEER_TIMEOUT_S=${MK_TP_PEER_TIMEOUT_S:-20}
. bench/device_stage.sh
RES=/tmp/mk_results; mkdir -p "$RES"
PYTEST="python3 -m pytest -v -m gpu $PT --durations=10 -p no:cacheprovider"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
case " $STAGES " in *" smoke "*) stage tp_smoke 75 python3 bench/tp_smoke.py --tp "$SMOKE_TP" --preset "$SMOKE_PRESET" ;; esac
case " $STAGES " in *" tests "*) stage tp_gpu_tests 170 $PYTEST tests/test_tp_gpu.py ;; esac
# shellcheck disable=SC2086
case " $STAGES " in *" bench "*) stage tp_bench 560 python3 bench/decode.py --presets $PRESETS --tp $TP_SIZES --runs 3 \
  --new-tokens 256 --ttft 2000 --out "$RES" ;; esac
cp "$RES/decode.json" "$OUT/" 2>/dev/null
{ echo "total ${SECONDS}s"; echo; cat "$RES/decode.md" 2>/dev/null; echo; cat "$OUT/topo.txt"; } >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
tail -5 "$OUT/tp_smoke.log" "$OUT/tp_gpu_tests.log" 2>/dev/null
