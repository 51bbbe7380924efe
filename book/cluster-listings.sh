#!/usr/bin/env bash
# The appendix "running across machines": listings from the simulated cluster
# (scripts/cluster.sh, root), written into GEN (book/generate-outputs.sh's folder).
#  - appendix-cluster-hsdp.txt: lesson 03 --hsdp 2 on 2 nodes × 2 ranks, a shard group per node;
#  - appendix-cluster-faults.txt: lesson 03 on 2 nodes × 1 rank, a checkpoint every 2 steps, and
#    after step 4's: node2 killed, the link down, a SIGTERM to mpirun. Which step a fault hits
#    depends on timing, so step numbers are shown as N; the time the job took to end is shown (and
#    masked by book-verify, as every time).
set -euo pipefail
cd "$(dirname "$0")/.."
gen=${1:?the folder to write into}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 RAYON_NUM_THREADS=1 FSDP_PROGRESS=plain
bin=target/release/step03-layerwise-shard

{
    echo "\$ cat out/cluster/hosts"
    FSDP_CLUSTER_ID=bookh FSDP_CLUSTER_DIR=out/book/cluster-hsdp bash scripts/cluster.sh --nodes 2 --slots 2 --rate 200mbit -- \
        sh -c 'cat $FSDP_CLUSTER/hosts; echo; echo "\$ mpirun -q --hostfile out/cluster/hosts -n 4 -x RAYON_NUM_THREADS=1 '"$bin"' --hsdp 2 --no-plot"; mpirun -q --hostfile $FSDP_CLUSTER/hosts -n 4 -x RAYON_NUM_THREADS=1 '"$bin"' --hsdp 2 --no-plot --out out/book/cluster-hsdp-run' \
        | awk '/^│ (world size|sharding) /; /^by communicator/ {t=1} t && /^$/ {t=0} t; /final weights digest/; !/^[│┌├└]/ && !/^(step|final|measured|wrote|by)/ && !/^$/' \
        | grep -v "^checkpoint"
} > "$gen/appendix-cluster-hsdp.txt"

# fault TITLE COMMAND: the run, the fault (COMMAND sees $pid, mpirun's, and $NODE2), what it printed.
fault() {
    local ck=out/book/cluster-fault-ckpt out=out/book/cluster-fault
    rm -rf "$ck" "$out"
    mkdir -p "$out"
    echo "· $1"
    FSDP_CLUSTER_ID=bookf FSDP_CLUSTER_DIR=out/book/cluster-fault-state NODE2=fsdpbookf-node2 CK=$ck OUT=$out BIN=$bin FAULT=$2 \
        bash scripts/cluster.sh --nodes 2 --rate none -- bash -c '
            mpirun -q --hostfile $FSDP_CLUSTER/hosts -n 2 -x RAYON_NUM_THREADS=1 $BIN --steps 100000 --no-plot \
                --ckpt $CK --save-every 2 --out $OUT 2> $OUT/stderr.txt > /dev/null &
            pid=$!
            for i in $(seq 1 1200); do grep -qs step-000004 $CK/latest && break; sleep 0.05; done
            t0=$(date +%s.%N)
            eval "$FAULT"
            wait $pid || true
            printf "the job ended %.2f s later, with:\n" "$(echo "$(date +%s.%N) - $t0" | bc)"
            case "$FAULT" in *link*) sleep 6 ;; esac  # the far rank ends on its own, on the heartbeat timeout'
    # Open MPI's own transport messages ("[node1][…] … writev failed: Broken pipe"),
    # printed when rank 0 was sending to the dead node at that moment, are left out.
    { grep -v "^step \|^\[node" "$out/stderr.txt" || true; } | sed -E 's/(during|after) step [0-9]+/\1 step N/; s/step-[0-9]{6}/step-00000N/g'
    echo
}
{
    fault "node2 dies: every process in its namespace SIGKILLed (ip netns pids NODE2 | xargs kill -9)" 'ip netns pids $NODE2 | xargs -r kill -9'
    fault "the link between the nodes goes down (ip -n NODE2 link set eth0 down)" 'ip -n $NODE2 link set eth0 down'
    fault "SIGTERM to mpirun (kill -TERM)" 'kill -TERM $pid'
} > "$gen/appendix-cluster-faults.txt"
