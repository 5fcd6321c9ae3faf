# Sourced by the device scripts (bench/h200_*_run.sh, bench/next_device_run.sh): installs the carried
# wheels, starts $OUT/summary.txt, and defines `stage NAME SECONDS CMD...`, which runs CMD under
# `timeout` (cut so the whole script ends by $DEADLINE seconds), logs to $OUT/NAME.log and appends
# its rc and time to summary.txt. Env assignments for CMD go before `stage`. Needs `.whl` carried.
: "${OUT:?set OUT}"
DEADLINE=${DEADLINE:-585}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
git log --oneline -1 > "$OUT/summary.txt" 2>/dev/null
# pytest-timeout may be missing on the device (the stage `timeout` bounds the run either way)
PT=""; python3 -c "import pytest_timeout" 2>/dev/null && PT="--timeout 150"
stage() {
  local name=$1 secs=$2; shift 2
  local left=$((DEADLINE - SECONDS - 5))
  if [ "$left" -lt "$secs" ]; then secs=$left; fi
  if [ "$secs" -lt 15 ]; then echo "$name skipped (out of time)" >> "$OUT/summary.txt"; return; fi
  local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t0))s of ${secs}s (rc 124 = timed out)" >> "$OUT/summary.txt"
}
