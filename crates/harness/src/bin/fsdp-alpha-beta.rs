//! `fsdp-alpha-beta` (`just alpha-beta`): the α–β model of communication,
//! measured on this machine and checked against the lessons.
//!
//! A message of b bytes costs α + b·β: α the latency of one message, β the
//! time per byte (1/β the bandwidth). An all-gather over N ranks sends N − 1
//! messages of each rank's shard, so it costs (N − 1)(α + b·β). Run under
//! mpirun, this binary
//!
//! 1. times all-gathers of shards from 4 bytes to 4 MiB, fits α and β (α
//!    from the smallest message, β from the largest) and sets the model
//!    beside every measured size;
//! 2. predicts each lesson's time in collectives per step from its
//!    report.json (calls and bytes of each collective) and sets it beside the
//!    time the lesson measured;
//! 3. says how large a unit must be for `--prefetch` to hide its all-gather
//!    behind the previous unit's forward, here and — on paper, from
//!    datasheet figures — on GPUs linked by NVLink or InfiniBand.
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use fsdp_harness::Lesson;
use fsdp_harness::table::{Table, thousands};

const TOOL: Lesson = Lesson {
    package: "fsdp-alpha-beta",
    title: "the α–β model of this machine's MPI, checked against the lessons",
    exercises: 0,
};

#[derive(Debug, Parser)]
struct Args {
    /// report.json files of lesson runs at this world size, to predict.
    reports: Vec<PathBuf>,
    /// Also write what is printed to <DIR>/alpha-beta.txt.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Timed repetitions per message size (after 5 untimed).
    #[arg(long, default_value_t = 41, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    reps: u32,
    /// This machine's single-thread matmul rate in FLOP/s (`fsdp-bench
    /// --peak-only`), for the size of unit that hides its gather.
    #[arg(long, value_name = "FLOPS")]
    matmul_flops: Option<f64>,
}

/// Shard sizes swept, in f32 elements: 4 B to 4 MiB per rank.
const SIZES: [usize; 8] = [1, 16, 256, 1024, 4096, 65_536, 262_144, 1_048_576];

/// On paper: NVIDIA's H100 datasheet, dense bf16 (not measured here).
const H100_BF16_FLOPS: f64 = 989e12;
/// On paper: ranks sharing a unit (one 8-GPU node).
const PAPER_RANKS: u32 = 8;
/// On paper: (link, GB/s per direction from its datasheet, α in µs assumed).
const LINKS: [(&str, f64, f64); 2] =
    [("NVLink 4 (900 GB/s both ways)", 450.0, 5.0), ("InfiniBand NDR (400 Gb/s)", 50.0, 5.0)];

/// When `--prefetch` can hide a unit's all-gather behind the previous unit's
/// forward: the forward costs 2 FLOPs per parameter per token, the gather of P
/// parameters of `bytes` bytes (N − 1)α + (N − 1)/N · P·bytes·β.
struct Hiding {
    alpha: f64,
    beta: f64,
    /// FLOP/s.
    rate: f64,
    bytes: f64,
    ranks: f64,
}

impl Hiding {
    /// Tokens per rank between a unit's gather and its use (per step in the
    /// lessons' unit-major schedule; per micro-batch in FSDP2's) below which
    /// the gather's bandwidth term alone outlasts any unit's forward:
    /// rate · (N − 1)/N · bytes · β / 2.
    fn floor(&self) -> f64 {
        self.rate * (self.ranks - 1.0) / self.ranks * self.bytes * self.beta / 2.0
    }

    /// The fewest parameters a unit needs for 2·P·tokens/rate ≥ the gather,
    /// as a table cell: P ≥ (N − 1)α / (2·tokens/rate − (N − 1)/N · bytes·β).
    fn smallest_unit_cell(&self, tokens: f64) -> String {
        let n = self.ranks;
        let per_param = 2.0 * tokens / self.rate - (n - 1.0) / n * self.bytes * self.beta;
        match per_param > 0.0 {
            true => thousands(((n - 1.0) * self.alpha / per_param) as u64),
            false => "never: bandwidth-bound".into(),
        }
    }
}

fn main() -> std::process::ExitCode {
    fsdp_harness::main(TOOL, |world, lesson| {
        let a: Args = fsdp_harness::parse_args(lesson)?;
        // Everything said goes to stdout on rank 0, and into --out's file.
        let mut text = String::new();
        macro_rules! say {
            ($($arg:tt)*) => {{
                use std::fmt::Write as _;
                writeln!(text, $($arg)*).expect("a String takes any text");
            }};
        }
        let n = world.size();
        anyhow::ensure!(n > 1, "the α–β sweep needs messages between ranks: run it under mpirun with 2 or more ranks");
        // The reports first: a wrong one is refused before the sweep's seconds are spent.
        let mut reports = vec![];
        for path in &a.reports {
            let r: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?,
            )
            .with_context(|| format!("{} is not a report.json", path.display()))?;
            anyhow::ensure!(
                r["world_size"].as_u64() == Some(n as u64),
                "{} ran at {} ranks, the sweep at {n}: run both at one world size",
                path.display(),
                r["world_size"]
            );
            let name: String =
                path.parent().and_then(|p| p.file_name()).map_or("?".into(), |s| s.to_string_lossy().into());
            reports.push((name, r));
        }
        // 1. The sweep: each size's median over the reps, the slowest rank's.
        let mut measured = vec![];
        for &len in &SIZES {
            let mine = vec![1.0f32; len];
            let mut all = vec![0.0f32; len * n];
            let mut times = vec![];
            for rep in 0..a.reps as usize + 5 {
                world.gather_control(&[0u8]); // everyone starts together
                let t0 = Instant::now();
                world.all_gather(&mine, &mut all);
                if rep >= 5 {
                    times.push(t0.elapsed().as_secs_f64());
                }
            }
            times.sort_by(f64::total_cmp);
            let median = times[times.len() / 2];
            measured.push(world.gather_control(&[median]).into_iter().fold(0.0, f64::max));
        }
        let hops = (n - 1) as f64;
        let bytes = |len: usize| (len * 4) as f64;
        // β: the median of the slopes between consecutive sizes from 16 KiB up, where the
        // bytes dominate — one size's hiccup (seen on a shaped TCP link: the 4 MiB gather at
        // half the rate of the others, once) cannot set it. α: what is left of the smallest
        // message (4 bytes), almost all latency.
        let from = SIZES.iter().position(|&l| l * 4 >= 16 << 10).expect("a size of 16 KiB");
        let mut slopes: Vec<f64> = (from..SIZES.len() - 1)
            .map(|i| (measured[i + 1] - measured[i]) / hops / (bytes(SIZES[i + 1]) - bytes(SIZES[i])))
            .collect();
        slopes.sort_by(f64::total_cmp);
        let beta = slopes[slopes.len() / 2];
        let alpha = measured[0] / hops - bytes(SIZES[0]) * beta;
        let model = |b: f64, messages: f64| messages * alpha + b * beta;
        say!(
            "α–β model of MPI on this machine, {n} ranks (all-gathers, median of {} after 5 untimed, the slowest rank's):",
            a.reps
        );
        say!("α = {:.2} µs per message, 1/β = {:.2} GB/s\n", alpha * 1e6, 1e-9 / beta);
        let mut t = Table::new(["shard (bytes)", "measured (µs)", "model (N−1)(α + b·β) (µs)", "model / measured"]);
        for (&len, &m) in SIZES.iter().zip(&measured) {
            let p = model(hops * bytes(len), hops);
            t.row([
                thousands(len as u64 * 4),
                format!("{:.2}", m * 1e6),
                format!("{:.2}", p * 1e6),
                format!("{:.2}", p / m),
            ]);
        }
        say!("{}", t.render());

        // 2. The lessons: calls and bytes per step, predicted against measured.
        if !reports.is_empty() {
            say!(
                "Each lesson's time in collectives per step: the model from its calls and bytes, beside what the run measured inside them and, apart, in the barrier before each (run with FSDP_SYNC_COLLECTIVES=1: waiting for the slower rank):\n"
            );
            let mut t = Table::new([
                "run",
                "collective",
                "calls / step",
                "bytes sent / step",
                "predicted (ms)",
                "measured (ms)",
                "waiting before (ms)",
            ]);
            for (name, r) in &reports {
                // This run's steps (a resumed run's traffic covers only those).
                let steps = r["losses"].as_array().map_or(0, Vec::len) as f64;
                anyhow::ensure!(steps > 0.0, "{name}: its report has no steps");
                let traffic = r["traffic"].as_object().context("traffic")?;
                for (kind, s) in traffic {
                    let calls = s["calls"].as_f64().unwrap_or(0.0) / steps;
                    let sent = s["bytes_sent"].as_f64().unwrap_or(0.0) / steps;
                    if calls == 0.0 {
                        continue;
                    }
                    // The ordered all-reduce is an all-to-all, then an all-gather: two rounds of N − 1 messages.
                    let rounds = if kind == "all_reduce" { 2.0 } else { 1.0 };
                    let predicted = model(sent, calls * rounds * hops);
                    let took = s["seconds"].as_f64().unwrap_or(0.0) / steps;
                    let waited = s["waited_seconds"].as_f64().unwrap_or(0.0) / steps;
                    t.row([
                        name.to_string(),
                        kind.clone(),
                        format!("{calls:.1}"),
                        thousands(sent as u64),
                        format!("{:.3}", predicted * 1e3),
                        format!("{:.3}", took * 1e3),
                        format!("{:.3}", waited * 1e3),
                    ]);
                }
            }
            say!("{}", t.render());
            say!(
                "Times are rank 0's. Under --prefetch the collectives run on the communication stream, with no barrier before them: their time is from their start on the stream's thread to their end, waiting for the other rank included.\n"
            );
        }

        // 3. When does --prefetch hide a unit's all-gather behind the previous unit's forward?
        if let Some(gflops) = a.matmul_flops.map(|f| f / 1e9) {
            say!(
                "--prefetch hides a unit's fp32 all-gather behind the previous unit's forward (2 FLOPs per parameter per token, at this machine's matmul rate, {gflops:.1} GFLOP/s, an upper bound on the model's) when the unit holds at least:\n"
            );
            let mut t = Table::new(["tokens per rank per step", "parameters per unit"]);
            let here = Hiding { alpha, beta, rate: gflops * 1e9, bytes: 4.0, ranks: n as f64 };
            for tokens in [64.0, 256.0, 1024.0, 4096.0] {
                t.row([thousands(tokens as u64), here.smallest_unit_cell(tokens)]);
            }
            let floor = here.floor();
            say!("{}", t.render());
            say!("Bandwidth-bound (no unit hides its gather) below {floor:.1} tokens per rank per step here.\n");
        }
        say!(
            "On paper — datasheet figures, not measured here, and α assumed — the same bound for bf16 units (2 bytes) on NVIDIA H100s ({:.0} TFLOP/s dense bf16), {PAPER_RANKS} ranks:\n",
            H100_BF16_FLOPS / 1e12
        );
        let mut t = Table::new([
            "link",
            "1/β (GB/s, per direction)",
            "α (µs, assumed)",
            "tokens per rank per step",
            "parameters per unit",
        ]);
        let on_paper = |gbs: f64, us: f64| Hiding {
            alpha: us * 1e-6,
            beta: 1e-9 / gbs,
            rate: H100_BF16_FLOPS,
            bytes: 2.0,
            ranks: PAPER_RANKS as f64,
        };
        for (link, gbs, us) in LINKS {
            for tokens in [1024.0, 4096.0, 16_384.0] {
                t.row([
                    link.to_string(),
                    format!("{gbs:.0}"),
                    format!("{us:.0}"),
                    thousands(tokens as u64),
                    on_paper(gbs, us).smallest_unit_cell(tokens),
                ]);
            }
        }
        say!("{}", t.render());
        let [(_, nvlink, us), (_, ib, _)] = LINKS;
        say!(
            "Bandwidth-bound (no unit hides its gather) below {} tokens per rank per step on NVLink, {} on InfiniBand: {}e12 · ({}/{PAPER_RANKS}) · 2 bytes / (2 · bytes/s). Per step in the lessons' schedule, where a unit's forward runs over all of a rank's micro-batches; FSDP2 gathers every unit again for each micro-batch, so for it these are tokens per micro-batch.",
            thousands(on_paper(nvlink, us).floor() as u64),
            thousands(on_paper(ib, us).floor() as u64),
            H100_BF16_FLOPS / 1e12,
            PAPER_RANKS - 1
        );
        if world.is_root() {
            print!("{text}");
            if let Some(dir) = &a.out {
                std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
                std::fs::write(dir.join("alpha-beta.txt"), &text)?;
                // The fit, for other tools (`fsdp-overlap` predicts from it).
                let fit = serde_json::json!({"ranks": n, "alpha_seconds": alpha, "beta_seconds_per_byte": beta,
                    "sizes_bytes": SIZES.iter().map(|l| l * 4).collect::<Vec<_>>(), "measured_seconds": measured});
                std::fs::write(dir.join("alpha-beta.json"), serde_json::to_string_pretty(&fit)?)?;
            }
        }
        Ok(())
    })
}
