#!/usr/bin/env bash
# Issue 53's CPU reruns under the fixed-budget protocol, resumable: Kazemnejad et al.'s decoder tasks (preset
# kazemnejad), then Ruoss et al.'s encoder tasks (preset ruoss), into docs/extrapolation-{kazemnejad,ruoss}-fixed
# of this checkout. Each runs from a worktree frozen at the commit its rows were started with (a row records its
# commit; a run's settings never change under it). Re-running the script goes on where it stopped: a finished
# cell is skipped, an unfinished one resumes from its last checkpoint.
#
#   setsid nohup bash tools/fixed_budget_reruns.sh >> reruns.log 2>&1 < /dev/null &
#
# It lowers its own session (autogroup nice 19: with sched_autogroup_enabled=1, `nice` alone orders a process
# only within its session) so tests and timings keep the CPU. Pause it for any timing:
#   pkill -STOP -f "bench.cli extrapolate"   ...   pkill -CONT -f "bench.cli extrapolate"
# Commit finished cells with the report rewritten by this checkout (plots=False) and
# tests/test_documented_results.py run.
set -euo pipefail
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
trees=${POSENC_RUN_TREES:-$root/../posenc-run-trees}
echo 19 > /proc/self/autogroup 2>/dev/null || echo "could not lower this session's priority; running at normal priority"

run() {  # run PRESET COMMIT: the preset's fixed-budget run from a worktree at COMMIT
    local tree="$trees/$2"
    if [ ! -d "$tree" ]; then
        mkdir -p "$trees"
        git -C "$root" worktree add --detach -f "$tree" "$2"
    fi
    echo "== $(date -u +%FT%TZ) $1 from $2"
    (cd "$tree" && PYTHONPATH="$tree" python -m posenc_jax.bench.cli extrapolate --preset "$1" \
        --out "$root/docs/extrapolation-$1-fixed" --no-progress --no-plots)
}

run kazemnejad 4d425a0da8f2cf0518a578d2786a57466f042440  # started with 1ad2726 (same settings), continued here
run ruoss 9a567f2f3bb3a93a52303adea4ab029d52328975      # device batches, 50 steps a call
echo "== $(date -u +%FT%TZ) done"
