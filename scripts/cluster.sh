#!/usr/bin/env bash
# A cluster on one machine: K simulated nodes, each a network namespace with
# one interface (eth0) on a shared switch, every node's link shaped to RATE in
# both directions with `tc … tbf`. Runs COMMAND in node1 (where mpirun
# starts), then removes everything it made, however COMMAND ends.
#
#   bash scripts/cluster.sh [--nodes K] [--rate RATE] [--slots S] -- COMMAND…
#   bash scripts/cluster.sh --probe
#
#   --nodes K     simulated nodes (default 2), named node1 … nodeK
#   --rate RATE   each node's link, each way, as tc writes it: 500mbit, 1gbit, 250mbit (default 1gbit);
#                 `none` leaves the links unshaped (veth, many Gbit/s)
#   --slots S     MPI ranks each node runs (default: the cores each node gets, at least 1)
#   --probe       make nothing: exit 0 if this user can make the cluster here, else say why and exit 77
#
# Afterwards $FSDP_CLUSTER/links.txt holds the bytes each node's link sent
# and received (the kernel's counters, `ip -s link`).
#
# Inside, COMMAND sees what a real cluster gives: the hostfile
# $FSDP_CLUSTER/hosts ("node1 slots=S" …), names node1 … nodeK that resolve
# only inside the nodes, and mpirun set up to start remote ranks through
# scripts/cluster-rsh.sh (what ssh would do) with each node's ranks on cores
# of its own. So the README's command runs as is:
#
#   bash scripts/cluster.sh -- mpirun -q --hostfile out/cluster/hosts -n 2 target/release/step03-layerwise-shard
#
# Within a node the ranks talk over shared memory; between nodes over TCP on
# eth0. The addresses (10.77.0.0/24) exist only on the veth pairs inside
# these namespaces. As root it makes them with `ip netns`; as any other user
# it first enters namespaces of its own — a user namespace that maps it to
# root there, with a network and a mount namespace it owns (`unshare --user
# --map-root-user --net --mount`, which Debian 12's kernel allows a normal
# user) — and makes the nodes inside them, where everything it made goes
# when the command ends. Where the kernel allows neither, it says so in one
# line and exits with 77 (the tests' "skipped").
# FSDP_CLUSTER_DIR (default out/cluster) holds the hostfile and the state;
# FSDP_CLUSTER_ID names this cluster's namespaces (default: this shell's PID),
# so tests can run several at once: 1 to 7 letters or digits, since it goes
# into interface names ("fsdp<ID>-v<K>"), which Linux caps at 15 characters.
set -euo pipefail

nodes=2 rate=1gbit slots="" probe_only=""
while [ $# -gt 0 ]; do
    case "$1" in
        --nodes) nodes=${2:?--nodes needs K}; shift 2 ;;
        --rate) rate=${2:?--rate needs a rate, e.g. 500mbit}; shift 2 ;;
        --slots) slots=${2:?--slots needs S}; shift 2 ;;
        --probe) probe_only=1; shift ;;
        --) shift; break ;;
        *) echo "error: unknown argument $1: usage: cluster.sh [--nodes K] [--rate RATE] [--slots S] -- COMMAND…, or cluster.sh --probe" >&2; exit 2 ;;
    esac
done
[ $# -gt 0 ] || [ -n "$probe_only" ] || { echo "error: no command: usage: cluster.sh [--nodes K] [--rate RATE] [--slots S] -- COMMAND…, or cluster.sh --probe" >&2; exit 2; }
[[ "$nodes" =~ ^[1-9][0-9]?$ ]] || { echo "error: --nodes $nodes: pass a number of nodes from 1 to 99" >&2; exit 2; }
[ -z "$slots" ] || [[ "$slots" =~ ^[1-9][0-9]*$ ]] || { echo "error: --slots $slots: pass a number of ranks per node, 1 or more" >&2; exit 2; }
# tc's own rate syntax, checked here so that a typo fails before anything is made.
if [ "$rate" != none ] && ! [[ "$rate" =~ ^[0-9]+(\.[0-9]+)?(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps)$ ]]; then
    echo "error: --rate $rate is not a rate: write it as tc does, e.g. 500mbit, 1gbit or 250mbit (or none)" >&2
    exit 2
fi
id=${FSDP_CLUSTER_ID:-$$}
[[ "$id" =~ ^[A-Za-z0-9]{1,7}$ ]] || {
    echo "error: FSDP_CLUSTER_ID=$id: use 1 to 7 letters or digits (it goes into interface names, at most 15 characters)" >&2
    exit 2
}
[ -z "$probe_only" ] || [ "$(id -u)" -ne 0 ] || exit 0 # root makes the cluster with `ip netns`
# Not root: the same cluster inside namespaces of our own (a user namespace maps us to root there, with
# the rights over the network and mount namespaces it owns); the script runs again in them.
rootless=${FSDP_CLUSTER_ROOTLESS:-}
if [ "$(id -u)" -ne 0 ] && { [ -z "$rootless" ] || [ -n "$probe_only" ]; }; then
    # The probe does what the script will: a private /run and a veth pair, in namespaces of our own.
    probe='mount -t tmpfs fsdp-probe /run && PATH="$PATH:/usr/sbin:/sbin" ip link add fsdp-pa type veth peer name fsdp-pb'
    if ! unshare --user --map-root-user --net --mount --propagation private sh -c "$probe" 2>/dev/null; then
        echo "error: the simulated cluster needs root or unprivileged user namespaces, which this kernel does not allow (sysctl kernel.unprivileged_userns_clone=1, or user.max_user_namespaces above 0): run it as root, e.g. with sudo" >&2
        exit 77
    fi
    [ -z "$probe_only" ] || exit 0
    exec env FSDP_CLUSTER_ROOTLESS=1 FSDP_CLUSTER_ID="$id" unshare --user --map-root-user --net --mount --propagation private \
        bash "$0" --nodes "$nodes" --rate "$rate" ${slots:+--slots "$slots"} -- "$@"
fi
# tc and sysctl live in /usr/sbin, which a normal user's PATH leaves out on Debian.
export PATH="$PATH:/usr/sbin:/sbin"
for c in ip tc taskset sysctl mpirun; do
    command -v $c >/dev/null || { echo "error: $c is missing: install iproute2, util-linux, procps and Open MPI (just setup)" >&2; exit 2; }
done

here=$(cd "$(dirname "$0")" && pwd)
if [ -n "$rootless" ]; then
    # `ip netns` keeps its namespaces under /run/netns, which a normal user cannot write: a /run of our
    # own, in our mount namespace only (gone with it).
    mount -t tmpfs fsdp-cluster /run
fi
dir=${FSDP_CLUSTER_DIR:-out/cluster}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
ns() { echo "fsdp$id-$1"; } # a node's namespace
switch=$(ns switch)

cleanup() {
    # What crossed each node's link, from the kernel's counters, before the links go.
    if [ -f "$dir/nodes" ]; then
        : > "$dir/links.txt"
        for i in $(seq 1 "$nodes"); do
            read -r tx rx < <(ip -n "$(ns node$i)" -s link show eth0 2>/dev/null | awk '/TX:/{getline; tx=$1} /RX:/{getline; rx=$1} END{print tx, rx}') || true
            echo "node$i tx_bytes=${tx:-0} rx_bytes=${rx:-0}" >> "$dir/links.txt"
        done
    fi
    for i in $(seq 1 "$nodes"); do
        ip netns del "$(ns node$i)" 2>/dev/null || true
        [ -n "$rootless" ] || rm -rf "/etc/netns/$(ns node$i)"
    done
    ip netns del "$switch" 2>/dev/null || true
    rm -f "$dir/nodes" "$dir/shape.sh"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Cores: node i gets its own share of this machine's cores (round-robin when
# there are more nodes than cores). Each node's mpirun or orted runs on them,
# and its ranks inherit them: left to itself, every node's daemon would bind
# its first rank to core 0, and two nodes' ranks would share one core.
cores=$(nproc)
cores_of() { # node i (1-based) → a taskset list
    local i=$(($1 - 1))
    if [ "$cores" -ge "$nodes" ]; then
        local per=$((cores / nodes))
        echo "$((i * per))-$((i * per + per - 1))"
    else
        echo "$((i % cores))"
    fi
}
[ -n "$slots" ] || slots=$(( cores >= nodes ? cores / nodes : 1 ))

# shape RATE: every link's tbf set to RATE (none: removed), both directions.
shape() {
    local r=$1 i n
    for i in $(seq 1 "$nodes"); do
        n=$(ns node$i)
        ip netns exec "$n" tc qdisc del dev eth0 root 2>/dev/null || true
        ip netns exec "$switch" tc qdisc del dev "fsdp$id-p$i" root 2>/dev/null || true
        if [ "$r" != none ]; then
            # Jumbo frames (MTU 9000, as data-centre links run) and a 64 KB burst,
            # so that tbf passes each 64 KB TCP segment whole: with 1500-byte
            # frames and a 32 KB burst it cuts them up, and the shaping alone
            # costs several times the CPU (measured here), which would compete
            # with the ranks' compute on the same cores. Queue: up to 100 ms.
            ip netns exec "$n" tc qdisc add dev eth0 root tbf rate "$r" burst 64kb latency 100ms
            ip netns exec "$switch" tc qdisc add dev "fsdp$id-p$i" root tbf rate "$r" burst 64kb latency 100ms
        fi
    done
}

ip netns add "$switch"
ip -n "$switch" link add br0 type bridge
ip -n "$switch" link set br0 up
: > "$dir/hosts"
hosts="127.0.0.1 localhost"
for i in $(seq 1 "$nodes"); do
    hosts+=$'\n'"10.77.0.$i node$i"
    echo "node$i slots=$slots" >> "$dir/hosts"
done
if [ -n "$rootless" ]; then
    # The names, for every node at once: our /etc/hosts, in our mount namespace only (/etc/netns, where
    # `ip netns exec` would look for one per node, is not ours to write).
    printf '%s\n' "$hosts" > "$dir/etc-hosts"
    mount --bind "$dir/etc-hosts" /etc/hosts
    # Open MPI's session folders go under TMPDIR: one of ours (in /tmp, one that another user — or
    # root, to whom we are mapped here — made would not be writable).
    mkdir -p "$dir/tmp"
    export TMPDIR="$dir/tmp"
fi
for i in $(seq 1 "$nodes"); do
    n=$(ns node$i)
    ip netns add "$n"
    if [ -z "$rootless" ]; then
        # Names resolve inside the node only: `ip netns exec` mounts /etc/netns/<name>/hosts over /etc/hosts.
        mkdir -p "/etc/netns/$n"
        printf '%s\n' "$hosts" > "/etc/netns/$n/hosts"
        echo "node$i" > "/etc/netns/$n/hostname"
    fi
    ip link add "fsdp$id-v$i" type veth peer name "fsdp$id-p$i"
    ip link set "fsdp$id-v$i" netns "$n"
    ip link set "fsdp$id-p$i" netns "$switch"
    ip -n "$n" link set "fsdp$id-v$i" name eth0
    ip -n "$n" addr add "10.77.0.$i/24" dev eth0
    # TCP Small Queues: at most 128 KB of a socket's data waits in the node's
    # queue (Linux's default here, 4 MB, queues 100 ms at 300 Mbit/s, and the
    # acknowledgements of the other direction wait behind it: measured here,
    # collectives took twice their time when the ranks did not send at once).
    ip netns exec "$n" sysctl -q -w net.ipv4.tcp_limit_output_bytes=131072
    ip -n "$n" link set lo up
    ip -n "$n" link set eth0 mtu 9000 up
    ip -n "$switch" link set "fsdp$id-p$i" master br0
    ip -n "$switch" link set "fsdp$id-p$i" mtu 9000 up
    echo "node$i $n $(cores_of "$i")" >> "$dir/nodes"
done

shape "$rate"
# For a command that changes the wire while it runs (`just overlap`): `bash $FSDP_CLUSTER/shape.sh RATE`.
{
    echo "#!/usr/bin/env bash"
    echo "# Written by scripts/cluster.sh: sets every link of this cluster to RATE (or none)."
    echo "set -euo pipefail"
    declare -f ns shape
    echo "id=$id nodes=$nodes switch=$switch"
    echo 'shape "${1:?a rate, as tc writes it, or none}"'
} > "$dir/shape.sh"

# mpirun starts remote daemons through the agent (as it would through ssh);
# the node's cores come from the agent's taskset, so Open MPI must not bind.
export FSDP_CLUSTER="$dir"
export OMPI_MCA_plm_rsh_agent="$here/cluster-rsh.sh"
export OMPI_MCA_hwloc_base_binding_policy=none
export OMPI_MCA_btl=self,vader,tcp
export OMPI_MCA_btl_tcp_if_include=eth0
export OMPI_MCA_oob_tcp_if_include=eth0
export OMPI_MCA_rmaps_base_oversubscribe=1
# A link that goes down sends nothing, not even a reset: mpirun's connection to
# a far node's daemon then waits for TCP's keepalive probes, which Open MPI
# starts after 300 s of silence, 20 s apart, 9 of them (8 minutes). The
# lessons' heartbeat names the lost node after FSDP_HEARTBEAT_TIMEOUT (5 s);
# these let mpirun give up on the unreachable daemon about 8 × 1 s after the
# link went quiet (its connection idles while the ranks train, so the probes
# are already running) — after the heartbeat has spoken — and end the job
# (a real cluster wants the same; see the appendix "running across machines").
export OMPI_MCA_oob_tcp_keepalive_time=${OMPI_MCA_oob_tcp_keepalive_time:-2}
export OMPI_MCA_oob_tcp_keepalive_intvl=${OMPI_MCA_oob_tcp_keepalive_intvl:-1}
export OMPI_MCA_oob_tcp_keepalive_probes=${OMPI_MCA_oob_tcp_keepalive_probes:-8}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
status=0
ip netns exec "$(ns node1)" unshare --uts taskset -c "$(cores_of 1)" sh -c 'hostname node1 && exec "$@"' sh "$@" || status=$?
exit $status
