#!/usr/bin/env bash
# Issue 9, session 17, second call (~6 min): the join handover after call 1's timeline (B = 8, 7 running: pick 0.16
# ms, prefill beside the launch 9.85, prepare_join 0.23, publish -> ack 0.66 (U[0, step]), ack -> first token 0.36;
# beyond the prefill, less the idle engine's 0.50: median +1.13 ms). Changes: (1) the polling threads' timer
# slack 50 us -> 1 us (time.sleep(20e-6) measured ~75 us here), (2) a join's row and stop ids staged before its
# prefill (only the hidden state's copy waits for it), (3) the drain sends first tokens first, (4) the mma join
# GEMM splits K of narrow linears into batch entries (down / o at 32 rows: 32 -> 128 blocks), since beside the
# resident kernel the 16 SMs' HBM share follows the bytes they keep in flight.
# Predictions: pick ~0.08, hand_over ~0.08, ack -> token ~0.25; join beyond prefill less idle ~0.8 ms median;
# the join's prefill beside the launch 9.85 -> ~6 ms (down was ~60% of it).
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash bench/h200_session17b.sh")
set -u
DEADLINE=${DEADLINE:-585}
. bench/device_stage.sh
stage pg 60 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider tests/test_prefill_gemm_gpu.py
stage tr 120 python3 -m pytest -q -m gpu -x $PT -p no:cacheprovider tests/test_monokernel_resident_gpu.py
stage jt 70 python3 bench/join_timeline.py --joins 14 --out /tmp/jt
stage r8 90 python3 bench/batch.py --presets llama-3.2-1b --builds 8 --resident --peer --out /tmp/r8
{ echo "total ${SECONDS}s"; tail -n 2 "$OUT/pg.log" "$OUT/tr.log"; tail -n 1 "$OUT/jt.log"; cat /tmp/r8/batch.md 2>/dev/null; } >> "$OUT/summary.txt"
cp -r /tmp/jt "$OUT/jt" 2>/dev/null; cp /tmp/r8/batch.json "$OUT/r8.json" 2>/dev/null
cat "$OUT/summary.txt"
