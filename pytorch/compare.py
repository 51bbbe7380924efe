"""`just compare-pytorch`: the lessons against PyTorch, side by side.

On this machine, in one run, interleaved: each lesson and its PyTorch
counterpart train the same GPT from the same initial weights on the same
batches (tiny preset, one 8 × 64 micro-batch per rank per step), at 1, 2
and 4 ranks, one compute thread per rank, both launched by mpirun. Each
group is run --reps times, alternating the order. Lesson 03 and ZeRO-3,
which compute each block's forward again in the backward, meet FSDP2 twice:
as usually run, and with activation checkpointing on every block (the same
activation policy as theirs). Prints per pair both medians, their ratio
and both peak RSS, with the CPU and its measured matmul rate; writes
compare.md and compare.json under --out.

It checks the math too, and exits with status 3 when a check fails (1
when a run fails):
- every PyTorch run's step-1 mean gradient has the norm the project's model
  computes in one process (to 1e-4, relative): the same gradient, the mean
  over all M micro-batches, at every world size and in every mode;
- PyTorch's mean loss on a lesson's trained weights equals fsdp-eval's to 1e-5;
- PyTorch's DDP trained 20 steps from the same start on the same batches
  follows lesson 01's losses to within 1e-4 (the same math, other kernels).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

GROUPS = [
    # (this project's runs, PyTorch's runs): (label, binary, flags) / (label, mode)
    ([("lesson 01 (data parallel)", "step01-data-parallel", [])], [("DDP", "ddp")]),
    ([("lesson 02 (whole-model shard)", "step02-whole-model-shard", ["--no-check", "--no-plot"])], [("whole-model toy", "toy")]),
    (
        [
            ("lesson 03 (FSDP, per block)", "step03-layerwise-shard", ["--no-plot"]),
            ("ZeRO-3 (lesson 04, fp32)", "step04-optimizer-state-shard", ["--stage", "3", "--precision", "fp32"]),
        ],
        # the second at lesson 03's and ZeRO-3's activation policy (the docstring says why)
        [("FSDP2 fully_shard per block", "fsdp2"), ("FSDP2 per block + activation checkpointing", "fsdp2-ac")],
    ),
]
# Mixed precision, as FSDP trains in practice: lesson 04's defaults (bf16 compute copy, fp32 master,
# sums and AdamW state) against PyTorch's, on both presets.
BF16_GROUPS = [
    (
        [("ZeRO-1 (lesson 04, bf16)", "step04-optimizer-state-shard", ["--stage", "1"])],
        [("DDP + ZeroRedundancyOptimizer, bf16 autocast", "zero1-bf16")],
    ),
    (
        [("ZeRO-3 (lesson 04, bf16)", "step04-optimizer-state-shard", ["--stage", "3"])],
        [
            ("FSDP2 per block, MixedPrecisionPolicy(bf16, fp32)", "fsdp2-bf16"),
            ("FSDP2 per block + activation checkpointing, bf16", "fsdp2-bf16-ac"),
        ],
    ),
]
PRESETS = {"tiny": ["--batch-size", "8", "--seq-len", "64"], "small": ["--batch-size", "8", "--seq-len", "128"]}
# Which bf16 instructions oneDNN chose for torch's bf16 matmul here (its verbose log names the ISA and the kernel).
TORCH_BF16_ISA = """
import torch
torch.set_num_threads(1)
a = torch.randn(256, 256, dtype=torch.bfloat16)
torch.nn.Linear(256, 256).bfloat16()(a @ a)
"""
# torch.matmul on one thread at the shapes fsdp-bench --matmul-only measured (stdin: its rates),
# with the same transposed views, each timed as fsdp-bench times the lessons' kernel: best of 5.
TORCH_RATES = """
import json, sys, time, torch
torch.set_num_threads(1)
out = []
for r in json.load(sys.stdin):
    m, k, n = r["m"], r["k"], r["n"]
    dt = torch.bfloat16 if r["path"].startswith("bf16") else torch.float32
    at, bt = ": gᵀ·x" in r["shape"], ": x·wᵀ" in r["shape"]
    a = torch.randn(k, m, dtype=dt).t() if at else torch.randn(m, k, dtype=dt)
    b = torch.randn(n, k, dtype=dt).t() if bt else torch.randn(k, n, dtype=dt)
    a @ b
    reps = max(1, min(200, int(2e8 / (2 * m * k * n))))
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        best = max(best, reps * 2 * m * k * n / (time.perf_counter() - t0))
    out.append(dict(r, flops=best))
print(json.dumps(out))
"""
# glibc's malloc tuned for PyTorch as the lessons tune it for themselves (fsdp_harness::alloc::keep_freed_memory:
# freed blocks up to 32 MiB stay in the heap), so that neither side pays page faults the other does not.
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
           MALLOC_MMAP_THRESHOLD_=str(32 << 20), MALLOC_TRIM_THRESHOLD_=str(512 << 20))


def sh(cmd, **kw):
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=1800, **kw)
    if r.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return r.stdout


def mpirun(n, *cmd):
    return sh(["mpirun", "-q", "--oversubscribe", "-n", str(n), *cmd])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bin", default="target/release")
    p.add_argument("--python", default=sys.executable, help="the Python with torch")
    p.add_argument("--out", default="out/compare-pytorch")
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="measured steps, after the warm-up")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--isa", choices=["native", "avx2"], default="native",
                   help="avx2: hold both sides to AVX2 on a wider CPU (FSDP_MATMUL=avx2, MKL_ENABLE_INSTRUCTIONS=AVX2, "
                        "ONEDNN_MAX_CPU_ISA=AVX2: bf16 emulated by ours, by oneDNN's AVX2 kernels for torch)")
    p.add_argument("--matmul-only", action="store_true",
                   help="only the matmul table: the lessons' kernel beside torch.matmul, alternated (about a minute)")
    p.add_argument("--presets", default="tiny,small",
                   help="the presets the bf16 pairs run at (the fp32 pairs run at tiny, the first)")
    a = p.parse_args()
    if a.isa == "avx2":
        ENV.update(FSDP_MATMUL="avx2", MKL_ENABLE_INSTRUCTIONS="AVX2", ONEDNN_MAX_CPU_ISA="AVX2")
    here = os.path.dirname(os.path.abspath(__file__))
    os.makedirs(a.out, exist_ok=True)
    if os.path.exists(f"{a.out}/compare.md"):
        os.remove(f"{a.out}/compare.md")  # a failed run must not leave the last one's table to be copied
    # The matmuls, ours and torch's, alternated three times, each shape's best of all: this CPU's clock moves.
    def ours_rates():
        return json.loads(sh([f"{a.bin}/fsdp-bench", "--matmul-only", "--json", "--out", f"{a.out}/bench"]))

    def torch_rates(shapes):
        return json.loads(subprocess.run([a.python, "-c", TORCH_RATES], input=json.dumps(shapes), env=ENV,
                                         capture_output=True, text=True, check=True).stdout)

    def best(old, new):
        return [o if o["flops"] >= n["flops"] else n for o, n in zip(old, new)] if old else new

    machine, theirs = None, None
    for rnd in range(3):
        for side in ("ours", "torch") if rnd % 2 == 0 else ("torch", "ours"):
            if side == "ours":
                got = ours_rates()
                # The highest clock of the rounds: the peak it gives is the most cautious yardstick.
                faster_clock = machine is None or got["fma_peaks"]["mhz"] > machine["fma_peaks"]["mhz"]
                machine = got if machine is None else dict(machine, rates=best(machine["rates"], got["rates"]),
                                                              fma_peaks=(got if faster_clock else machine)["fma_peaks"])
            else:
                m = machine or ours_rates()
                shapes = [r for r in m["rates"] if r["path"] in (m["path"], m["bf16_path"])]
                theirs = best(theirs, torch_rates(shapes))
    torch_version = sh([a.python, "-c", "import torch; print(torch.__version__)"]).strip()
    machine["torch_rates"] = theirs
    machine["torch_matmul_peak_flops"] = next(r["flops"] for r in theirs if r["shape"] == "1024³" and r["path"] == machine["path"])
    # Which bf16 instructions each side multiplies with: ours from fsdp-bench, oneDNN's from its verbose log.
    log = subprocess.run([a.python, "-c", TORCH_BF16_ISA], env=dict(ENV, ONEDNN_VERBOSE="1"), capture_output=True, text=True).stdout
    isa = next((line.split("isa:", 1)[1] for line in log.splitlines() if ",isa:" in line), "?")
    kernels = sorted({f.split(",")[5] for f in log.splitlines() if ",primitive,exec,cpu,matmul," in f} or {"?"})
    machine["torch_bf16"] = f"oneDNN {', '.join(kernels)} ({isa})"
    # Ours from the same rounds as torch's, the path in use: the figure the matmul table shows.
    machine["matmul_peak_flops"] = next(r["flops"] for r in machine["rates"]
                                        if r["shape"] == "1024³" and r["path"] == machine["path"])
    print(f"{machine['cpu']}: single-thread f32 matmul, 1024³: the lessons' kernel {machine['matmul_peak_flops'] / 1e9:.1f} "
          f"GFLOP/s, PyTorch's {machine['torch_matmul_peak_flops'] / 1e9:.1f}; torch {torch_version}; bf16: ours "
          f"{machine['bf16']}, torch {machine['torch_bf16']}")
    if a.matmul_only:
        print("\n" + "\n".join(matmul_lines(machine, a)))
        return
    steps = a.warmup + a.steps
    port = [29700]

    def ours(n, binary, flags, out, preset):
        mpirun(n, f"{a.bin}/{binary}", "--preset", preset, *PRESETS[preset], "--steps", str(steps), "--micro-batches",
               str(n), "--log-every", str(steps), "--out", out, *flags)
        with open(f"{out}/report.json") as f:
            return json.load(f)

    def theirs(n, mode, data, out):
        port[0] += 1
        mpirun(n, a.python, f"{here}/train.py", mode, "--data", data, "--json", f"{out}.json", "--port", str(port[0]))
        with open(f"{out}.json") as f:
            return json.load(f)

    def slug(label):
        return "".join(c if c.isalnum() else "-" for c in label.lower()).strip("-")

    results, norms, decays = [], [], []
    ranks = sorted(int(x) for x in a.ranks.split(","))
    presets = a.presets.split(",")
    for preset in presets:
        groups = [(g, "fp32") for g in GROUPS if preset == presets[0]] + [(g, "bf16") for g in BF16_GROUPS]
        for n in ranks:
            data = f"{a.out}/data-{preset}-{n}"
            sh([f"{a.bin}/fsdp-reference-data", "--preset", preset, *PRESETS[preset], "--out", data, "--steps",
                str(steps), "--micro-batches", str(n)])
            with open(f"{data}/meta.json") as f:
                meta = json.load(f)
            tokens = meta["micro_batches"] * meta["batch_size"] * meta["seq_len"]
            for (mine, torch_runs), precision in groups:
                runs = [("ours", *r) for r in mine] + [("torch", *r) for r in torch_runs]
                got = {r[1]: [] for r in runs}
                for rep in range(a.reps):
                    for side, label, *what in runs if rep % 2 == 0 else runs[::-1]:
                        out = f"{a.out}/runs/{preset}-{n}-{slug(label)}-{rep}"
                        r = ours(n, what[0], what[1], out, preset) if side == "ours" else theirs(n, what[0], data, out)
                        got[label].append(r)
                        if side == "torch":
                            ref = meta["step1_grad_norm"]
                            norms.append((abs(r["step1_grad_norm"] - ref) / ref, n, label, precision, preset))
                            decays.append(r["decayed_elements"] == meta["decayed_elements"])
                        print(f"  {preset}, N = {n}, {label}, run {rep + 1}: median step {median_ms(r, a.warmup):.1f} ms",
                              flush=True)
                for label, *_ in mine:
                    for tlabel, _ in torch_runs:
                        results.append(dict(pair(n, tokens, a.warmup, label, got[label], tlabel, got[tlabel]),
                                            preset=preset, precision=precision))

    # The math. Every PyTorch run's step-1 gradient against the project's …
    worst = lambda xs: max(xs, key=lambda x: float("inf") if x[0] != x[0] else x[0])  # noqa: E731 (a NaN is the worst)
    f32_norms, bf16_norms = [x for x in norms if x[3] == "fp32"], [x for x in norms if x[3] == "bf16"]
    worst_norm, worst_bf16 = worst(f32_norms), worst(bf16_norms)
    # … PyTorch's loss on lesson 01's trained weights (fewest ranks) against fsdp-eval's …
    n0, tiny = ranks[0], presets[0]
    w = f"{a.out}/runs/{tiny}-{n0}-{slug(GROUPS[0][0][0][0])}-0/weights.safetensors"
    ev = json.loads(sh([f"{a.bin}/fsdp-eval", "--weights", w, "--json"]))
    pt = json.loads(sh([a.python, f"{here}/train.py", "eval", "--weights", w, "--corpus", f"{a.out}/data-{tiny}-{n0}/corpus.u32"]))
    eval_diff = abs(ev["mean_loss"] - pt["mean_loss"])
    # … and up to 20 steps of training: lesson 01 against DDP; in bf16, ZeRO-3 against FSDP2 (every preset).
    first = next(r for r in results if r["ranks"] == n0 and r["torch"] == "DDP")
    train_diff, k = first["max_loss_diff_20"], min(20, steps)
    # ZeRO-3 against FSDP2's MixedPrecisionPolicy rounds as the lessons do (a bf16 copy of each module's
    # weights); ZeRO-1 against autocast does not (autocast casts the fp32 weights at each matmul and picks
    # other ops' precision from its op lists), so its first steps are held to a wider bound.
    bf16_pairs = [r for r in results if r["precision"] == "bf16" and "activation checkpointing" not in r["torch"]]
    worst5 = lambda rs: max(rs, key=lambda r: r["max_loss_diff_5"])  # noqa: E731
    policy, autocast = worst5([r for r in bf16_pairs if "autocast" not in r["torch"]]), worst5(
        [r for r in bf16_pairs if "autocast" in r["torch"]])
    last10 = max(r["last10_mean_diff"] for r in bf16_pairs)
    at = lambda r: f"{r['preset']}, {r['ranks']} rank(s)"  # noqa: E731
    checks = [
        (f"step 1's mean gradient, every fp32 PyTorch run ({len(f32_norms)}) against the project's model in one process: "
         f"largest relative difference of its norm {worst_norm[0]:.1e} ({worst_norm[2]} at {worst_norm[1]} rank(s); bound 1e-4)",
         all(rel < 1e-4 for rel, *_ in f32_norms)),
        (f"step 1's mean gradient, every bf16 PyTorch run ({len(bf16_norms)}) against the same fp32 norm: largest relative "
         f"difference {worst_bf16[0]:.1e} ({worst_bf16[2]}, {worst_bf16[4]}, {worst_bf16[1]} rank(s); bound 1e-3, bf16 keeps 8 bits)",
         all(rel < 1e-3 for rel, *_ in bf16_norms)),
        (f"weight decay on the same elements (2-D tensors, nanoGPT's rule) in every PyTorch run", all(decays)),
        (f"mean loss on lesson 01's trained weights, {ev['windows']} windows: fsdp-eval {ev['mean_loss']:.7f}, "
         f"PyTorch {pt['mean_loss']:.7f}, |difference| {eval_diff:.1e} (bound 1e-5)", eval_diff < 1e-5),
        (f"{k} steps from the same start on the same batches, {n0} rank(s): largest |loss difference| lesson 01 vs DDP "
         f"{train_diff:.1e} (bound 1e-4)", train_diff < 1e-4),
        (f"in bf16, every world size and preset, largest |loss difference| over the first 5 steps: ZeRO-3 against "
         f"FSDP2's MixedPrecisionPolicy {policy['max_loss_diff_5']:.1e} ({at(policy)}; bound 5e-3, a third of a bf16 ulp "
         f"near a loss of 3: both round a bf16 copy of the weights, in other places); ZeRO-1 against DDP under autocast "
         f"{autocast['max_loss_diff_5']:.1e} ({at(autocast)}; bound 1.6e-2, one bf16 ulp near a loss of 3: autocast rounds "
         f"the fp32 weights at each matmul instead); largest difference of the last 10 steps' mean loss {last10:.1e} "
         f"(bound 5e-2: they learn alike, as rounding differences compound)",
         policy["max_loss_diff_5"] < 5e-3 and autocast["max_loss_diff_5"] < 1.6e-2 and last10 < 5e-2),
    ]
    md = render(machine, torch_version, a, results, checks)
    with open(f"{a.out}/compare.md", "w") as f:
        f.write(md)
    with open(f"{a.out}/compare.json", "w") as f:
        json.dump({"machine": machine, "torch": torch_version, "pairs": results,
                   "checks": [{"what": c, "ok": ok} for c, ok in checks]}, f, indent=1)
    print()
    print(md)
    if not all(ok for _, ok in checks):
        print("error: a math check failed (above)", file=sys.stderr)
        sys.exit(3)


def median_ms(r, warmup):
    return statistics.median(r["step_seconds"][warmup:]) * 1e3


def pair(n, tokens, warmup, label, ours, tlabel, theirs):
    """One pair at one world size: the median over runs of each run's median step."""
    m_ours = statistics.median(median_ms(r, warmup) for r in ours)
    m_theirs = statistics.median(median_ms(r, warmup) for r in theirs)
    rss = lambda runs: max(max(r["peak_rss_bytes"]) for r in runs) / 2**20  # noqa: E731
    diffs = [abs(x - y) for x, y in zip(ours[0]["losses"], theirs[0]["losses"])] or [float("nan")]
    # The mean of each side's last ten losses: where two roundings have let the trajectories part, whether they learn alike.
    tail = lambda r: statistics.mean(r["losses"][-10:]) if r["losses"] else float("nan")  # noqa: E731
    return {
        "ranks": n, "ours": label, "torch": tlabel,
        "ours_ms": m_ours, "torch_ms": m_theirs,
        "ours_ms_runs": [median_ms(r, warmup) for r in ours], "torch_ms_runs": [median_ms(r, warmup) for r in theirs],
        "ours_tokens_per_s": tokens / m_ours * 1e3, "torch_tokens_per_s": tokens / m_theirs * 1e3,
        "ratio": m_theirs / m_ours,
        "ours_rss_mib": rss(ours), "torch_rss_mib": rss(theirs),
        "max_loss_diff": max(diffs), "max_loss_diff_20": max(diffs[:20]), "max_loss_diff_5": max(diffs[:5]),
        "last10_mean_diff": abs(tail(ours[0]) - tail(theirs[0])),
    }


def render(machine, torch_version, a, results, checks):
    presets = a.presets.split(",")
    shape = lambda p: f"{PRESETS[p][1]} × {PRESETS[p][3]}"  # noqa: E731 (B × T)
    lines = [
        f"Measured by `just compare-pytorch` on {machine['cpu']} (single-thread f32 matmul at 1024³, best of 5 in three alternated rounds: "
        f"{machine['matmul_peak_flops'] / 1e9:.1f} GFLOP/s through the lessons' kernel, "
        f"{machine['torch_matmul_peak_flops'] / 1e9:.1f} through PyTorch's), PyTorch {torch_version} on CPU over gloo; "
        f"one micro-batch per rank per step ({', '.join(f'{p}: {shape(p)} tokens' for p in presets)}), one compute thread per "
        f"rank; median step of {a.steps} after {a.warmup} warm-up steps, the median of {a.reps} interleaved runs per side "
        f"(each run's median in brackets). Above {os.cpu_count()} ranks the machine's {os.cpu_count()} cores are shared "
        f"(oversubscribed).",
        "",
    ]
    runs = lambda ms: ", ".join(f"{x:.0f}" for x in ms)  # noqa: E731
    for precision, title in [("fp32", f"fp32, {presets[0]} preset"),
                             ("bf16", f"Mixed precision (bf16 compute, fp32 master and AdamW state; bf16 multiplied "
                                      f"here by {machine['bf16']}, PyTorch's by {machine['torch_bf16']})")]:
        rows = [r for r in results if r["precision"] == precision]
        if not rows:
            continue
        lines += [f"**{title}**", "",
                  "| preset | ranks | this project | tokens/s | PyTorch | tokens/s | speed ratio | peak RSS / rank (MiB) | largest loss difference |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(
                f"| {r['preset']} | {r['ranks']} | {r['ours']} | {r['ours_tokens_per_s']:,.0f} ({runs(r['ours_ms_runs'])} ms) "
                f"| {r['torch']} | {r['torch_tokens_per_s']:,.0f} ({runs(r['torch_ms_runs'])} ms) "
                f"| {r['ratio']:.2f}× | {r['ours_rss_mib']:.0f} vs {r['torch_rss_mib']:.0f} | {r['max_loss_diff']:.1e} |"
            )
        lines.append("")
    lines += ["Speed ratio: PyTorch's median step time over this project's (above 1: this project is faster).", ""]
    lines += matmul_lines(machine, a)
    lines += [f"- {'✓' if ok else '✗'} {c}" for c, ok in checks]
    return "\n".join(lines) + "\n"


def matmul_lines(machine, a):
    """The matmul tables: fp32 through every path of the lessons' kernel, then bf16 through every route,
    each beside torch.matmul in that dtype, shape by shape."""
    order = ["avx512", "avx2", "portable"]
    f32 = sorted({r["path"] for r in machine["rates"] if r["path"] in order}, key=order.index)
    bf16 = [p for p in dict.fromkeys(r["path"] for r in machine["rates"]) if p.startswith("bf16")]
    peaks = machine.get("instruction_peaks", {})
    lines = [
        f"The matmul on one thread, GFLOP/s (best of 5, the best of three alternated rounds): the lessons' kernel through every path this CPU runs, "
        f"torch.matmul ({'MKL held to AVX2' if a.isa == 'avx2' else 'MKL, its own choice of path'} in fp32, "
        f"{machine['torch_bf16']} in bf16) beside the one in use "
        f"({machine['path']}, {machine['bf16_path']}); the CPU's FMA peak at the highest clock measured after each round's rates "
        f"({machine['fma_peaks']['mhz']:,.0f} MHz, by a chain of dependent additions; /proc/cpuinfo says "
        f"{machine['fma_peaks'].get('cpuinfo_mhz', 0):,.0f}): "
        + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in machine["fma_peaks"]["peaks"].items())
        + "; the instructions' own peaks, measured (independent chains, nothing else): "
        + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in peaks.items()) + ".",
        "",
    ]
    for paths, in_use in [(f32, machine["path"]), (bf16, machine["bf16_path"])]:
        if not paths:
            continue
        lines += ["| product | M × K × N | " + " | ".join(f"ours, {p}" for p in paths) + " | torch.matmul | ours / torch |",
                  "|---|---|" + "---|" * len(paths) + "---|---|"]
        for t in [t for t in machine["torch_rates"] if t["path"] == in_use]:
            ours = {r["path"]: r["flops"] for r in machine["rates"] if r["shape"] == t["shape"]}
            lines.append(
                f"| {t['shape']} | {t['m']} × {t['k']} × {t['n']} | "
                + " | ".join(f"{ours[p] / 1e9:.1f}" for p in paths)
                + f" | {t['flops'] / 1e9:.1f} | {ours[in_use] / t['flops']:.2f}× |"
            )
        lines.append("")
    return lines


if __name__ == "__main__":
    main()
