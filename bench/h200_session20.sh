#!/usr/bin/env bash
# Issue 9, session 20, first call (~8 min).
# - r8_f0 / r8_f1: batch.py's resident 1B table with join_cost and the peer, MK_PREFILL_FUSED off then on, both on
#   capture_all (every join a queued replay). Predictions: join cost beyond the prefill ~+0.4 ms median unfused
#   (session 18: +0.38), fused about the same beyond but a ~8% shorter prefill beside the launch (session 18 probe);
#   the decode table as session 17 (B = 4 ~0.77, B = 8 ~5,900 tok/s aggregate): the kernel did not change.
# - r8b: the 8B resident table (not run before), capture_all's graph pool and the device memory on 8B. Predictions:
#   graphs ~1 GB per slot (1B 0.34-0.40 GB; 8B's hidden 2x, intermediate 1.75x), per request at 4 ~0.86 of B = 1.
# - tl1 / tl4: per-block timelines of 1B at B = 1 and at B = 4 on the current defaults (which segments grow with B).
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_session20.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
for f in 0 1; do
  MK_PREFILL_FUSED=$f stage r8_f$f 100 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --resident --peer --runs 2 --out /tmp/r8_f$f
done
stage tl4 45 python3 bench/timeline_probe.py --batch 4 --requests 4 --out /tmp/tl4
stage tl1 35 python3 bench/timeline_probe.py --out /tmp/tl1
stage r8b 240 python3 bench/batch.py --presets llama-3.1-8b --builds 8 --resident --runs 1 --out /tmp/r8b
{ echo "total ${SECONDS}s"
  for s in r8_f0 r8_f1 r8b; do echo "== $s"; grep -E "prefill graphs:" "$OUT/$s.log" | cut -c1-200 | sort | uniq -c | head -n 4
    cat /tmp/$s/batch.md 2>/dev/null; cp /tmp/$s/batch.json "$OUT/$s.json" 2>/dev/null
    python3 -c "import json,sys; d=json.load(open('/tmp/$s/batch.json')); [print('device_used_gb', b.get('device_used_gb'), 'join', json.dumps(b.get('join'))) for p in d['presets'] for b in p['builds']]" 2>/dev/null; done
  for s in tl4 tl1; do echo "== $s"; tail -n 45 "$OUT/$s.log"; cp -r /tmp/$s "$OUT/$s" 2>/dev/null; done
} >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
