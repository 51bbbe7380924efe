"""`just hsdp`, inside the simulated cluster: full sharding against hybrid sharding across two nodes.

Run by `just hsdp` as `scripts/cluster.sh --nodes 2 --slots 2 --rate RATE -- python3 scripts/hsdp.py …`:
two simulated nodes of two ranks each (4 ranks; a node's two ranks share its core and talk over
shared memory), the link between them shaped to RATE each way. In one run, alternated rep by rep:

- lesson 03, full shard (every unit over all 4 ranks), without and with `--prefetch`;
- lesson 03 `--hsdp 2`: one shard group per node, each shard's gradient all-reduced between the nodes,
  without and with `--prefetch` (the stream then gathers in its shard group, and reduce-scatters and
  all-reduces each unit in one op);

each with the tiny preset, one 8 × 64 micro-batch per rank. For every configuration: the median step,
the bytes node 1 sent to node 2 per step as the lesson counted them (each collective's payload to ranks
on the other node, summed over node 1's ranks) beside what node 1's link carried (the kernel's
counter, /sys/class/net/eth0/statistics/tx_bytes, read around two runs of different lengths, so that
start-up and the final gather cancel), the bytes that stayed inside each node (counted), and the heap
per rank (the tally from shapes, and the measured peak). The weights digest must be lesson 01's in
every run.
"""
import argparse
import os
import statistics
import sys

from lesson_run import CLUSTER, lesson

CONFIGS = [  # (label, flags)
    ("full shard (S = 4)", ["--no-plot"]),
    ("full shard (S = 4), --prefetch", ["--no-plot", "--prefetch"]),
    ("HSDP (S = 2, a shard group per node)", ["--no-plot", "--hsdp", "2"]),
    ("HSDP (S = 2), --prefetch", ["--no-plot", "--hsdp", "2", "--prefetch"]),
]


def tx_bytes():
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


def run(flags, steps, out, binary="step03-layerwise-shard"):
    """One run of a lesson on the cluster's 4 ranks: its report, and what node 1's link sent meanwhile."""
    before = tx_bytes()
    report = lesson(binary, 4, ["--steps", str(steps), *flags], out)
    return report, tx_bytes() - before


def counted(report, steps):
    """Bytes per step node 1's ranks sent, as the lesson counted them: (to the other node, inside node 1)."""
    node = report["node_of_rank"]
    ranks = [r for r, n in enumerate(node) if n == node[0]]
    # Every rank of a node sends the same (the reports print rank 0's): rank 0's totals over its
    # communicators (world, and under HSDP the shard and replica groups), per rank of node 1.
    t = report["traffic"].values()
    sent, remote = sum(k["bytes_sent"] for k in t), sum(k["bytes_remote"] for k in t)
    return len(ranks) * remote / steps, len(ranks) * (sent - remote) / steps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rate", required=True, help="the link's rate, as tc writes it (for the table's title)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="steps of the long runs (the short ones run 2)")
    p.add_argument("--out", default="out/hsdp")
    a = p.parse_args()
    if not CLUSTER:
        sys.exit("error: scripts/hsdp.py runs inside the simulated cluster: `just hsdp` (scripts/cluster.sh)")
    os.makedirs(a.out, exist_ok=True)
    short = 2
    rows = {label: {"step_ms": [], "link": [], "report": None} for label, _ in CONFIGS}
    digests = set()
    for rep in range(a.reps):
        order = CONFIGS if rep % 2 == 0 else CONFIGS[::-1]  # alternated: no configuration always first
        for label, flags in order:
            tag = f"{a.out}/{CONFIGS.index((label, flags))}-{rep}"
            long_report, long_sent = run(flags, a.steps, tag + "-long")
            _, short_sent = run(flags, short, tag + "-short")
            rows[label]["step_ms"].append(long_report["median_step_seconds"] * 1e3)
            rows[label]["link"].append((long_sent - short_sent) / (a.steps - short))
            rows[label]["report"] = long_report
            digests.add(long_report["weights_digest"])
    lesson01, _ = run([], a.steps, f"{a.out}/lesson01", "step01-data-parallel")
    if digests != {lesson01["weights_digest"]}:
        sys.exit(f"error: the weights differ from lesson 01's {lesson01['weights_digest']}: {sorted(digests)}")

    lines = [f"lesson 03 on 2 simulated nodes × 2 ranks, the link between them shaped to {a.rate} each way "
             f"(tiny preset, one 8 × 64 micro-batch per rank, {a.steps} steps, median of {a.reps} alternated reps)", ""]
    head = ["configuration", "median step", "node 1 → node 2, counted", "… on the link", "link / counted",
            "inside node 1, counted", "heap per rank: tally", "measured peak"]
    table = [head]
    for label, _ in CONFIGS:
        row = rows[label]
        r = row["report"]
        remote, inside = counted(r, r["steps"])
        link = statistics.median(row["link"])
        peak = max(r["measured_peak_bytes"])
        table.append([label, f"{statistics.median(row['step_ms']):.1f} ms", f"{remote / 1e6:.3f} MB",
                      f"{link / 1e6:.3f} MB", f"{link / remote:.3f}", f"{inside / 1e6:.3f} MB",
                      f"{r['tally_expected_peak_bytes'] / 1e6:.2f} MB", f"{peak / 1e6:.2f} MB"])
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    fmt = lambda row: "│ " + " │ ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) + " │"
    lines.append("┌─" + "─┬─".join("─" * w for w in widths) + "─┐")
    lines.append(fmt(table[0]))
    lines.append("├─" + "─┼─".join("─" * w for w in widths) + "─┤")
    lines.extend(fmt(row) for row in table[1:])
    lines.append("└─" + "─┴─".join("─" * w for w in widths) + "─┘")
    med = {label: statistics.median(rows[label]["step_ms"]) for label, _ in CONFIGS}
    full, hybrid = (rows[label] for label in (CONFIGS[0][0], CONFIGS[2][0]))
    fr, hr = (counted(x["report"], x["report"]["steps"])[0] for x in (full, hybrid))
    (f, fp), (h, hp) = ((med[CONFIGS[i][0]], med[CONFIGS[i + 1][0]]) for i in (0, 2))
    lines += ["", f"between the nodes HSDP sends {hr / fr:.3f} of full sharding's bytes (counted), "
              f"{statistics.median(hybrid['link']) / statistics.median(full['link']):.3f} on the link; "
              f"its step takes {h / f:.2f} of full sharding's without overlap, {hp / fp:.2f} with --prefetch "
              f"(--prefetch: {fp / f:.2f} of the blocking step fully sharded, {hp / h:.2f} under HSDP); "
              f"every run's weights digest {digests.pop()} (lesson 01's)"]
    text = "\n".join(lines) + "\n"
    with open(f"{a.out}/hsdp.txt", "w") as f:
        f.write(text)
    print(text, end="")


if __name__ == "__main__":
    main()
