#!/usr/bin/env bash
# Regenerates every output listing and figure the book shows, from real runs
# of the release binaries (`just book-outputs` builds them first).
set -euo pipefail
cd "$(dirname "$0")/.."
# GEN_DIR: where to write (book-verify regenerates into a scratch folder).
gen=${GEN_DIR:-book/src/generated}
# GEN_TIMINGS=0: skip the two listings that are nothing but timings (book-verify
# masks every number in them, so regenerating them there would check nothing).
timings=${GEN_TIMINGS:-1}
mkdir -p "$gen"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 RAYON_NUM_THREADS=1 FSDP_PROGRESS=plain

# run NAME RANKS PACKAGE ARGS… : the listing of `just step NN RANKS ARGS…`
run() {
    local name=$1 ranks=$2 pkg=$3; shift 3
    echo "· $name"
    mpirun -q --oversubscribe -n "$ranks" "target/release/$pkg" --out "out/book/$name" "$@" > "$gen/$name.txt"
}

run 01-two-ranks 2 step01-data-parallel
# samples NAME TOKENS RUN SHOWN SHOWN_FLAGS: `just sample --untrained`, then `just sample` on the
# weights of out/book/RUN, shown as the learner's out/SHOWN (what `just step NN` writes there);
# the text (stdout) and its closing line (stderr) as a terminal shows them.
samples() {
    local name=$1 tokens=$2 run=$3 shown=$4 flags=$5
    echo "· $name"
    {
        echo "\$ just sample --untrained --tokens $tokens"
        target/release/fsdp-sample --untrained --tokens "$tokens" 2>&1
        echo
        echo "\$ just sample ${flags}--tokens $tokens"
        target/release/fsdp-sample --weights "out/book/$run/weights.safetensors" --tokens "$tokens" 2>&1 | sed "s|out/book/$run/|out/$shown/|"
    } > "$gen/$name.txt"
}
# What the model writes: the untrained one, and the one lesson 01 just trained (`just step 01`).
samples 01-sample 160 01-two-ranks 01-data-parallel "--weights out/01-data-parallel/weights.safetensors "
# The TCP transport (Open MPI's path between machines), on loopback: same digest.
echo "· appendix-tcp"
{
    for btl in "vader,self" "tcp,self"; do
        echo "· --mca btl $btl"
        mpirun -q -n 2 --mca btl "$btl" --mca btl_tcp_if_include lo target/release/step03-layerwise-shard --no-plot --out out/book/tcp \
            | grep -E "^step +50/|final weights digest" | sed -E 's/ \| [0-9,]+ tok\/s$//; s/^/    /'
    done
} > "$gen/appendix-tcp.txt"
echo "· check-bits"
bash book/check-bits.sh > "$gen/check-bits.txt"
run 02-two-ranks 2 step02-whole-model-shard
run 02-four-ranks 4 step02-whole-model-shard
cp out/book/02-two-ranks/shard_vs_replicated.svg "$gen/02-shard-vs-replicated.svg"
# Getting started: lesson 02's run (`just step 02`, the README's command), then `just sample`.
samples getting-started-sample 100 02-two-ranks 02-whole-model-shard ""
# Activations kept or recomputed: the tally's peak, the measured one, the bits.
{
    for flag in "" --selective-recompute --recompute; do
        echo "· just step 02 2 --no-check $flag"
        mpirun -q --oversubscribe -n 2 target/release/step02-whole-model-shard --no-check --no-plot $flag --out out/book/02-recompute \
            | grep -E "^│ (peak |kept from|at the peak|activations|attention probabilities|backward:|peak live heap while training|measured peak heap)|final weights digest" | sed 's/^/    /'
    done
} > "$gen/02-recompute.txt"
echo "· 02-recompute"
if [ "$timings" != 0 ]; then
# What recompute costs in time: the same runs with and without --recompute,
# alternated, three pairs, on this machine now; each run's median step.
python3 - "$gen/02-recompute-time.txt" <<'PY'
import json, statistics, subprocess, sys
runs = {"kept": [], "selective": [], "recomputed": []}
for _ in range(3):
    for name, flag in (("kept", []), ("selective", ["--selective-recompute"]), ("recomputed", ["--recompute"])):
        out = f"out/book/02-recompute-time-{name}"
        subprocess.run(["mpirun", "-q", "--oversubscribe", "-n", "2", "target/release/step02-whole-model-shard", "--no-check", "--no-plot",
                        "--steps", "20", "--out", out, *flag], check=True, stdout=subprocess.DEVNULL)
        runs[name].append(json.load(open(f"{out}/report.json"))["median_step_seconds"] * 1e3)
kept, sel, rec = (statistics.median(runs[k]) for k in ("kept", "selective", "recomputed"))
with open(sys.argv[1], "w") as f:
    f.write("timing: lesson 02, tiny preset, 2 ranks, 20 steps; 3 triples run alternately; each run's median step\n")
    for name in ("kept", "selective", "recomputed"):
        each = ", ".join(f"{x:.2f} ms" for x in runs[name])
        f.write(f"timing: activations {name:<10} median {statistics.median(runs[name]):.2f} ms  (runs: {each})\n")
    f.write(f"timing: --recompute takes {rec / kept:.2f} times as long per step; one more forward of every block predicts about 1.33\n")
    f.write(f"timing: --selective-recompute takes {sel / kept:.3f} times as long; its one more q·kᵀ per block is 1.3% of the step's matmul FLOPs, its one more softmax uncounted\n")
PY
echo "· 02-recompute-time"
fi
# Activation memory at GPT-2's shape (T = 1024, where P weighs most): one
# rank, one 1 × 1024-token micro-batch, one step, each activation policy
# (the first peaks at 3.8 GB of heap; about 20 s each here).
{
    for flag in "" --selective-recompute --recompute; do
        echo "· just step 01 1 --preset gpt2 --batch-size 1 --micro-batches 1 --steps 1 $flag"
        mpirun -q -n 1 target/release/step01-data-parallel --preset gpt2 --batch-size 1 --micro-batches 1 --steps 1 $flag --out out/book/01-activations-gpt2 \
            | grep -E "^│ (peak  |at the peak|activations|attention probabilities|backward:|peak live heap while training|measured peak heap)|final weights digest" | sed 's/^/    /'
    done
} > "$gen/03-activations-gpt2.txt"
echo "· 03-activations-gpt2"
run 03-two-ranks 2 step03-layerwise-shard
cp out/book/03-two-ranks/memory_timeline.svg "$gen/03-memory-timeline.svg"
# A shape where the weights, not the activations, fill memory: the small
# preset (10.7M params) on 1 × 32-token micro-batches.
run 03-small-params 2 step03-layerwise-shard --preset small --batch-size 1 --seq-len 32 --micro-batches 2 --steps 3
cp out/book/03-small-params/memory_timeline.svg "$gen/03-memory-timeline-small.svg"
# Prefetch on and off, 20 steps each, 2 and 4 ranks: the measured lines, and the tally's peak beside the measured one.
{
    for ranks in 2 4; do
        for flag in "" --prefetch; do
            echo "· just step 03 $ranks --steps 20 --log-every 100 --no-plot $flag"
            mpirun -q --oversubscribe -n "$ranks" target/release/step03-layerwise-shard --steps 20 --log-every 100 --no-plot $flag --out "out/book/03-prefetch" \
                | awk -F'│' '/^measured/ { print "    " $0 }
                    /at the peak:/ { sub(/^ *at the peak: */, "", $2); sub(/ *$/, "", $2); at = $2 }
                    $2 ~ /^ *peak *$/ { sub(/^ */, "", $5); sub(/ *$/, "", $5); printf "    the tally'"'"'s peak: %s, at %s\n", $5, at }
                    /tally.s peak/ { gsub(/ /, "", $3); print "    measured peak heap / tally'"'"'s peak, rank 0: " $3 }'
        done
    done
} > "$gen/03-prefetch.txt"
echo "· 03-prefetch"
# Gradient accumulation four ways (`just accumulate`): calls, bytes against theory, tally beside heap, lesson 01's bits.
echo "· 03-accumulate"
python3 scripts/accumulate.py > /dev/null
cp out/accumulate/accumulate.txt "$gen/03-accumulate.txt"
cp out/book/01-two-ranks/loss.svg "$gen/01-loss.svg"
run 04-stage3-four-ranks 4 step04-optimizer-state-shard
run 04-stage1-four-ranks 4 step04-optimizer-state-shard --stage 1
# Hybrid sharding on one machine: 4 ranks in 2 shard groups of 2 (`just step 03 4 --hsdp 2`).
run 04-hsdp-four-ranks 4 step03-layerwise-shard --hsdp 2 --no-plot
echo "· 04-tally"
target/release/zero-tally 7B 64 > "$gen/04-tally-7b-64.txt"
target/release/zero-tally 405B 1024 > "$gen/04-tally-405b-1024.txt"
target/release/zero-tally 70B 256 --hsdp 8 > "$gen/04-tally-70b-256-hsdp-8.txt"
target/release/zero-tally 70B 64 --offload > "$gen/04-tally-70b-64-offload.txt"
echo "· 04-fits"
just fits 2>/dev/null > "$gen/04-fits.txt"
echo "· 04-zero-memory"
just zero-memory 2>/dev/null | grep -v '^wrote' > "$gen/04-zero-memory.txt"
cp out/zero-memory/zero_memory.svg "$gen/04-zero-memory.svg"
echo "· 04-reduce-dtype"
just reduce-dtype 2>/dev/null | grep -v '^wrote' > "$gen/04-reduce-dtype.txt"
cp out/reduce-dtype/reduce_dtype.svg "$gen/04-reduce-dtype.svg"
if [ "$timings" != 0 ]; then
# What bf16 costs or buys on a CPU: lesson 01 and ZeRO-3 in fp32 and bf16, as this CPU runs them and as a
# CPU without AVX512_BF16 would (FSDP_BF16=emulated: AVX-512 without BF16; FSDP_MATMUL=avx2: AVX2 alone).
{
    echo "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), 2 ranks, one compute thread each; median step"
    paths=("")
    grep -qw avx512_bf16 /proc/cpuinfo && paths+=("FSDP_BF16=emulated")
    grep -qw avx512f /proc/cpuinfo && paths+=("FSDP_MATMUL=avx2")
    for env in "${paths[@]}"; do
        echo "${env:-as this CPU runs them}:"
        for run in "lesson 01|tiny|20|step01-data-parallel" "ZeRO-3|tiny|20|step04-optimizer-state-shard --stage 3" \
                   "ZeRO-3|small|8|step04-optimizer-state-shard --stage 3"; do
            IFS='|' read -r label preset steps cmd <<< "$run"
            for p in fp32 bf16; do
                # shellcheck disable=SC2086
                t=$(env $env mpirun -q --oversubscribe -n 2 ${env:+-x "${env%%=*}"} target/release/$cmd --preset "$preset" \
                    --precision $p --steps "$steps" --log-every 100 --out out/book/04-cost | grep -oE "median step [0-9.]+ ms")
                echo "    $label, $preset, $p: $t"
            done
        done
    done
} > "$gen/04-precision-cost.txt"
echo "· 04-precision-cost"
fi
# Checkpoints: saved on 2 ranks, resumed on 4, and what a checkpoint holds.
echo "· appendix-reshard"
just reshard 03 2 4 2>/dev/null > "$gen/appendix-reshard.txt"
python3 - out/reshard/ckpt > "$gen/appendix-ckpt-files.txt" <<'PY'
import json, os, sys
root = sys.argv[1]
for d in sorted(os.listdir(root)):
    p = os.path.join(root, d)
    if os.path.isdir(p):
        print(f"{d}/")
        for f in sorted(os.listdir(p)):
            print(f"    {f:<32} {os.path.getsize(os.path.join(p, f)):>12,} bytes")
    else:
        print(f"{d:<36} -> {open(p).read().strip()}")
meta = json.load(open(os.path.join(root, open(os.path.join(root, "latest")).read().strip(), "meta.json")))
meta["data"]["vocab"] = meta["data"]["vocab"][:12] + "…"
for u in meta["units"]:
    u["params"] = f"[{u['params'][0]}, …, {u['params'][-1]}] ({len(u['params'])} tensors)"
meta["files"] = meta["files"][:2] + (["…"] if len(meta["files"]) > 2 else [])
print("\nmeta.json (long lists shortened):")
for k, v in meta.items():
    if isinstance(v, list):
        print(f"  {k}:")
        for x in v:
            print(f"    {json.dumps(x, ensure_ascii=False)}")
    else:
        print(f"  {k}: {json.dumps(v, ensure_ascii=False)}")
PY
# Across machines, on the simulated cluster (root): HSDP on 2 nodes × 2 ranks, and what a node
# that dies, a link that goes down and a SIGTERM leave.
echo "· appendix-cluster"
bash book/cluster-listings.sh "$gen"
echo "wrote $(ls "$gen" | wc -l) files under $gen"
