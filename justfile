# fsdp-from-scratch — every command a learner or CI needs.
#   just step 02          lesson 02 on 2 ranks      just step 02 4 --steps 100
#   just test             every test                just book / just diff 02

# Open MPI refuses root without these; one compute thread per rank keeps runs
# deterministic and the ranks off each other's cores.
export OMPI_ALLOW_RUN_AS_ROOT := "1"
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := "1"
export RAYON_NUM_THREADS := "1"
# On SIGTERM or Ctrl-C, mpirun sends the ranks SIGCONT, then SIGTERM and
# SIGKILL this many seconds apart (default 1): time to finish the step and
# save a checkpoint (crates/harness/src/stop.rs). Raise it for big models;
# mpirun itself waits out about twice this after a Ctrl-C.
export OMPI_MCA_odls_base_sigkill_timeout := "3"
# libevent's poll backend, not epoll, in mpirun and the ranks' PMIx (Open MPI's
# own events use poll already): epoll's race with a rank's sockets closing on
# MPI_Abort once printed "[warn] Epoll MOD(1) on fd 25 failed …" after a
# stopped run's one error line (cf. open-mpi/ompi#2004). Control traffic only.
export EVENT_NOEPOLL := "1"

# List the recipes.
default:
    @just --list

# Install what a fresh Debian machine lacks: Open MPI, libclang (for the MPI bindings), pkg-config.
setup:
    @bash scripts/deps.sh --install

# Build every lesson (release: candle in debug is 45-140x slower).
build: setup
    cargo build --release --workspace --bins

# Run lesson NN on RANKS MPI ranks (default 2), e.g. `just step 02 4 --steps 100`.
step NN RANKS="2" *ARGS: build
    #!/usr/bin/env bash
    set -euo pipefail
    dir=$(ls -d crates/{{NN}}-* 2>/dev/null | head -n1) || true
    if [ -z "$dir" ]; then echo "error: no lesson {{NN}}: pick one of $(ls -d crates/[0-9]* | sed 's|crates/||' | cut -d- -f1 | tr '\n' ' ')" >&2; exit 2; fi
    ranks="{{RANKS}}"; args=({{ARGS}})
    # `just step 04 --stage 1`: the second word is a flag, not a rank count.
    if ! [[ "$ranks" =~ ^[0-9]+$ ]]; then args=("$ranks" "${args[@]}"); ranks=2; fi
    over=""; [ "$ranks" -gt "$(nproc)" ] && over="--oversubscribe"
    # A progress bar when a person watches; plain lines into files and pipes.
    if [ -t 1 ]; then export FSDP_PROGRESS=bar; else export FSDP_PROGRESS=plain; fi
    exec mpirun -q $over -n "$ranks" "target/release/step${dir#crates/}" "${args[@]}"

# What a trained model writes: `just sample` (lesson 02's weights, after `just step 02`),
# `just sample --ckpt out/ck --prompt "KING:"`, `just sample --untrained`; `--help` lists the rest.
sample *ARGS: build
    @target/release/fsdp-sample {{ARGS}}

# Model-state bytes per device for data parallel and ZeRO 1-3, e.g. `just tally 7B 64`.
tally PARAMS RANKS *ARGS: build
    @target/release/zero-tally {{PARAMS}} {{RANKS}} {{ARGS}}

# "Doesn't fit -> fits": one memory budget per rank, data parallel against ZeRO-1/2/3 on 4 ranks,
# at GPT-2 small's size (85.9M params) with B = 1, T = 64: model states are most of the memory.
fits BUDGET="1GB": build
    #!/usr/bin/env bash
    set -uo pipefail
    args=(--preset gpt2 --batch-size 1 --seq-len 64 --micro-batches 4 --steps 2 --log-every 1 --mem-budget {{BUDGET}} --out out/fits)
    mkdir -p out
    echo "gpt2 preset (85.9M params), B = 1, T = 64, bf16 compute, 4 ranks, --mem-budget {{BUDGET}} per rank"
    run() {
        local label=$1; shift
        printf '\n== %s\n' "$label"
        # stdout, then stderr: a fixed order (merged, they interleave at random).
        out=$(mpirun -q --oversubscribe -n 4 "$@" "${args[@]}" 2>out/fits-stderr.txt < /dev/null); code=$?
        echo "$out" | grep -E '^step |peak live heap' || true
        grep -E '^error' out/fits-stderr.txt || true
        if [ $code -eq 0 ]; then echo "-> trained (exit 0)"
        elif [ $code -eq 2 ] && grep -q '^error: out of memory' out/fits-stderr.txt; then echo "-> stopped: out of memory (exit 2)"
        else echo "-> failed for another reason (exit $code):"; cat out/fits-stderr.txt; code=99; fi
        return $code
    }
    run "data parallel (lesson 01)" target/release/step01-data-parallel --precision bf16; dp=$?
    run "ZeRO-1" target/release/step04-optimizer-state-shard --stage 1; z1=$?
    run "ZeRO-2" target/release/step04-optimizer-state-shard --stage 2; z2=$?
    run "ZeRO-3" target/release/step04-optimizer-state-shard --stage 3; z3=$?
    echo
    # The demo succeeds when the budget separates them: data parallel and ZeRO-1 fail, ZeRO-2 and ZeRO-3 train.
    [ $dp -eq 2 ] && [ $z1 -eq 2 ] && [ $z2 -eq 0 ] && [ $z3 -eq 0 ] || { echo "with {{BUDGET}} the budget does not separate data parallel (exit $dp) and ZeRO-1 (exit $z1) from ZeRO-2 (exit $z2) and ZeRO-3 (exit $z3)"; exit 1; }

# ZeRO where model states dominate: GPT-2 small's size (85.9M params), B = 1, T = 64, 4 ranks; data parallel
# and ZeRO-1/2/3 in fp32 and bf16, each rank's measured peak beside its tally, and the figure (about 2 minutes).
zero-memory: build
    #!/usr/bin/env bash
    set -euo pipefail
    args=(--preset gpt2 --batch-size 1 --seq-len 64 --micro-batches 4 --steps 2 --log-every 1)
    for p in fp32 bf16; do
        mpirun -q --oversubscribe -n 4 target/release/step01-data-parallel "${args[@]}" --precision $p --out out/zero-memory/$p-dp < /dev/null > /dev/null
        for st in 1 2 3; do
            mpirun -q --oversubscribe -n 4 target/release/step04-optimizer-state-shard "${args[@]}" --stage $st --precision $p --out out/zero-memory/$p-zero$st < /dev/null > /dev/null
        done
    done
    target/release/zero-memory out/zero-memory

# Gradients reduced in bf16 against fp32 (--reduce-dtype): lesson 04's ZeRO-3 with 16 micro-batches per step (the
# global batch fixed) at 2, 4, 8 and 16 ranks, STEPS steps each: digests, final losses, the weights' largest
# difference, the reduce-scatter's bytes, and the loss curves (the book's listing: `just book-outputs`).
reduce-dtype STEPS="60": build
    #!/usr/bin/env bash
    set -euo pipefail
    out=out/reduce-dtype; rm -rf "$out"; mkdir -p "$out"
    for rd in fp32 bf16; do
        for n in 2 4 8 16; do
            mpirun -q --oversubscribe -n $n target/release/step04-optimizer-state-shard --stage 3 --micro-batches 16 \
                --steps {{STEPS}} --log-every {{STEPS}} --reduce-dtype $rd --out "$out/$rd-$n" < /dev/null > /dev/null
        done
    done
    target/release/reduce-numerics "$out" | tee "$out/reduce-dtype.txt"

# Checkpoint on FROM ranks, resume on TO ranks: the same weights, bit for bit, as one uninterrupted run.
reshard NN="03" FROM="2" TO="4": build
    #!/usr/bin/env bash
    set -euo pipefail
    dir=$(ls -d crates/{{NN}}-* 2>/dev/null | head -n1) || true
    if [ -z "$dir" ]; then echo "error: no lesson {{NN}}" >&2; exit 2; fi
    bin="target/release/step${dir#crates/}"
    gcd() { local a=$1 b=$2; while [ "$b" -ne 0 ]; do local t=$b; b=$((a % b)); a=$t; done; echo "$a"; }
    # One sum grouping both world sizes can reproduce: G = lcm(FROM, TO), and M a multiple of G.
    g=$(( {{FROM}} * {{TO}} / $(gcd {{FROM}} {{TO}}) )); m=$(( g * ((4 + g - 1) / g) ))
    args=(--sum-groups "$g" --micro-batches "$m" --log-every 5)
    rm -rf out/reshard; mkdir -p out/reshard
    show() { grep -E '^step |^checkpoint:|final weights digest|resumed from|gradient sum groups' | sed -E 's/, [0-9]+\.[0-9]+ s\)/)/; s/^│ *([a-z ]+[a-z]) *│ *(.*[^ ]) *│$/\1: \2/'; }
    digest() { grep -o '"weights_digest": "[0-9a-f]*"' "$1/report.json" | cut -d'"' -f4; }
    echo "${bin#target/release/}, --sum-groups $g --micro-batches $m"
    echo; echo "== 1. uninterrupted: 20 steps on {{FROM}} ranks"
    mpirun -q --oversubscribe -n {{FROM}} "$bin" --steps 20 "${args[@]}" --out out/reshard/uninterrupted < /dev/null | show
    echo; echo "== 2. the same run, stopped after step 10, checkpointing every 5 steps"
    mpirun -q --oversubscribe -n {{FROM}} "$bin" --steps 10 "${args[@]}" --ckpt out/reshard/ckpt --save-every 5 --out out/reshard/first < /dev/null | show
    echo; echo "== 3. resumed on {{TO}} ranks: steps 11 to 20"
    mpirun -q --oversubscribe -n {{TO}} "$bin" --steps 20 --micro-batches "$m" --log-every 5 --resume out/reshard/ckpt --ckpt out/reshard/ckpt --out out/reshard/resumed < /dev/null | show
    echo; echo "== 4. the last checkpoint as one file with nanoGPT's names, and its loss"
    target/release/fsdp-export --ckpt out/reshard/ckpt --out out/reshard/model.safetensors | sed 's/^[^:]*: //'
    target/release/fsdp-eval --weights out/reshard/model.safetensors
    a=$(digest out/reshard/uninterrupted); b=$(digest out/reshard/resumed)
    echo
    if [ "$a" = "$b" ]; then echo "uninterrupted $a = resumed $b: bit for bit"; else echo "uninterrupted $a ≠ resumed $b"; exit 1; fi

# Measure every lesson (1, 2, 4 ranks; tiny and small): writes out/bench/bench.md, bench.json and plots.
bench *ARGS: build
    #!/usr/bin/env bash
    set -euo pipefail
    target/release/fsdp-bench {{ARGS}}
    # The full bench (no flags) is what the book's performance appendix shows.
    if [ -z "{{ARGS}}" ]; then
        cp out/bench/bench.md book/src/generated/bench.md
        for f in out/bench/*.svg; do cp "$f" "book/src/generated/bench-$(basename "$f")"; done
        echo "copied into book/src/generated/ for the performance appendix"
    fi

# PyTorch beside the lessons on this machine, interleaved (optional, not in `just test` or CI): installs torch 2.15.0
# and numpy into .venv-torch (~5 GiB with its CUDA wheels; it runs on CPU), then pytorch/compare.py. The full run
# (no flags) is what the book's performance appendix shows.
compare-pytorch *ARGS: build
    #!/usr/bin/env bash
    set -euo pipefail
    venv=.venv-torch
    if ! "$venv/bin/python3" -c "import torch, numpy; assert torch.__version__.startswith('2.15.0')" 2>/dev/null; then
        command -v python3 >/dev/null || { echo "error: no python3: install it (apt-get install python3 python3-venv)" >&2; exit 2; }
        python3 -m venv "$venv" || { rm -rf "$venv"; echo "error: python3 cannot make a venv: install python3-venv (apt-get install python3-venv)" >&2; exit 2; }
        echo "installing torch 2.15.0 and numpy into $venv (about 5 GiB)"
        "$venv/bin/pip" install --quiet torch==2.15.0 numpy
    fi
    status=0
    "$venv/bin/python3" pytorch/compare.py --python "$venv/bin/python3" {{ARGS}} || status=$?
    # The full run goes into the book, its checks' verdicts (✓ or ✗) with it:
    # status 0 (all checks pass) or 3 (a check fails); not after a failed run.
    # One listing per matmul path (compare-pytorch-avx512.md, -avx2.md): an AVX-512 machine
    # writes both, the second with `just compare-pytorch --isa avx2`.
    if { [ -z "{{ARGS}}" ] || [ "{{ARGS}}" = "--isa avx2" ]; } && { [ $status -eq 0 ] || [ $status -eq 3 ]; } && [ -f out/compare-pytorch/compare.json ]; then
        path=$(python3 -c 'import json; print(json.load(open("out/compare-pytorch/compare.json"))["machine"]["path"])')
        cp out/compare-pytorch/compare.md "book/src/generated/compare-pytorch-$path.md"
        echo "copied into book/src/generated/compare-pytorch-$path.md for the performance appendix"
    fi
    exit $status

# The α–β model of this machine's MPI (latency, bandwidth), fitted from an all-gather sweep, and each
# lesson's time in collectives per step predicted from its bytes beside what it measured (2 ranks, tiny).
# `BOOK=1 just alpha-beta` also copies the result into the book's performance appendix.
alpha-beta: build
    #!/usr/bin/env bash
    set -euo pipefail
    out=out/alpha-beta; rm -rf "$out"; mkdir -p "$out"
    # A barrier before every collective: its time is then the data's, the wait for the other rank apart.
    run() { local name=$1; shift; FSDP_SYNC_COLLECTIVES=1 mpirun -q --oversubscribe -n 2 "$@" --steps 20 --log-every 20 --out "$out/$name" < /dev/null > /dev/null; }
    run 01-data-parallel target/release/step01-data-parallel
    run 02-whole-model-shard target/release/step02-whole-model-shard --no-check --no-plot
    run 03-layerwise-shard target/release/step03-layerwise-shard --no-plot
    run 03-layerwise-shard-prefetch target/release/step03-layerwise-shard --no-plot --prefetch
    flops=$(target/release/fsdp-bench --peak-only)
    mpirun -q --oversubscribe -n 2 target/release/fsdp-alpha-beta --matmul-flops "$flops" --out "$out" \
        "$out"/{01-data-parallel,02-whole-model-shard,03-layerwise-shard,03-layerwise-shard-prefetch}/report.json
    # Open MPI's shared-memory transport: the message size above which it stops sending eagerly.
    limit=$(ompi_info --param btl vader --level 9 2>/dev/null | grep -o '"btl_vader_eager_limit" (current value: "[0-9]*"' | grep -o '[0-9][0-9]*' || true)
    [ -z "$limit" ] || echo "Open MPI's shared-memory eager limit (ompi_info: btl_vader_eager_limit): $limit bytes" | tee -a "$out/alpha-beta.txt"
    if [ "${BOOK:-}" = 1 ]; then cp "$out/alpha-beta.txt" book/src/generated/bench-alpha-beta.txt; echo "copied into book/src/generated/ for the performance appendix"; fi

# Full sharding against hybrid sharding across machines (root or user namespaces): lesson 03 on 2 simulated nodes of 2
# ranks, the link between them shaped to RATE — full shard without and with --prefetch, and --hsdp 2
# (a shard group per node) — step time, bytes between the nodes as counted and as the link's counter
# saw them, bytes inside the nodes, heap per rank. `BOOK=1 just hsdp` copies the table into the book.
hsdp RATE="500mbit" *ARGS: build
    #!/usr/bin/env bash
    set -euo pipefail
    rm -rf out/hsdp
    bash scripts/cluster.sh --nodes 2 --slots 2 --rate {{RATE}} -- python3 scripts/hsdp.py --rate {{RATE}} {{ARGS}}
    if [ "${BOOK:-}" = 1 ]; then cp out/hsdp/hsdp.txt book/src/generated/04-hsdp-cluster.txt; echo "copied into book/src/generated/"; fi

# Gradient accumulation four ways (lesson 03's --accumulate): unit-major, reduce-every, no-sync, keep-unsharded at
# M/N = 1, 2, 4 on RANKS ranks: all-gathers and reduce-scatters per step (calls, bytes against theory), the tally's peak
# beside the measured heap, the step (the median of 3 runs, the modes alternating), and lesson 01's digest, with a
# traced step of each mode at M/N = 2 drawn one above the other — on shared memory, then (root or user namespaces)
# one rank per simulated node across a link shaped to RATE. `BOOK=1 just accumulate` copies both tables and the
# cluster's figure into the book.
accumulate RANKS="2" RATE="250mbit" *ARGS: build
    #!/usr/bin/env bash
    set -euo pipefail
    rm -rf out/accumulate
    python3 scripts/accumulate.py --ranks {{RANKS}} {{ARGS}}
    cluster=0
    bash scripts/cluster.sh --nodes {{RANKS}} --slots 1 --rate {{RATE}} -- python3 scripts/accumulate.py --ranks {{RANKS}} --rate {{RATE}} --steps 6 {{ARGS}} || cluster=$?
    case $cluster in
        0) ;;
        77) echo "note: the cluster's half was skipped (the line above says why); the shared-memory table stands" ;;
        *) exit $cluster ;;
    esac
    if [ "${BOOK:-}" = 1 ]; then
        cp out/accumulate/accumulate.txt book/src/generated/03-accumulate.txt
        if [ $cluster = 0 ]; then
            cp out/accumulate/accumulate-cluster.txt book/src/generated/03-accumulate-cluster.txt
            cp out/accumulate/accumulate-cluster-timeline.svg book/src/generated/03-accumulate-timeline.svg
        fi
        echo "copied into book/src/generated/"
    fi

# A cluster on one machine (root or user namespaces): NODES network namespaces on one switch, each link shaped to RATE
# (as tc writes it; none: unshaped); runs CMD in node1 with the hostfile out/cluster/hosts, then removes it all:
#   just cluster 2 500mbit mpirun -q --hostfile out/cluster/hosts -n 2 -x RAYON_NUM_THREADS=1 target/release/step03-layerwise-shard
cluster NODES="2" RATE="1gbit" *CMD: build
    @bash scripts/cluster.sh --nodes {{NODES}} --rate {{RATE}} -- {{CMD}}

# Overlap on a wire as slow as a network (root or user namespaces): lesson 01 with and without DDP's buckets, lesson 03 and
# ZeRO-3 with and without --prefetch (two units ahead; and one), ZeRO-2 with and without overlap_comm, on 2
# simulated nodes whose link is shaped to the first of RATES, traced, beside the α–β model's prediction and
# PyTorch's DDP and FSDP2 (if `just compare-pytorch` installed it); a bucket-size sweep; then ours again at
# each other rate, and every overlapped configuration against its blocking twin per rate (hidden share,
# step ratio). `BOOK=1 just overlap` also copies the tables and the traces' figures into the book.
overlap RATES="250mbit,100mbit,400mbit,1gbit" *ARGS: build
    #!/usr/bin/env bash
    set -euo pipefail
    rates="{{RATES}}"; rate=${rates%%,*}
    venv=.venv-torch; py=()
    if "$venv/bin/python3" -c "import torch; assert torch.__version__.startswith('2.15.0')" 2>/dev/null; then
        py=(--python "$PWD/$venv/bin/python3")
    else
        echo "note: no PyTorch 2.15.0 in $venv (just compare-pytorch installs it): its rows are left out"
    fi
    rm -rf out/overlap
    bash scripts/cluster.sh --nodes 2 --rate "$rate" -- python3 scripts/overlap.py --rate "$rate" --rates "$rates" "${py[@]}" {{ARGS}}
    python3 scripts/overlap.py --shared-memory --reps 5 --steps 20
    { echo; cat out/overlap/shared-memory.txt; } >> out/overlap/overlap.txt
    if [ "${BOOK:-}" = 1 ]; then
        cp out/overlap/overlap.txt book/src/generated/overlap.txt
        target/release/fsdp-timeline --out book/src/generated/03-overlap-timeline.svg --step 3 \
            "lesson 03, every collective blocking=out/overlap/runs/lesson_03-0/trace/trace.json" \
            "lesson 03 --prefetch --prefetch-depth 1: the next unit gathered, the last reduce-scattered on the stream=out/overlap/runs/lesson_03_--prefetch-depth_1-0/trace/trace.json" \
            "lesson 03 --prefetch: the next two entries' units gathered=out/overlap/runs/lesson_03_--prefetch-0/trace/trace.json"
        target/release/fsdp-timeline --out book/src/generated/01-buckets-timeline.svg --step 3 \
            "lesson 01, one all-reduce after the backward=out/overlap/runs/lesson_01_one_all-reduce-0/trace/trace.json" \
            "lesson 01 --bucket-mb 0.1: DDP's buckets in the backward=out/overlap/runs/lesson_01_DDP_buckets-0/trace/trace.json"
        echo "copied into book/src/generated/"
    fi

# Does this machine compute the book's bits? Short reference runs, compared with the book's listing.
check-bits: build
    #!/usr/bin/env bash
    set -uo pipefail
    mkdir -p out
    bash book/check-bits.sh > out/check-bits.txt || { echo "error: the reference runs failed (see above)" >&2; exit 2; }
    cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
    if diff -u book/src/generated/check-bits.txt out/check-bits.txt > out/check-bits.diff; then
        cat out/check-bits.txt
        echo "your machine computes the book's bits ($cpu)"
    else
        echo "your machine computes other bits than the book ($cpu): the book's listing (-) against this machine's (+):"
        cat out/check-bits.diff
        grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo || echo "(this CPU lacks AVX2 or FMA: the bits are promised only on x86-64 CPUs with both)"
        exit 1
    fi

# Run every test: unit tests, then the lessons as real MPI jobs at several world sizes. A test that
# cannot run on this machine (namespaces a normal user may not make here) says why in one line at the end.
test: build
    #!/usr/bin/env bash
    set -uo pipefail
    skips=${FSDP_TEST_OUT:-target}/test-skips
    rm -rf "$skips"
    cargo test --release --workspace; rc=$?
    n=$(find "$skips" -name '*.txt' 2>/dev/null | wc -l)
    if [ "$n" -gt 0 ]; then
        echo "skipped $n test(s) on this machine:"
        cat "$skips"/*.txt | sed 's/^/    /'
    fi
    exit $rc

# Show what lesson NN adds over the one before: its step against the previous one's, and its new files.
diff NN:
    @bash scripts/lesson-diff.sh {{NN}}

# Build the book into book/build (and check its includes resolve).
book:
    #!/usr/bin/env bash
    set -euo pipefail
    command -v mdbook >/dev/null || cargo install mdbook --locked
    mdbook build book

# Regenerate the book's output listings and figures from real runs.
book-outputs: build
    bash book/generate-outputs.sh

# Check the book tells the truth: regenerate and compare every listing, run every command it shows.
book-verify: build
    bash book/verify.sh

# Open every page in headless Chromium: no errors, every figure rendered; screenshots in out/book-render.
book-render: setup-browser book
    bash book/render-check.sh

# Install what `just book-render` needs as well: Debian's chromium (headless) and python3.
setup-browser:
    @bash scripts/deps.sh --install --browser

# Check exercise NN-K (e.g. `just exercise 02-1`): lesson NN on 4 ranks (2.1: 5) with your code (`--mine K`), bit for bit against its snapshot.
exercise ID: build
    #!/usr/bin/env bash
    set -uo pipefail
    id="{{ID}}"; all=$(grep -oE 'exercise_[0-9]+_[0-9]+ =>' tests/e2e/exercises.rs | sed -E 's/exercise_([0-9]+)_([0-9]+) =>/0\1-\2/' | tr '\n' ' ')
    [[ "$id" =~ ^[0-9]{2}-[0-9]+$ ]] || { echo "error: name an exercise as NN-K, e.g. \`just exercise 02-1\` for exercise 2.1 (there are: $all)" >&2; exit 2; }
    n=$((10#${id%-*})); k=${id#*-}
    [[ " $all " == *" $id "* ]] || { echo "error: there is no exercise $n.$k: pick one of $all" >&2; exit 2; }
    echo "exercise $n.$k: lesson ${id%-*} on $([ "$id" = 02-1 ] && echo 5 || echo 4) ranks with your code (--mine $k), against the committed snapshot"
    out=$(INSTA_UPDATE=no cargo test --release -q --test e2e "exercises::exercise_${n}_${k}" -- --ignored --exact --nocapture 2>&1); code=$?
    echo "$out" | grep -vE '^\s+[0-9]+: |^\s+at |^note: |^stack backtrace|^running [0-9]+ test|^test result|^error: test failed|^thread .* panicked|^snapshot assertion|^To update snapshots|^Stopped on the first|^Run `cargo insta|^failures:|^    exercises::|^---- |^$'
    echo
    if [ $code -eq 0 ]; then
        echo "✓ exercise $n.$k passes: your code gives the lesson's bits, bytes and weights."
    elif echo "$out" | grep -q "is not written yet"; then
        echo "✗ exercise $n.$k is not done yet: replace the todo!() under TODO(exercise): $n.$k in $(ls -d crates/${id%-*}-*)/src/exercises.rs."
        exit 1
    elif echo "$out" | grep -q "the run with your code stopped"; then
        echo "✗ exercise $n.$k does not pass yet: the run with your code stopped (its error is above)."
        exit 1
    else
        echo "✗ exercise $n.$k does not pass yet: above, the committed snapshot (-) against your run (+), and why."
        exit 1
    fi
