#!/usr/bin/env bash
# The reference runs behind `just check-bits` and the listing the book shows
# (book/src/generated/check-bits.txt): lesson 01 on 1 rank at the small
# preset, whose contractions (384, 1536) are long enough that a matmul
# blocked by the machine's cache sizes would round differently, in fp32 and
# bf16. Prints the losses (to all six decimals) and the weights digest.
set -euo pipefail
cd "$(dirname "$0")/.."
export RAYON_NUM_THREADS=1 FSDP_PROGRESS=plain
for precision in fp32 bf16; do
    args=(--preset small --batch-size 2 --seq-len 64 --micro-batches 2 --steps 3 --log-every 1 --precision "$precision")
    echo "· step01-data-parallel ${args[*]}"
    target/release/step01-data-parallel "${args[@]}" --out "out/check-bits/$precision" \
        | grep -E '^step |final weights digest' | sed -E 's/ \| [0-9,]+ tok\/s$//; s/^/    /'
done
