#!/usr/bin/env bash
# CI: a learner's path to ✓. Each lesson's answers are copied over its stubs
# (src/exercises.rs), then `just exercise NN-K` must pass for every exercise —
# the run with `--mine K`, the snapshot, the recipe's ✓ — and the stubs come
# back, whatever happens.
set -euo pipefail
cd "$(dirname "$0")/.."
stubs=(crates/[0-9]*/src/exercises.rs)
git diff --quiet -- "${stubs[@]}" || { echo "error: src/exercises.rs has changes of yours: commit or stash them first" >&2; exit 2; }
log=$(mktemp)
trap 'git checkout -- "${stubs[@]}"; rm -f "$log"' EXIT
for f in "${stubs[@]}"; do cp "${f%/src/exercises.rs}/solutions/exercises.rs" "$f"; done
ids=$(grep -oE 'exercise_[0-9]+_[0-9]+ =>' tests/e2e/exercises.rs | sed -E 's/exercise_([0-9]+)_([0-9]+) =>/0\1-\2/')
for id in $ids; do
    if just exercise "$id" > "$log" 2>&1 && grep -q "^✓ exercise" "$log"; then
        grep "^✓" "$log"
    else
        echo "✗ just exercise $id fails with the answers in place:"; tail -30 "$log"; exit 1
    fi
done
