#!/usr/bin/env bash
# `just diff NN`: what lesson NN adds over the lesson before it.
#  1. its step — the `// ANCHOR: step` region of its idea file — against the
#     previous lesson's: the algorithm's change, and nothing around it;
#  2. the files beside its idea file — each speed or scale feature, the
#     accounting — with their opening line and length, marked where the
#     previous lesson has a file of the same name.
set -euo pipefail
cd "$(dirname "$0")/.."
nn=${1:?usage: lesson-diff.sh NN}
cur=$(ls -d crates/"$nn"-* 2>/dev/null | head -n1) || true
last=$(ls -d crates/[0-9]* | tail -n1 | sed 's|crates/||' | cut -d- -f1)
if [ -z "$cur" ] || [ "$nn" = "01" ]; then echo "error: pick a lesson from 02 to $last" >&2; exit 2; fi
prev=$(ls -d crates/"$(printf '%02d' $((10#$nn - 1)))"-*)
# The idea file: named after the crate (02-whole-model-shard → whole_model_shard.rs).
idea() { local d=${1#crates/}; echo "$1/src/$(echo "${d#*-}" | tr - _).rs"; }
step() { awk '/\/\/ ANCHOR: step$/{on=1; next} /\/\/ ANCHOR_END: step$/{on=0} on' "$1"; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
a="$tmp/${prev#crates/}"; b="$tmp/${cur#crates/}"
step "$(idea "$prev")" > "$a"; step "$(idea "$cur")" > "$b"
echo "== the step: $(idea "$prev") → $(idea "$cur")"
diff -U2 --label "lesson ${prev#crates/}" --label "lesson ${cur#crates/}" "$a" "$b" || true
echo
echo "== what lesson $nn has beside its idea file (main.rs, lib.rs and exercises.rs aside)"
# A file's first sentence, from its `//!` overview (rustdoc's link brackets dropped), cut at 100 characters.
summary() {
    awk '/^\/\/!/ { sub(/^\/\/! ?/, ""); if ($0 == "") exit; t = t (t == "" ? "" : " ") $0; next } t != "" { exit }
         END { gsub(/[][]/, "", t); gsub(/^# /, "", t); i = index(t, ". "); if (i) t = substr(t, 1, i);
               if (length(t) > 100) t = substr(t, 1, 99) "…"; print t }' "$1"
}
besides=0
for f in $(cd "$cur" && find src -name '*.rs' | sort); do
    case "$f" in src/main.rs|src/lib.rs|src/exercises.rs) continue ;; esac
    [ "$cur/$f" = "$(idea "$cur")" ] && continue
    also=""; [ -e "$prev/$f" ] && also=" (lesson ${prev#crates/} has one too)"
    printf '  %-58s %4d lines  %s%s\n' "$cur/$f" "$(wc -l < "$cur/$f")" "$(summary "$cur/$f")" "$also"
    besides=$((besides + 1))
done
[ "$besides" -gt 0 ] || echo "  none: its idea file, main.rs, lib.rs and exercises.rs are all it has"
