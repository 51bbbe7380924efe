"""`just accumulate`: gradient accumulation four ways (lesson 03's `--accumulate`), side by side.

For each mode (unit-major, reduce-every, no-sync, keep-unsharded) and M/N = 1, 2, 4 micro-batches per rank
at 2 ranks on shared memory (the tiny preset, 8 × 64-token micro-batches): the all-gathers and
reduce-scatters per step (calls, and bytes counted beside the report's theory), the peak heap per rank
(the tally from shapes beside the largest measured), the step time, and whether the final weights'
digest is lesson 01's at the same M (one rank: the pairwise tree gives every power-of-two world its bits).
Every mode runs --reps times, the modes alternating (forward, then backward, then forward …): the step
time is the median over the runs of each run's median step, beside the fastest and slowest run's. At
M/N = --figure-at each mode runs once more, traced, and the figure (fsdp-timeline) draws its third step.
Writes out/accumulate/accumulate.txt and accumulate-timeline.svg; inside the simulated cluster
(`scripts/cluster.sh --nodes 2 --slots 1`, which sets FSDP_CLUSTER) lesson 03's ranks run one per node
across the shaped link, and the two go to accumulate-cluster.txt and accumulate-cluster-timeline.svg.
"""
import argparse
import os
import statistics
import subprocess
import sys

from lesson_run import CLUSTER, lesson as run

MODES = ["unit-major", "reduce-every", "no-sync", "keep-unsharded"]
OUT = "out/accumulate"


def mb(b):
    return f"{b / 1e6:.2f}"


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--per-rank", default="1,2,4", help="micro-batches per rank, comma-separated")
    p.add_argument("--reps", type=int, default=3, help="runs of each mode, alternating")
    p.add_argument("--figure-at", type=int, default=2, help="the M/N whose traces the figure draws")
    p.add_argument("--rate", default="", help="the cluster's link, for the title (inside scripts/cluster.sh)")
    a = p.parse_args()
    per_rank = [int(x) for x in a.per_rank.split(",")]
    if a.reps < 1 or a.figure_at not in per_rank:
        sys.exit(f"error: --reps {a.reps}, --figure-at {a.figure_at}: pass --reps 1 or more, and an M/N of --per-rank")
    shape = ["--steps", str(a.steps), "--log-every", str(a.steps), "--batch-size", "8", "--seq-len", "64"]
    rows, lines = [], []
    figure, busy = [], []
    for k in per_rank:
        m = a.ranks * k
        dp = run("step01-data-parallel", 1, [*shape, "--micro-batches", str(m)], f"{OUT}/dp-{m}")
        runs = {mode: [] for mode in MODES}
        for rep in range(a.reps):
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                runs[mode].append(run("step03-layerwise-shard", a.ranks, [*shape, "--micro-batches", str(m), "--no-plot",
                                                                         "--accumulate", mode], f"{OUT}/{mode}-{k}-{rep}"))
        for mode in MODES:
            reports = runs[mode]
            r = reports[0]
            steps = len(r["losses"])
            t = r["traffic"]
            theory = r["expected_bytes_per_step"]
            cells = [mode, str(k)]
            for kind in ["all_gather", "reduce_scatter"]:
                sent = t[kind]["bytes_sent"] // steps
                cells += [f"{t[kind]['calls'] // steps}", f"{sent:,}", "=" if sent == theory[kind] else f"≠ {theory[kind]:,}"]
            peak = max(r["measured_peak_bytes"])
            # Every run of a mode is the same computation: the same counts, digest and (within noise) heap.
            counts = lambda x: [(x["traffic"][kind]["calls"], x["traffic"][kind]["bytes_sent"]) for kind in t]
            if not all(counts(x) == counts(r) and x["weights_digest"] == r["weights_digest"] for x in reports):
                sys.exit(f"error: the runs of {mode} at M/N = {k} differ in their collectives or their digest")
            ms = sorted(x["median_step_seconds"] * 1e3 for x in reports)
            if ms[-1] > 1.25 * ms[0]:
                busy.append(f"{mode} at M/N = {k}: {ms[0]:.1f} to {ms[-1]:.1f} ms")
            # "heap" on every row: book-verify compares a measured heap within 3%, and masks "ms".
            cells += [f"{mb(r['tally_expected_peak_bytes'])} MB", f"{mb(peak)} MB heap",
                      f"{peak / r['tally_expected_peak_bytes']:.3f}", f"{statistics.median(ms):.1f} ms",
                      f"{ms[0]:.1f} ms – {ms[-1]:.1f} ms",
                      "yes" if r["weights_digest"] == dp["weights_digest"] else "NO"]
            rows.append(cells)
            if k == a.figure_at:
                # One more run, traced (the trace's buffers would add to the heap the table shows).
                out = f"{OUT}/{mode}-{k}-traced"
                run("step03-layerwise-shard", a.ranks, [*shape, "--micro-batches", str(m), "--no-plot",
                                                        "--accumulate", mode, "--trace", f"{out}/trace"], out)
                figure.append(f"{mode}: {cells[2]} all-gathers, {cells[5]} reduce-scatters a step={out}/trace/trace.json")
    head = ["mode", "M/N", "all-gathers", "bytes", "theory", "reduce-scatters", "bytes", "theory",
            "tally's peak", "measured", "measured/tally", "step", f"{a.reps} runs from – to", "lesson 01's bits"]
    width = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = lambda cells: "| " + " | ".join(str(c).rjust(w) for c, w in zip(cells, width)) + " |"
    on = f"on two simulated nodes, a {a.rate} link between them" if CLUSTER else "on shared memory"
    lines.append(f"lesson 03 at {a.ranks} ranks {on}, tiny preset, 8 × 64-token micro-batches, "
                 f"{a.steps} steps; per step and rank (heap: the largest rank's peak; step: the median of "
                 f"{a.reps} runs' median steps, the modes alternating)")
    lines.append(fmt(head))
    lines.append("|" + "|".join("-" * (w + 2) for w in width) + "|")
    lines += [fmt(r) for r in rows]
    text = "\n".join(lines) + "\n"
    os.makedirs(OUT, exist_ok=True)
    name = f"{OUT}/accumulate{'-cluster' if CLUSTER else ''}"
    with open(f"{name}.txt", "w") as f:
        f.write(text)
    print(text, end="")
    if busy:
        print(f"note: runs of one mode differed by more than 25% ({'; '.join(busy)}): something else was running; "
              "run it again on a quiet machine before reading the times")
    # Step 3 of each mode's traced run, every panel on one time scale.
    subprocess.run(["target/release/fsdp-timeline", "--out", f"{name}-timeline.svg", "--step", str(min(3, a.steps)),
                    *figure], check=True, stdout=subprocess.DEVNULL)
    if any(r[-1] != "yes" or r[4] != "=" or r[7] != "=" for r in rows):
        sys.exit("error: a mode left lesson 01's bits or its theory's bytes")


if __name__ == "__main__":
    main()
