"""What the recipes' scripts share: a lesson run under mpirun, its report read back.

Inside the simulated cluster (scripts/cluster.sh sets FSDP_CLUSTER) a run of more than one rank goes
over the cluster's hostfile, one compute thread per rank on every node; otherwise it runs on this
machine, oversubscribed if it has fewer cores than ranks.
"""
import json
import os
import subprocess
import sys

ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", RAYON_NUM_THREADS="1",
           FSDP_PROGRESS="plain")
CLUSTER = os.environ.get("FSDP_CLUSTER")


def lesson(binary, ranks, flags, out):
    """`target/release/BINARY` at `ranks` ranks with `flags`, writing into `out`: its report.json.
    A run that fails stops the script with its command and the end of its output."""
    where = ["--hostfile", f"{CLUSTER}/hosts", "-x", "RAYON_NUM_THREADS=1"] if CLUSTER and ranks > 1 else ["--oversubscribe"]
    cmd = ["mpirun", "-q", *where, "-n", str(ranks), f"target/release/{binary}", "--out", out, *flags]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=1800)
    if r.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-1500:]}\n{r.stderr[-2500:]}")
    with open(f"{out}/report.json") as f:
        return json.load(f)
