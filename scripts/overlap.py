"""`just overlap`, inside the simulated cluster: what overlap buys on a wire as slow as a network.

Run by `just overlap` as `scripts/cluster.sh --nodes 2 --rate RATE -- python3 scripts/overlap.py …`:
two simulated nodes, one rank each, every link shaped to RATE. The lessons' default global batch
(the tiny preset, 4 micro-batches of 8 × 64 tokens: 2 per rank), fp32. In one run, on this wire:

1. the α–β fit (`fsdp-alpha-beta`, an all-gather sweep between the two nodes);
2. every configuration, --reps times, in alternating order, each traced (`--trace`):
   lesson 01 with its one all-reduce and with DDP's buckets (`--bucket-mb`), lesson 03
   without and with FSDP2's overlap (`--prefetch`: two units ahead; and one ahead), ZeRO-3 likewise,
   ZeRO-2 without and with DeepSpeed's overlap_comm, and PyTorch's DDP and FSDP2 over
   gloo;
3. PyTorch's two again with the links unshaped (its compute, to within an unshaped
   veth's cost), since its time on the wire is not measured apart;
4. the bucket-size sweep (CS336's): lesson 01 at several --bucket-mb;
5. at every other rate of --rates, the wire reshaped: ours again, --reps times;
6. `fsdp-overlap`, which sets each configuration's measured compute, communication,
   exposed time and step beside the α–β model's replay of it, checks the targets, and
   tabulates each overlapped configuration against its blocking twin at every rate.

`--shared-memory` instead runs, outside the cluster, each overlapped configuration beside
its blocking twin over shared memory (2 ranks on this machine's 2 cores), where there is
little to hide: what the communication stream costs when it cannot pay.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
           RAYON_NUM_THREADS="1", FSDP_PROGRESS="plain", GLOO_SOCKET_IFNAME="eth0")
CLUSTER = os.environ.get("FSDP_CLUSTER")

# (label, the group it is compared in, what kind of overlap, binary, flags); each overlapped one after its blocking twin
Z3 = ["--stage", "3", "--precision", "fp32"]
Z2 = ["--stage", "2", "--precision", "fp32"]
OURS = [
    ("lesson 01, one all-reduce", "DDP", "", "step01-data-parallel", []),
    ("lesson 01, DDP buckets", "DDP", "buckets", "step01-data-parallel", ["--bucket-mb", "{bucket}"]),
    ("lesson 03", "FSDP2", "", "step03-layerwise-shard", ["--no-plot"]),
    ("lesson 03 --prefetch", "FSDP2", "fsdp", "step03-layerwise-shard", ["--no-plot", "--prefetch"]),
    ("lesson 03 --prefetch-depth 1", "FSDP2", "fsdp", "step03-layerwise-shard",
     ["--no-plot", "--prefetch", "--prefetch-depth", "1"]),
    ("ZeRO-3 (fp32)", "FSDP2", "", "step04-optimizer-state-shard", Z3),
    ("ZeRO-3 (fp32) --prefetch", "FSDP2", "fsdp", "step04-optimizer-state-shard", Z3 + ["--prefetch"]),
    ("ZeRO-2 (fp32)", "", "", "step04-optimizer-state-shard", Z2),
    ("ZeRO-2 (fp32) --overlap-comm", "", "buckets", "step04-optimizer-state-shard", Z2 + ["--overlap-comm"]),
]
TWIN = {"lesson 01, DDP buckets": "lesson 01, one all-reduce", "lesson 03 --prefetch": "lesson 03",
        "lesson 03 --prefetch-depth 1": "lesson 03", "ZeRO-3 (fp32) --prefetch": "ZeRO-3 (fp32)",
        "ZeRO-2 (fp32) --overlap-comm": "ZeRO-2 (fp32)"}
TORCH = [("DDP", "ddp"), ("FSDP2", "fsdp2")]
SWEEP = ["0.1", "1", "2", "100"]  # MB: 5, 3, 2 and 1 buckets of the tiny preset's units


def sh(cmd):
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=1800)
    if r.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-1500:]}\n{r.stderr[-2500:]}")
    return r.stdout


def mpirun(*cmd):
    return sh(["mpirun", "-q", "--hostfile", f"{CLUSTER}/hosts", "-n", "2", "-x", "RAYON_NUM_THREADS=1",
               "-x", "OMP_NUM_THREADS=1", "-x", "GLOO_SOCKET_IFNAME=eth0", *cmd])


def tc_rate_bytes(rate):
    """Bytes per second of a rate as tc writes it (SI units: 500mbit, 1gbit, 25mbps)."""
    units = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8,
             "bps": 1, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9}
    for unit in sorted(units, key=len, reverse=True):
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * units[unit]
    sys.exit(f"error: --rate {rate} is not a rate as tc writes it (e.g. 500mbit)")


PAIRS = [  # (label, binary, blocking flags, overlapped flags)
    ("lesson 01, DDP buckets (--bucket-mb 0.1)", "step01-data-parallel", [], ["--bucket-mb", "0.1"]),
    ("lesson 03 --prefetch", "step03-layerwise-shard", ["--no-plot"], ["--no-plot", "--prefetch"]),
    ("lesson 03 --prefetch-depth 1", "step03-layerwise-shard", ["--no-plot"],
     ["--no-plot", "--prefetch", "--prefetch-depth", "1"]),
    ("ZeRO-2 --overlap-comm", "step04-optimizer-state-shard", ["--stage", "2"], ["--stage", "2", "--overlap-comm"]),
    ("ZeRO-3 --prefetch", "step04-optimizer-state-shard", ["--stage", "3"], ["--stage", "3", "--prefetch"]),
]


def shared_memory(a):
    """Each overlapped configuration beside its blocking twin, on shared memory, alternated."""
    import statistics
    lines = [f"On shared memory, 2 ranks on this machine, {a.reps} alternated pairs of {a.steps}-step runs, each run's median step:"]
    for label, binary, blocking, overlapped in PAIRS:
        got = {"blocking": [], "overlapped": []}
        for rep in range(a.reps):
            for side, flags in (("blocking", blocking), ("overlapped", overlapped))[:: 1 if rep % 2 == 0 else -1]:
                out = f"{a.out}/shared/{binary}-{side}-{rep}"
                sh(["mpirun", "-q", "-n", "2", f"{a.bin}/{binary}", "--steps", str(a.steps), "--micro-batches",
                    str(a.micro_batches),
                    "--log-every", str(a.steps), "--out", out, *flags])
                got[side].append(json.load(open(f"{out}/report.json"))["median_step_seconds"] * 1e3)
        b, o = statistics.median(got["blocking"]), statistics.median(got["overlapped"])
        lines.append(f"  {label:<42} {o:6.1f} ms against {b:6.1f} ms blocking: {o / b:.3f}×")
    text = "\n".join(lines) + "\n"
    os.makedirs(a.out, exist_ok=True)
    with open(f"{a.out}/shared-memory.txt", "w") as f:
        f.write(text)
    print(text, end="")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="none", help="the links' rate, as tc writes it (for the table)")
    p.add_argument("--rates", default="", help="more rates for the rate table, comma-separated (e.g. 100mbit,1gbit)")
    p.add_argument("--micro-batches", type=int, default=4, help="per step, over both ranks (the lessons' default)")
    p.add_argument("--bin", default="target/release")
    p.add_argument("--python", default=None, help="a Python with torch 2.15 (none: PyTorch's rows are left out)")
    p.add_argument("--out", default="out/overlap")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--bucket-mb", default="0.1", help="lesson 01's buckets in the main table")
    p.add_argument("--shared-memory", action="store_true", help="instead: overlapped against blocking, over shared memory")
    a = p.parse_args()
    if a.shared_memory:
        return shared_memory(a)
    rate_bytes = tc_rate_bytes(a.rate)
    rates = [r for r in a.rates.split(",") if r and r != a.rate]
    for r in rates:
        tc_rate_bytes(r)  # each one a rate tc takes, before anything runs
    if not CLUSTER:
        sys.exit("error: run it inside the simulated cluster: just overlap (scripts/cluster.sh -- python3 scripts/overlap.py …)")
    os.makedirs(f"{a.out}/runs", exist_ok=True)
    common = ["--steps", str(a.steps), "--micro-batches", str(a.micro_batches), "--log-every", str(a.steps)]

    print(f"· the α–β fit on this wire ({a.rate} each way)", flush=True)
    mpirun(f"{a.bin}/fsdp-alpha-beta", "--reps", "11", "--out", f"{a.out}/alpha-beta")

    def ours(label, binary, flags, rep, rate=None):
        name = f"{label}-{rep}".replace(" ", "_").replace(",", "").replace("(", "").replace(")", "")
        name = name if rate is None else f"{rate}-{name}"
        out = f"{a.out}/runs/{name}"
        mpirun(f"{a.bin}/{binary}", *common, *flags, "--out", out, "--trace", f"{out}/trace")
        r = json.load(open(f"{out}/report.json"))
        print(f"  {label}, run {rep + 1}{'' if rate is None else ' at ' + rate}: median step "
              f"{r['median_step_seconds'] * 1e3:.1f} ms", flush=True)
        return out

    data = f"{a.out}/data"
    port = [29800]

    def theirs(label, mode, rep, tag):
        port[0] += 1
        out = f"{a.out}/runs/torch-{mode}-{tag}-{rep}.json"
        mpirun(a.python, f"{HERE}/../pytorch/train.py", mode, "--data", data, "--json", out, "--port", str(port[0]),
               "--master", "node1")
        r = json.load(open(out))
        print(f"  {label} (PyTorch, {tag}), run {rep + 1}: median step {r['median_step_seconds'] * 1e3:.1f} ms", flush=True)
        return out

    torch = [] if a.python is None else TORCH
    if torch:
        sh([f"{a.bin}/fsdp-reference-data", "--out", data, "--steps", str(a.steps), "--micro-batches",
            str(a.micro_batches)])
    runs = {label: [] for label, *_ in OURS}
    runs.update({label: [] for label, _ in torch})
    unshaped = {label: [] for label, _ in torch}
    print(f"· every configuration, {a.reps} times, alternating", flush=True)
    for rep in range(a.reps):
        order = [("ours", o) for o in OURS] + [("torch", t) for t in torch]
        for side, what in order if rep % 2 == 0 else order[::-1]:
            if side == "ours":
                label, _, _, binary, flags = what
                runs[label].append(ours(label, binary, [f.format(bucket=a.bucket_mb) for f in flags], rep))
            else:
                runs[what[0]].append(theirs(*what, rep, "shaped"))
    if torch:
        print("· PyTorch with the links unshaped (its compute)", flush=True)
        sh(["bash", f"{CLUSTER}/shape.sh", "none"])
        for rep in range(a.reps):
            for label, mode in torch:
                unshaped[label].append(theirs(label, mode, rep, "unshaped"))
        sh(["bash", f"{CLUSTER}/shape.sh", a.rate])
    print("· the bucket-size sweep: lesson 01", flush=True)
    sweep = {mb: [] for mb in SWEEP}
    for rep in range(a.reps):
        for mb in SWEEP if rep % 2 == 0 else SWEEP[::-1]:
            sweep[mb].append(ours(f"sweep {mb} MB", "step01-data-parallel", ["--bucket-mb", mb], rep))

    # The other rates: ours again on the reshaped wire, then the wire as it was.
    by_rate = {a.rate: runs}
    for rate in rates:
        print(f"· every configuration of ours at {rate}, {a.reps} times, alternating", flush=True)
        sh(["bash", f"{CLUSTER}/shape.sh", rate])
        by_rate[rate] = {label: [] for label, *_ in OURS}
        for rep in range(a.reps):
            for label, _, _, binary, flags in OURS if rep % 2 == 0 else OURS[::-1]:
                flags = [f.format(bucket=a.bucket_mb) for f in flags]
                by_rate[rate][label].append(ours(label, binary, flags, rep, rate))
    if rates:
        sh(["bash", f"{CLUSTER}/shape.sh", a.rate])

    rows = [dict(label=label, group=group, overlap=overlap, kind="ours", runs=runs[label], hiding=label == "lesson 03",
                 twin=TWIN.get(label)) for label, group, overlap, *_ in OURS]
    rows += [dict(label=label, group=label, kind="torch", runs=runs[label], unshaped_runs=unshaped[label])
             for label, _ in torch]
    rows += [dict(label=f"lesson 01, --bucket-mb {mb}", group="DDP", overlap="sweep", kind="ours", table="sweep",
                  runs=sweep[mb]) for mb in SWEEP]
    # A block unit's all-gather: this rank's shard to the other (tiny preset, 2 ranks, fp32).
    report = json.load(open(f"{runs['lesson 03'][0]}/report.json"))
    unit = max(u["shard"] for u in report["units"])
    # The rate table: every overlapped configuration of ours beside its blocking twin, rate by rate (slowest first).
    rate_rows = [dict(rate=rate, rate_bytes_per_second=tc_rate_bytes(rate), label=label, overlap=overlap,
                      runs=by_rate[rate][label], twin=TWIN[label], twin_runs=by_rate[rate][TWIN[label]])
                 for rate in sorted(by_rate, key=tc_rate_bytes) for label, _, overlap, *_ in OURS if label in TWIN]
    manifest = dict(rate=a.rate, rate_bytes_per_second=rate_bytes, alpha_beta=f"{a.out}/alpha-beta/alpha-beta.json",
                    torch_warmup=1, rows=rows, unit_gather_bytes=4 * unit, micro_batches=a.micro_batches,
                    rate_rows=rate_rows)
    with open(f"{a.out}/manifest.json", "w") as f:
        json.dump(manifest, f, indent=1)
    print(sh([f"{a.bin}/fsdp-overlap", "--manifest", f"{a.out}/manifest.json", "--out", a.out]), end="")


if __name__ == "__main__":
    main()
