#!/usr/bin/env bash
# Regenerates every output listing and figure the book shows, from real runs
# of the release binaries (`just book-outputs` builds them first).
set -euo pipefail
cd "$(dirname "$0")/.."
gen=book/src/generated
mkdir -p "$gen"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 RAYON_NUM_THREADS=1 FSDP_PROGRESS=plain

# run NAME RANKS PACKAGE ARGS… : the listing of `just step NN RANKS ARGS…`
run() {
    local name=$1 ranks=$2 pkg=$3; shift 3
    echo "· $name"
    mpirun -q --oversubscribe -n "$ranks" "target/release/$pkg" --out "out/book/$name" "$@" > "$gen/$name.txt"
}

run 01-two-ranks 2 step01-data-parallel
run 02-two-ranks 2 step02-whole-model-shard
run 02-four-ranks 4 step02-whole-model-shard
cp out/book/02-two-ranks/shard_vs_replicated.svg "$gen/02-shard-vs-replicated.svg"
cp out/book/01-two-ranks/loss.svg "$gen/01-loss.svg"
echo "wrote $(ls "$gen" | wc -l) files under $gen"
