#!/usr/bin/env bash
# `just book-verify`: the book still tells the truth.
#  1. Every output listing and figure under book/src/generated is produced
#     again, by the same commands (book/generate-outputs.sh into a scratch
#     folder), and compared with the committed one. Masked: throughput
#     (tok/s), timings (ms), peak RSS (the kernel's count, not ours), and the
#     prefetch listing's measured lines, which are nothing but timings.
#     Listings with nothing but timings in them (the bench's, the overlap
#     traces', what recompute and bf16 cost in time) are left to the
#     recipes that write them.
#  2. Every `$ just …` / `$ cargo …` command in the book's console blocks is
#     run, once (unless part 1 just ran it as written). It must succeed —
#     except an exercise's check (`just exercise NN-K`) or a run with the
#     learner's code (`--mine K`) while the exercise is still a stub (the
#     starting point a learner meets): then it must fail, saying so. Once a
#     learner has written it, it must pass. (That the answers pass:
#     tests/e2e/exercises.rs and scripts/check-exercises.sh.)
#  0. Every {{#include}} and its anchor, every image, every internal link
#     resolves (tests/e2e/book.rs, also part of `just test`).
#  3. Every figure the prose quotes from a listing is still in it: a passage
#     marked `<!-- figures: generated/X; derived: … -->` may quote only
#     numbers its listings hold, so a regenerated listing cannot leave the
#     prose behind (book/check-figures.py, which checks itself first).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 RAYON_NUM_THREADS=1 FSDP_PROGRESS=plain
command -v python3 >/dev/null || { echo "error: book-verify compares listings with python3: install it (\`just setup-browser\` does)" >&2; exit 2; }
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
fail=0


parts=${BOOK_VERIFY_PARTS:-links listings commands prose}   # run one part alone while fixing it
listings=0
quoted=0
commands=0
runs=0
generated=0
if [[ " $parts " == *" links "* ]]; then
    echo "== 0. includes, anchors, images, internal links"
    if cargo test --release -q --test e2e book:: > "$scratch/links.log" 2>&1; then
        echo "✓ $(grep -o '[0-9]* passed' "$scratch/links.log" | head -1) (tests/e2e/book.rs)"
    else
        echo "✗ tests/e2e/book.rs:"; grep -E "panicked|assert" -A2 "$scratch/links.log" | head -20; fail=1
    fi
fi
if [[ " $parts " == *" listings "* ]]; then
echo "== 1. listings and figures, regenerated and compared"
# Equal after masking throughput, timings and RSS — except the measured
# heap, which moves by a few tens of KB between runs (allocations on MPI's
# side and in the ranks' timing; the listings show it to 0.1 MB): its
# lines, and the figures drawn from it, must agree within 3%. Every other
# number — losses, digests, tallies, bytes — must be equal: the arithmetic
# is the same on every x86-64 machine with AVX2 and FMA.
same() {
    python3 - "$1" "$2" <<'PY'
import difflib, re, sys
def mask(line):
    line = re.sub(r"[0-9][0-9,]* tok/s", "[tok/s]", line)
    line = re.sub(r"[0-9][0-9,]* tokens/s", "[tokens/s]", line)
    line = re.sub(r"[0-9]+\.[0-9]+ ms", "[ms]", line)
    line = re.sub(r"[0-9]+\.[0-9]+ s\)", "[s])", line)
    line = re.sub(r"[0-9]+% hidden", "[%] hidden", line)  # a ratio of two times
    line = re.sub(r"ended [0-9]+\.[0-9]+ s", "ended [s]", line)  # the cluster's faults: how long the job took to end
    if line.startswith("timing"):  # a measured time or a ratio of two: differs every run
        line = re.sub(r"[0-9]+\.[0-9]+", "#", line)
    if "peak RSS" in line:
        line = re.sub(r"[0-9]+\.[0-9]+ MB", "[MB]", line)
    if line.startswith("|"):  # a table padded to its widest cell: a time one digit longer moves every line
        line = re.sub(r" +", " ", re.sub(r"-+", "-", line))
    return line
svg = sys.argv[1].endswith(".svg")
zero = "zero-memory" in sys.argv[1]  # a table of measured peaks, every line
# Lines that carry a measured heap: the measured tables, the timeline's
# table ("│ lesson 02 (whole model) │ 103.95 MB"), the out-of-memory line.
def measured(x):
    return "heap" in x or "out of memory" in x or x.startswith("│ lesson 0")
def close(x, y):
    if not measured(x) and not svg and not zero:
        return False
    nx, ny = (re.findall(r"[0-9]+\.[0-9]+", s) for s in (x, y))
    return re.sub(r"[0-9]+\.[0-9]+", "#", x) == re.sub(r"[0-9]+\.[0-9]+", "#", y) and len(nx) == len(ny) and all(
        abs(float(p) - float(q)) <= 0.03 * max(float(p), float(q)) for p, q in zip(nx, ny))
a, b = ([mask(l) for l in open(p, errors="replace").read().splitlines()] for p in sys.argv[1:3])
if len(a) == len(b) and all(x == y or close(x, y) for x, y in zip(a, b)):
    sys.exit(0)
sys.stdout.writelines(difflib.unified_diff([l + "\n" for l in a], [l + "\n" for l in b], "committed", "fresh", n=2))
sys.exit(1)
PY
}
if GEN_DIR="$scratch/generated" GEN_TIMINGS=0 bash book/generate-outputs.sh > "$scratch/generate.log" 2>&1; then
    generated=1   # part 2 need not run again what it ran
else
    echo "✗ book/generate-outputs.sh failed:"; tail -20 "$scratch/generate.log"; fail=1
fi
for committed in book/src/generated/*; do
    name=$(basename "$committed")
    # `just bench` writes these (ten minutes of runs); every number in them is
    # a timing or a measurement, so there is nothing to compare but their presence.
    if [[ "$name" == bench-alpha-beta* ]]; then echo "· $name: from \`just alpha-beta\` (run below), timings only (not compared)"; continue; fi
    if [[ "$name" == bench* ]]; then echo "· $name: from \`just bench\`, timings only (not compared)"; continue; fi
    # `just compare-pytorch` writes this one: it needs PyTorch (5 GiB), which CI does not install.
    if [[ "$name" == compare-pytorch* ]]; then echo "· $name: from \`just compare-pytorch\`, timings only (not compared)"; continue; fi
    # `BOOK=1 just overlap` writes these (run below): timings, and traces' figures of them.
    if [[ "$name" == overlap.txt || "$name" == 03-overlap-timeline.svg || "$name" == 01-buckets-timeline.svg ]]; then echo "· $name: from \`just overlap\`, timings only (not compared)"; continue; fi
    # Nothing but timings (every number masked): regenerated by `just book-outputs`, not here.
    if [[ "$name" == 02-recompute-time.txt || "$name" == 04-precision-cost.txt ]]; then echo "· $name: from \`just book-outputs\`, timings only (not compared)"; continue; fi
    # `BOOK=1 just hsdp` writes this one: step times on a shaped link, and the link's own byte counts.
    if [[ "$name" == 04-hsdp-cluster.txt ]]; then echo "· $name: from \`just hsdp\`, timings and counters (not compared)"; continue; fi
    # `BOOK=1 just accumulate` writes these: step times across a shaped link (its bytes and digests are the table above's),
    # and a traced step of each mode there.
    if [[ "$name" == 03-accumulate-cluster.txt || "$name" == 03-accumulate-timeline.svg ]]; then echo "· $name: from \`just accumulate\`, timings on the cluster (not compared)"; continue; fi
    fresh="$scratch/generated/$name"
    listings=$((listings + 1))
    if [ ! -s "$fresh" ]; then
        echo "✗ $name: not produced by book/generate-outputs.sh"; fail=1; continue
    fi
    if same "$committed" "$fresh" > "$scratch/diff"; then
        echo "✓ $name"
    else
        echo "✗ $name differs from a fresh run (committed: -, fresh: +):"; head -40 "$scratch/diff"; fail=1
    fi
done

fi

if [[ " $parts " == *" commands "* ]]; then
echo "== 2. every command in the book"
# A command runs once, however often the book shows it; and one that
# generate-outputs.sh ran above exactly as written, its output compared with
# the committed listing, is not run again (`just zero-memory` and `just fits`
# take four minutes).
declare -A ran=() mark=()   # why a command is not run again, and ✓ or ✗
if [ $generated = 1 ]; then
    for c in "just zero-memory:04-zero-memory.txt" "just fits:04-fits.txt" "just reshard 03 2 4:appendix-reshard.txt" \
             "just reduce-dtype:04-reduce-dtype.txt"; do
        ran["${c%%:*}"]="ran above for ${c#*:}" mark["${c%%:*}"]=✓
    done
fi
while IFS= read -r line; do
    cmd=${line#\$ }
    cmd=${cmd%%#*}                     # drop the trailing comment
    cmd=$(echo "$cmd" | sed -E 's/[[:space:]]+$//')
    commands=$((commands + 1))
    if [ -n "${ran[$cmd]:-}" ]; then
        echo "${mark[$cmd]} $cmd (${ran[$cmd]})"; [ "${mark[$cmd]}" = ✓ ] || fail=1; continue
    fi
    runs=$((runs + 1)) bad=0
    log="$scratch/cmd-$commands.log"
    # An exercise's command fails on its stub (what a learner meets first);
    # once the learner has written it, it must pass like any other.
    ex=$(echo "$cmd" | sed -nE 's/^just exercise ([0-9]+)-([0-9]+).*/\1 \2/p; s/^just step ([0-9]+) .*--mine ([0-9]+).*/\1 \2/p')
    written=0
    if [ -n "$ex" ]; then
        read -r nn k <<< "$ex"
        grep -qF "todo!(\"exercise $((10#$nn)).$k" crates/"$nn"-*/src/exercises.rs || written=1
    elif [[ "$cmd" == just\ exercise\ * || "$cmd" == *--mine\ * ]]; then
        echo "✗ $cmd: an exercise command this script cannot read (write it as \`just exercise NN-K\` or \`just step NN … --mine K\`)"; fail=1 bad=1; continue
    fi
    if [ $written -eq 1 ]; then
        if bash -c "$cmd" < /dev/null > "$log" 2>&1; then echo "✓ $cmd (your exercise)"; else echo "✗ $cmd failed:"; tail -20 "$log"; fail=1 bad=1; fi
    elif [[ "$cmd" == just\ exercise\ * ]]; then
        if bash -c "$cmd" < /dev/null > "$log" 2>&1; then
            echo "✗ $cmd: passes before the exercise is solved"; fail=1 bad=1
        elif grep -q "is not done yet" "$log"; then
            echo "✓ $cmd (says the exercise is not done yet)"
        else
            echo "✗ $cmd: fails without saying why"; tail -5 "$log"; fail=1 bad=1
        fi
    elif [[ "$cmd" == *--mine\ * ]]; then
        if bash -c "$cmd" < /dev/null > "$log" 2>&1; then
            echo "✗ $cmd: runs before the exercise is written"; fail=1 bad=1
        elif grep -q "is not written yet" "$log"; then
            echo "✓ $cmd (says the exercise is not written yet)"
        else
            echo "✗ $cmd: fails without saying why"; tail -5 "$log"; fail=1 bad=1
        fi
    elif bash -c "$cmd" < /dev/null > "$log" 2>&1; then
        echo "✓ $cmd"
    else
        echo "✗ $cmd failed:"; tail -20 "$log"; fail=1 bad=1
    fi
    if [ $bad -eq 0 ]; then ran["$cmd"]="shown again: ran above" mark["$cmd"]=✓; else ran["$cmd"]="shown again: failed above" mark["$cmd"]=✗; fi
done < <(awk '/^```console/{c=1; next} /^```/{c=0} c && /^\$ (just|cargo) /' book/src/*.md)
fi

if [[ " $parts " == *" prose "* ]]; then
echo "== 3. figures the prose quotes, against the listings they come from"
# The committed listings, the ones the book shows (part 1 holds them to a
# fresh run). The checker first runs on a made-up book of its own: a figure
# its listing holds must pass, one it lost must fail.
if python3 book/check-figures.py --self-test > "$scratch/figures-self-test.log" 2>&1; then
    echo "✓ book/check-figures.py --self-test ($(grep -c '^✓' "$scratch/figures-self-test.log") cases)"
else
    echo "✗ book/check-figures.py --self-test:"; grep -v '^✓' "$scratch/figures-self-test.log"; fail=1
fi
if python3 book/check-figures.py > "$scratch/figures.log" 2>&1; then
    echo "✓ $(tail -1 "$scratch/figures.log") (book/check-figures.py)"
else
    echo "✗ figures the prose quotes that its listings do not hold (book/check-figures.py):"; cat "$scratch/figures.log"; fail=1
fi
quoted=$(sed -n 's/^\([0-9]*\) quoted figures checked.*/\1/p' "$scratch/figures.log")
quoted=${quoted:-0}
fi

echo
echo "book-verify: $listings listings and figures compared, $commands commands checked ($runs run here, the rest above), $quoted figures in the prose checked against their listings"
# A check that found nothing to check has checked nothing.
[[ " $parts " != *" listings "* ]] || [ "$listings" -gt 0 ] || { echo "✗ no listings found under book/src/generated"; fail=1; }
[[ " $parts " != *" commands "* ]] || [ "$commands" -gt 0 ] || { echo "✗ no commands found in the book's console blocks"; fail=1; }
[[ " $parts " != *" prose "* ]] || [ "$quoted" -gt 0 ] || { echo "✗ no figure in the prose was checked against a listing"; fail=1; }
[ $fail -eq 0 ] || { echo "book-verify: FAILED"; exit 1; }
echo "book-verify: the book matches what the code does"
