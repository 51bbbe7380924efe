//! `fsdp-timeline`: one step of several traced runs (`--trace`), drawn one
//! above the other on one time scale — the book's figures of what overlaps.
//!
//! ```text
//! fsdp-timeline --out fig.svg --step 3 "without=runs/a/trace/trace.json" "with=runs/b/trace/trace.json"
//! ```
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use fsdp_harness::trace_files::{from_chrome, panel};
use fsdp_plot::timeline::timeline_svg;

#[derive(Debug, Parser)]
#[command(name = "fsdp-timeline", about = "one step of traced runs, one above the other, on one time scale")]
struct Args {
    /// The SVG to write.
    #[arg(long)]
    out: PathBuf,
    /// The step to draw (each trace must have it).
    #[arg(long, default_value_t = 2)]
    step: u32,
    /// Panels, top first: TITLE=TRACE (a trace.json that `--trace` wrote).
    #[arg(required = true)]
    panels: Vec<String>,
}

fn main() -> std::process::ExitCode {
    fsdp_harness::launch::tool_main(|a: Args| {
        let mut panels = vec![];
        for p in &a.panels {
            let (title, path) = p.rsplit_once('=').with_context(|| format!("{p}: write a panel as TITLE=TRACE"))?;
            let traces = from_chrome(std::path::Path::new(path))?;
            anyhow::ensure!(
                traces.iter().any(|t| t.spans.iter().any(|s| s.step == a.step)),
                "{path} has no step {}: pick one it traced",
                a.step
            );
            panels.push(panel(title, &traces, a.step));
        }
        // One time scale for all, so that the panels' lengths compare.
        let t1 = panels.iter().map(|p| p.t1).fold(0.0, f64::max);
        panels.iter_mut().for_each(|p| p.t1 = t1);
        std::fs::write(&a.out, timeline_svg(&panels)).with_context(|| format!("cannot write {}", a.out.display()))?;
        println!("wrote {}", a.out.display());
        Ok(())
    })
}
