#!/usr/bin/env bash
# What ssh is to a real cluster, for scripts/cluster.sh: mpirun calls it as
# `cluster-rsh.sh HOST COMMAND…` to start its daemon on HOST, and it runs
# COMMAND inside that simulated node's network namespace, on the node's cores.
set -euo pipefail
host=$1
shift
line=$(grep -m1 "^$host " "${FSDP_CLUSTER:?cluster-rsh.sh runs under scripts/cluster.sh}/nodes") || {
    echo "cluster-rsh.sh: no simulated node $host (nodes: $(cut -d' ' -f1 "$FSDP_CLUSTER/nodes" | tr '\n' ' '))" >&2
    exit 255
}
read -r _ ns cores <<< "$line"
# A hostname of its own too (a UTS namespace): Open MPI tells nodes apart by
# name, and with one name for all it takes them for one and tries shared memory between them.
exec ip netns exec "$ns" unshare --uts taskset -c "$cores" sh -c 'hostname "$0" && eval "$1"' "$host" "$*"
