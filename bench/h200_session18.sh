#!/usr/bin/env bash
# Issue 9, session 18, first call (~9 min): the measurements session 17 could not make on its final code (fe04253).
# - r8: batch.py's resident table with join_cost and the peer in the same run. Prediction: join_cost beyond the
#   prefill ~+0.6 ms median (session 17's timeline: +0.62, 14/14 < 1 ms), B = 1 ~0.99 of the single engine.
# - ts / tg: sessions and prefill-graph gpu tests (the queued-join path touches PrefillGraphs). Prediction: all pass.
# - pb: per-op times of a 32-token join prefill beside 7 running requests and idle. Prediction: ~9 ms beside vs
#   ~1.65 idle, spread over many small ops (no single op > 25% of the beside time), linears the largest share.
# - t8: the 8B table on every default. Prediction: B = 4 ~0.88 of B = 1 (session 16: 0.878 on pair_dn alone).
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_session18.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
stage r8 110 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --resident --peer --out /tmp/r8
stage ts 90 python3 -m pytest -q -m gpu $PT -p no:cacheprovider tests/test_monokernel_sessions_gpu.py
stage tg 60 python3 -m pytest -q -m gpu $PT -p no:cacheprovider tests/test_prefill_graph_gpu.py
stage pb 70 python3 bench/prefill_beside_probe.py --out /tmp/pb
stage t8 200 python3 bench/batch.py --presets llama-3.1-8b --builds 8 --runs 2 --peer --out /tmp/t8
{ echo "total ${SECONDS}s"; for s in ts tg; do grep -E "passed|failed" "$OUT/$s.log" | tail -n 1; done;
  tail -n 30 "$OUT/pb.log"; cat /tmp/r8/batch.md /tmp/t8/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cp -r /tmp/pb "$OUT/pb" 2>/dev/null; cp /tmp/r8/batch.json "$OUT/r8.json" 2>/dev/null; cp /tmp/t8/batch.json "$OUT/t8.json" 2>/dev/null
cat "$OUT/summary.txt"
