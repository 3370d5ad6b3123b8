#!/usr/bin/env bash
# One accelerator loan, start to finish: what the session's device tool runs, as one prepared script.
#
#   bash tools/device_session.sh [SECONDS]      # OUT: the folder whose files come back (the device tool sets it)
#
# 1. the device's facts (device.txt);
# 2. the device benchmark first (benchmarks/device.py: attention per encoding against cuDNN and XLA), sized to
#    4/9 of the time and at most 4 minutes; its table.md and results.json go to docs/device/<backend>-<date>/
#    (packed with the rest, step 4) and its log and a copy of its table to OUT;
# 3. the accelerator queue (posenc-bench queue) with the rest: pending (cell, seed) units in priority order,
#    each writing its rows, report and plots under docs/;
# 4. everything written under docs/ (rows, run.json, reports, plots; never checkpoints) packed into
#    results.tar.gz, with the queue's log beside it.
#
# Back on the machine that commits: tar -xzf results.tar.gz in the checkout, then commit those folders
# (a folder whose cells are not all done is a partial run, and its report says which seeds it holds).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:?"set OUT to the folder whose files come back"}
budget=${1:-540}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
stamp="$out/.started"
touch "$stamp"
bench() { python -c 'import sys; from posenc_jax.bench.cli import main; sys.exit(main(sys.argv[1:]))' "$@"; }

{
  date -u
  nvidia-smi -L 2>/dev/null || true
  python -c 'import jax; print("jax", jax.__version__, jax.default_backend(), jax.devices())'
} > "$out/device.txt" 2>&1

device_budget=$((budget * 4 / 9 < 240 ? budget * 4 / 9 : 240))
backend=$(awk '/^jax /{print $3; exit}' "$out/device.txt")
device_out="docs/device/${backend:-unknown}-$(date -u +%F)"
# Its own budget counts its setup; the timeout leaves a minute for a program that runs past its prediction.
timeout $((device_budget + 60)) python benchmarks/device.py --budget-seconds "$device_budget" --out "$device_out" \
  > "$out/device-benchmark.log" 2>&1
echo "device benchmark exit $? after ${SECONDS} s" >> "$out/device-benchmark.log"
cp "$device_out/table.md" "$out/device-benchmark.md" 2>/dev/null || true

left=$((budget - SECONDS - 20))
if [ "$left" -ge 30 ]; then
  bench queue --budget "$left" --no-progress > "$out/queue.log" 2>&1
  status=$?
else
  echo "no time left for the queue ($left s)" > "$out/queue.log"
  status=0
fi

find docs -newer "$stamp" -type f -not -path '*/checkpoints/*' -not -name '.lock' -print0 |
  tar --null -czf "$out/results.tar.gz" --files-from=-
rm -f "$stamp"
echo "queue exit $status; $(tar -tzf "$out/results.tar.gz" | wc -l) files in results.tar.gz" >> "$out/queue.log"
exit "$status"
