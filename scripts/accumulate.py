"""`just accumulate`: gradient accumulation four ways (lesson 03's `--accumulate`), side by side.

For each mode (unit-major, reduce-every, no-sync, keep-unsharded) and M/N = 1, 2, 4 micro-batches per rank
at 2 ranks on shared memory (the tiny preset, 8 × 64-token micro-batches): the all-gathers and
reduce-scatters per step (calls, and bytes counted beside the report's theory), the peak heap per rank
(the tally from shapes beside the largest measured), the median step, and whether the final weights'
digest is lesson 01's at the same M (one rank: the pairwise tree gives every power-of-two world its bits).
Writes out/accumulate/accumulate.txt; inside the simulated cluster (`scripts/cluster.sh --nodes 2 --slots 1`,
which sets FSDP_CLUSTER) lesson 03's ranks run one per node across the shaped link, and the table goes to
out/accumulate/accumulate-cluster.txt.
"""
import argparse
import json
import os
import subprocess
import sys

ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", RAYON_NUM_THREADS="1",
           FSDP_PROGRESS="plain")
MODES = ["unit-major", "reduce-every", "no-sync", "keep-unsharded"]
OUT = "out/accumulate"
CLUSTER = os.environ.get("FSDP_CLUSTER")


def run(binary, ranks, flags, out):
    """One run under mpirun on this machine: its report."""
    where = ["--hostfile", f"{CLUSTER}/hosts", "-x", "RAYON_NUM_THREADS=1"] if CLUSTER and ranks > 1 else ["--oversubscribe"]
    cmd = ["mpirun", "-q", *where, "-n", str(ranks), f"target/release/{binary}", "--out", out, *flags]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=1800)
    if r.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-1500:]}\n{r.stderr[-2500:]}")
    with open(f"{out}/report.json") as f:
        return json.load(f)


def mb(b):
    return f"{b / 1e6:.2f}"


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--per-rank", default="1,2,4", help="micro-batches per rank, comma-separated")
    p.add_argument("--rate", default="", help="the cluster's link, for the title (inside scripts/cluster.sh)")
    a = p.parse_args()
    shape = ["--steps", str(a.steps), "--log-every", str(a.steps), "--batch-size", "8", "--seq-len", "64"]
    rows, lines = [], []
    for k in [int(x) for x in a.per_rank.split(",")]:
        m = a.ranks * k
        dp = run("step01-data-parallel", 1, [*shape, "--micro-batches", str(m)], f"{OUT}/dp-{m}")
        for mode in MODES:
            r = run("step03-layerwise-shard", a.ranks, [*shape, "--micro-batches", str(m), "--no-plot",
                                                        "--accumulate", mode], f"{OUT}/{mode}-{k}")
            steps = len(r["losses"])
            t = r["traffic"]
            theory = r["expected_bytes_per_step"]
            cells = [mode, str(k)]
            for kind in ["all_gather", "reduce_scatter"]:
                sent = t[kind]["bytes_sent"] // steps
                cells += [f"{t[kind]['calls'] // steps}", f"{sent:,}", "=" if sent == theory[kind] else f"≠ {theory[kind]:,}"]
            peak = max(r["measured_peak_bytes"])
            # "heap" on every row: book-verify compares a measured heap within 3%, and masks "ms".
            cells += [f"{mb(r['tally_expected_peak_bytes'])} MB", f"{mb(peak)} MB heap",
                      f"{peak / r['tally_expected_peak_bytes']:.3f}", f"{r['median_step_seconds'] * 1e3:.1f} ms",
                      "yes" if r["weights_digest"] == dp["weights_digest"] else "NO"]
            rows.append(cells)
    head = ["mode", "M/N", "all-gathers", "bytes", "theory", "reduce-scatters", "bytes", "theory",
            "tally's peak", "measured", "measured/tally", "step", "lesson 01's bits"]
    width = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = lambda cells: "| " + " | ".join(str(c).rjust(w) for c, w in zip(cells, width)) + " |"
    on = f"on two simulated nodes, a {a.rate} link between them" if CLUSTER else "on shared memory"
    lines.append(f"lesson 03 at {a.ranks} ranks {on}, tiny preset, 8 × 64-token micro-batches, "
                 f"{a.steps} steps; per step and rank (heap: the largest rank's peak)")
    lines.append(fmt(head))
    lines.append("|" + "|".join("-" * (w + 2) for w in width) + "|")
    lines += [fmt(r) for r in rows]
    text = "\n".join(lines) + "\n"
    os.makedirs(OUT, exist_ok=True)
    with open(f"{OUT}/accumulate{'-cluster' if CLUSTER else ''}.txt", "w") as f:
        f.write(text)
    print(text, end="")
    if any(r[-1] != "yes" or r[4] != "=" or r[7] != "=" for r in rows):
        sys.exit("error: a mode left lesson 01's bits or its theory's bytes")


if __name__ == "__main__":
    main()
