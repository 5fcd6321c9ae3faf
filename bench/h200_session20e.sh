#!/usr/bin/env bash
# Issue 9, session 20, fifth call (~4.5 min): a batched engine's slots share one pool of prefill-graph temporaries
# (prefill_graph.GraphArena; replays ordered across streams by an event chain) instead of one pool per slot.
# Predictions: the new arena test passes (slot 1's capture_all grows the pool by its graphs' outputs only) and the
# replayed prefills from two streams equal the eager ones; resident 10/10 and sessions 12/12 as before; the 1B
# resident engine's graphs ~0.4 GB + ~50 MB per further slot instead of 335-403 MB per slot.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=290, command="DEADLINE=275 bash bench/h200_session20e.sh")
set -u
DEADLINE=${DEADLINE:-275}
. bench/device_stage.sh
T="python3 -m pytest -q -m gpu $PT -p no:cacheprovider"
stage tg 60 $T -s tests/test_prefill_graph_gpu.py
stage tr 130 $T -o log_cli=true --log-cli-level=INFO tests/test_monokernel_resident_gpu.py
stage ts 60 $T tests/test_monokernel_sessions_gpu.py
{ echo "total ${SECONDS}s"
  for s in tg tr ts; do echo "== $s: $(grep -E ' passed| failed|error' "$OUT/$s.log" | tail -n 1)"; grep -E "^FAILED|^ERROR|^E  " "$OUT/$s.log" | cut -c1-220 | head -n 8; done
  grep -h "arena:" "$OUT/tg.log" | head -n 3
  grep -h "captured in" "$OUT/tr.log" | cut -c1-200 | sort | uniq -c | head -n 12
} >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
