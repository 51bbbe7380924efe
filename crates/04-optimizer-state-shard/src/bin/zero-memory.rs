//! `zero-memory DIR`: the runs of `just zero-memory` side by side — data
//! parallelism and ZeRO-1/2/3 at a scale where model states dominate, each
//! rank's measured peak beside its tally, and the figure of the measured
//! bytes (the ZeRO paper's Figure 1, measured): what a rank keeps from step
//! to step, and what a step adds at its peak.
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use fsdp_harness::plot::{Bars, bars_svg};
use fsdp_harness::table::{Table, mb};
use serde_json::Value;

const SCHEMES: [(&str, &str); 4] =
    [("dp", "data parallel"), ("zero1", "ZeRO-1"), ("zero2", "ZeRO-2"), ("zero3", "ZeRO-3")];

/// Tally rows that are not model states: the activations and the
/// backward's working set, and buffers around them (by category name).
const NOT_MODEL_STATES: [&str; 17] = [
    "activations",
    "backward: other",
    "GradStore",
    "upstream",
    "saved",
    "as a Var",
    "lm_head part",
    "ln_f grads",
    "embedding's backward",
    "wte's whole gradient",
    "wpe's gradient",
    "token ids",
    "widened",
    "tapes waiting",
    "receive buffer",
    "send buffer",
    "training text",
];

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn run() -> anyhow::Result<()> {
    let dir = std::env::args().nth(1).map(PathBuf::from).context("usage: zero-memory DIR (see `just zero-memory`)")?;
    let mut panels = vec![];
    for precision in ["fp32", "bf16"] {
        let mut t = Table::new([
            &format!("{precision}, per rank") as &str,
            "measured peak",
            "tally",
            "measured / tally",
            "kept between steps (measured)",
            "model states in the tally's peak",
        ]);
        let mut bars = vec![];
        for (key, name) in SCHEMES {
            let r = report(&dir.join(format!("{precision}-{key}")))?;
            let num = |k: &str| r[k].as_f64().with_context(|| format!("{key}: no {k} in report.json"));
            let first = |k: &str| r[k][0].as_f64().with_context(|| format!("{key}: no {k} in report.json"));
            let (peak, tally, kept) =
                (first("measured_peak_bytes")?, num("tally_expected_peak_bytes")?, first("measured_final_live_bytes")?);
            let states: f64 = r["tally"]
                .as_array()
                .context("tally rows")?
                .iter()
                .filter(|row| row["held"] != "apart")
                .filter(|row| {
                    let c = row["category"].as_str().unwrap_or("");
                    !NOT_MODEL_STATES.iter().any(|p| c.contains(p))
                })
                .map(|row| row["bytes"].as_f64().unwrap_or(0.0))
                .sum();
            t.row([
                name.to_string(),
                mb(peak as u64),
                mb(tally as u64),
                format!("{:.3}", peak / tally),
                mb(kept as u64),
                format!("{:.0}%", 100.0 * states / num("tally_total_bytes")?),
            ]);
            bars.push((name.to_string(), vec![kept / 1e6, (peak - kept) / 1e6]));
        }
        println!("{}", t.render());
        panels.push(Bars {
            title: format!("{precision} · GPT-2 small body · 4 ranks"),
            y_label: "measured heap per rank, MB".into(),
            segments: vec![
                ("kept from step to step: model states, buffers, data".into(), "#1f77b4"),
                ("added at the step's peak: compute copy, gradients, activations".into(), "#ff7f0e"),
            ],
            bars,
        });
    }
    let path = dir.join("zero_memory.svg");
    std::fs::write(&path, bars_svg(&panels)).with_context(|| format!("cannot write {}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}

fn report(dir: &Path) -> anyhow::Result<Value> {
    let path = dir.join("report.json");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {} (run `just zero-memory` first)", path.display()))?;
    Ok(serde_json::from_str(&text)?)
}
