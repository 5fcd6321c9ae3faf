#!/usr/bin/env bash
# Issue 9, session 20, second call (~9.5 min): MK_PREFILL_FUSED on by default (call 1: a join's prefill beside the
# launch 8.98 -> 8.29 ms, beyond it +0.82 -> +0.43 ms median). Every gpu test that prefills, on the new default, then
# the resident table once more for a second fused join-cost sample.
# Predictions: all pass (session 18 call 2 on the fused path: gemm 18, graph 30, sessions 12, single 18; the resident
# 9/10 then, 10/10 in session 19 with capture_all); joins +0.4..0.9 ms median beyond the prefill, prefill ~8.3 ms.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_session20b.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
T="python3 -m pytest -q -m gpu $PT -p no:cacheprovider"
stage tr 130 $T tests/test_monokernel_resident_gpu.py
stage ts 80 $T tests/test_monokernel_sessions_gpu.py
stage tg 50 $T tests/test_prefill_graph_gpu.py
stage tm 40 $T tests/test_prefill_gemm_gpu.py
stage t1 90 $T tests/test_monokernel_gpu.py
stage r8 90 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --resident --peer --runs 2 --out /tmp/r8
stage tb 100 $T tests/test_monokernel_batch_gpu.py
{ echo "total ${SECONDS}s"
  for s in tr ts tg tm t1 tb; do echo "== $s: $(grep -E ' passed| failed|error' "$OUT/$s.log" | tail -n 1)"; grep -E "^FAILED|^ERROR" "$OUT/$s.log" | cut -c1-200 | head -n 5; done
  echo "== r8"; cat /tmp/r8/batch.md 2>/dev/null; cp /tmp/r8/batch.json "$OUT/r8.json" 2>/dev/null
  python3 -c "import json; d=json.load(open('/tmp/r8/batch.json')); [print('device_used_gb', b.get('device_used_gb'), 'join', json.dumps(b.get('join'))) for p in d['presets'] for b in p['builds']]" 2>/dev/null
} >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
