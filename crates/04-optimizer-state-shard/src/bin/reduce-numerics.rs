//! `reduce-numerics DIR`: the runs of `just reduce-dtype` side by side — the
//! same training (ZeRO-3, bf16 compute, the global batch fixed) with the
//! gradients reduced in fp32 and in bf16 (`--reduce-dtype`) at several world
//! sizes: each run's digest, final loss and reduce-scatter bytes, how far the
//! bf16 reduction's weights are from the fp32 one's, and the figure of the
//! two loss curves and their difference.
//!
//! ```text
//! reduce-numerics out/reduce-dtype      # reads DIR/{fp32,bf16}-N/ (report.json, weights.safetensors)
//! ```
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use fsdp_harness::plot::{Chart, Series, svg};
use fsdp_harness::table::{Table, thousands};
use serde_json::Value;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// One run: its report and final fp32 weights.
struct Run {
    report: Value,
    weights: Vec<f32>,
}

fn run() -> anyhow::Result<()> {
    let dir =
        std::env::args().nth(1).map(PathBuf::from).context("usage: reduce-numerics DIR (see `just reduce-dtype`)")?;
    let mut sizes: Vec<usize> = std::fs::read_dir(&dir)
        .with_context(|| format!("cannot read {} (run `just reduce-dtype` first)", dir.display()))?
        .filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("fp32-")?.parse().ok())
        .collect();
    sizes.sort_unstable();
    anyhow::ensure!(!sizes.is_empty(), "no fp32-N runs under {}", dir.display());
    let mut t = Table::new([
        "ranks",
        "fp32 reduction: digest",
        "bf16 reduction: digest",
        "final loss, fp32 / bf16",
        "max |Δw|",
        "RMS Δw / RMS w",
        "reduce-scatter bytes per step, fp32 / bf16",
    ]);
    let mut first: Option<(Run, Run)> = None;
    for &n in &sizes {
        let (a, b) = (load(&dir.join(format!("fp32-{n}")))?, load(&dir.join(format!("bf16-{n}")))?);
        anyhow::ensure!(a.weights.len() == b.weights.len(), "{n} ranks: the two runs' models differ");
        let (mut most, mut sq_d, mut sq_w) = (0f64, 0f64, 0f64);
        for (&x, &y) in a.weights.iter().zip(&b.weights) {
            let d = (x as f64 - y as f64).abs();
            (most, sq_d, sq_w) = (most.max(d), sq_d + d * d, sq_w + (x as f64) * (x as f64));
        }
        let loss = |r: &Run| r.report["losses"].as_array().and_then(|l| l.last()?.as_f64()).unwrap_or(f64::NAN);
        let bytes = |r: &Run| -> u64 {
            let steps = r.report["steps"].as_u64().unwrap_or(1).max(1);
            r.report["traffic"]["reduce_scatter"]["bytes_sent"].as_u64().unwrap_or(0) / steps
        };
        let digest = |r: &Run| r.report["weights_digest"].as_str().unwrap_or("?").to_string();
        t.row([
            n.to_string(),
            digest(&a),
            digest(&b),
            format!("{:.6} / {:.6}", loss(&a), loss(&b)),
            format!("{most:.2e}"),
            format!("{:.2e}", (sq_d / sq_w).sqrt()),
            format!("{} / {}", thousands(bytes(&a)), thousands(bytes(&b))),
        ]);
        first.get_or_insert((a, b));
    }
    let (a, b) = first.expect("at least one world size");
    let steps = a.report["steps"].as_u64().unwrap_or(0);
    println!(
        "ZeRO-3 in bf16 (lesson 04's defaults) on the {} preset, {} tokens per step at every world size, {steps} steps; the gradients reduced in fp32 (the default) and in bf16 (--reduce-dtype bf16); the final weights:",
        a.report["preset"].as_str().unwrap_or("?"),
        thousands(a.report["tokens_per_step"].as_u64().unwrap_or(0)),
    );
    print!("{}", t.render());
    let losses = |r: &Run| -> Vec<f64> {
        r.report["losses"].as_array().map(|l| l.iter().filter_map(Value::as_f64).collect()).unwrap_or_default()
    };
    let (la, lb) = (losses(&a), losses(&b));
    let at = |l: &[f64]| l.iter().enumerate().map(|(i, &v)| ((i + 1) as f64, v)).collect::<Vec<_>>();
    let diff: Vec<(f64, f64)> = la.iter().zip(&lb).enumerate().map(|(i, (x, y))| ((i + 1) as f64, y - x)).collect();
    let charts = [
        Chart {
            title: "mean loss per step".into(),
            x_label: "step".into(),
            y_label: "loss".into(),
            series: vec![
                Series { name: "fp32 reduction".into(), color: "#1f77b4", points: at(&la), dashed: false },
                Series { name: "bf16 reduction".into(), color: "#d62728", points: at(&lb), dashed: true },
            ],
            ..Chart::default()
        },
        Chart {
            title: "bf16 reduction's loss − fp32 reduction's".into(),
            x_label: "step".into(),
            y_label: "loss difference".into(),
            series: vec![Series { name: "difference".into(), color: "#d62728", points: diff, dashed: false }],
            ..Chart::default()
        },
    ];
    let path = dir.join("reduce_dtype.svg");
    std::fs::write(&path, svg(&charts)).with_context(|| format!("cannot write {}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}

fn load(dir: &Path) -> anyhow::Result<Run> {
    let path = dir.join("report.json");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {} (run `just reduce-dtype` first)", path.display()))?;
    let weights = fsdp_gpt::weights_file::load(&dir.join("weights.safetensors"))?;
    Ok(Run { report: serde_json::from_str(&text)?, weights: weights.flat })
}
