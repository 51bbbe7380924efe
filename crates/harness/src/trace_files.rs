//! `--trace DIR`: when things happened, per rank. Every rank's spans (its
//! compute thread's work and waits, and each collective with its bytes;
//! see [`fsdp_comm::trace`]) are gathered on rank 0, which writes
//!
//! - `trace-rank<R>.json`, one Chrome trace-event file per rank, and
//!   `trace.json` with every rank (one process each): open either in
//!   <https://ui.perfetto.dev> or chrome://tracing;
//! - `timeline.svg`: the last step on a real time axis, ranks stacked.
use std::path::Path;

use anyhow::Context;
use fsdp_comm::{Lane, Trace, World};
use fsdp_plot::timeline::{Bar, Row, Timeline, timeline_svg};
use serde_json::{Value, json};

/// Checks at setup that the trace's folder can be written (rank 0 makes it
/// and writes a probe; every rank agrees on the outcome, as for any flag).
pub fn check_dir(world: &World, dir: &Path) -> anyhow::Result<()> {
    if !world.is_root() {
        return Ok(());
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create --trace folder {}", dir.display()))?;
    let probe = dir.join(".trace-probe");
    std::fs::write(&probe, b"").with_context(|| format!("cannot write into --trace folder {}", dir.display()))?;
    std::fs::remove_file(&probe).ok();
    Ok(())
}

/// The colour of a span, by what its label says it was.
pub fn color(label: &str) -> &'static str {
    let first = label.split_whitespace().next().unwrap_or("");
    match first {
        "wait" => "#d62728",
        "all_gather" => "#2ca02c",
        "reduce_scatter" => "#9467bd",
        "all_reduce" => "#8c564b",
        "grad_norm" | "control" => "#7f7f7f",
        _ if label.contains("backward") => "#ff7f0e",
        "update" | "AdamW" => "#17becf",
        _ => "#1f77b4", // forward, embed, head …
    }
}

/// The colours' legend, in the order the book explains them.
pub fn legend() -> Vec<(String, &'static str)> {
    [
        ("forward", "forward"),
        ("backward (and recompute)", "backward"),
        ("wait for a collective", "wait"),
        ("AdamW update", "update"),
        ("all-gather", "all_gather"),
        ("reduce-scatter", "reduce_scatter"),
        ("all-reduce", "all_reduce"),
        ("grad norm, control", "control"),
    ]
    .into_iter()
    .map(|(name, label)| (name.to_string(), color(label)))
    .collect()
}

/// Chrome trace events for `trace` as process `rank`.
pub fn chrome_events(trace: &Trace, rank: usize) -> Vec<Value> {
    let mut events = vec![
        json!({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": format!("rank {rank}")}}),
        json!({"ph": "M", "name": "thread_name", "pid": rank, "tid": Lane::Compute as u8, "args": {"name": "compute thread"}}),
        json!({"ph": "M", "name": "thread_name", "pid": rank, "tid": Lane::Comm as u8, "args": {"name": "communication"}}),
    ];
    for s in &trace.spans {
        let mut args = json!({"step": s.step});
        if s.op > 0 {
            args["op"] = json!(s.op);
        }
        if s.lane == Lane::Comm {
            args["bytes"] = json!(s.bytes);
            args["issued_us"] = json!(s.issued_us);
        }
        events.push(json!({
            "name": trace.label(s), "ph": "X", "ts": s.start_us, "dur": s.dur_us,
            "pid": rank, "tid": s.lane as u8, "args": args,
        }));
    }
    events
}

/// Every rank's trace, on rank 0 (`None` elsewhere). Collective.
pub fn gather(world: &World) -> Option<Vec<Trace>> {
    let words = world.trace().to_words();
    let all = world.gather_varying(&words);
    world.is_root().then(|| all.iter().map(|w| Trace::from_words(w)).collect())
}

/// One panel of `traces` (every rank) for `step`: two rows per rank, time
/// in ms from the step's first span.
pub fn panel(title: &str, traces: &[Trace], step: u32) -> Timeline {
    let in_step = |t: &Trace| t.spans.iter().filter(move |s| s.step == step).copied().collect::<Vec<_>>();
    let start = traces.iter().flat_map(in_step).map(|s| s.start_us).fold(f64::INFINITY, f64::min);
    let end = traces.iter().flat_map(in_step).map(|s| s.start_us + s.dur_us).fold(0.0, f64::max);
    let mut rows = vec![];
    for (r, t) in traces.iter().enumerate() {
        for (lane, name) in [(Lane::Compute, "compute"), (Lane::Comm, "comm")] {
            let bars = in_step(t)
                .into_iter()
                .filter(|s| s.lane == lane && s.dur_us >= 1.0) // a wait that did not wait is no bar
                .map(|s| {
                    let label = t.label(&s);
                    let what = match s.bytes {
                        0 => format!("{label}: {:.2} ms", s.dur_us / 1e3),
                        b => format!("{label}: {b} bytes, {:.2} ms", s.dur_us / 1e3),
                    };
                    Bar {
                        start: (s.start_us - start) / 1e3,
                        end: (s.start_us + s.dur_us - start) / 1e3,
                        color: color(label),
                        what,
                        inner: lane == Lane::Compute && label.starts_with("wait"),
                    }
                })
                .collect();
            rows.push(Row { name: format!("rank {r} · {name}"), bars });
        }
    }
    let t1 = if end > start { (end - start) / 1e3 } else { 1.0 };
    Timeline { title: title.to_string(), x_label: format!("ms into step {step}"), t0: 0.0, t1, rows, legend: legend() }
}

/// Every rank's trace back from a `trace.json` this module wrote (for
/// `fsdp-timeline`, which draws several runs on one figure).
pub fn from_chrome(path: &Path) -> anyhow::Result<Vec<Trace>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let v: Value = serde_json::from_str(&text).with_context(|| format!("{} is not a trace", path.display()))?;
    let mut traces: Vec<Trace> = vec![];
    for e in v["traceEvents"].as_array().context("no traceEvents")?.iter().filter(|e| e["ph"] == "X") {
        let rank = e["pid"].as_u64().context("pid")? as usize;
        while traces.len() <= rank {
            traces.push(Trace::default());
        }
        let t = &mut traces[rank];
        let name = e["name"].as_str().unwrap_or("").to_string();
        let label = match t.labels.iter().position(|l| *l == name) {
            Some(i) => i,
            None => {
                t.labels.push(name);
                t.labels.len() - 1
            }
        };
        let args = &e["args"];
        t.spans.push(fsdp_comm::Span {
            lane: if e["tid"].as_u64() == Some(2) { Lane::Comm } else { Lane::Compute },
            label: label as u16,
            start_us: e["ts"].as_f64().unwrap_or(0.0),
            dur_us: e["dur"].as_f64().unwrap_or(0.0),
            bytes: args["bytes"].as_u64().unwrap_or(0),
            step: args["step"].as_u64().unwrap_or(0) as u32,
            op: args["op"].as_u64().unwrap_or(0) as u32,
            issued_us: args["issued_us"].as_f64().unwrap_or(0.0),
        });
    }
    Ok(traces)
}

/// Writes the trace files into `dir` (rank 0, from [`gather`]); returns the names written.
pub fn write(dir: &Path, title: &str, traces: &[Trace]) -> anyhow::Result<Vec<String>> {
    let save = |name: &str, data: &[u8]| {
        let path = dir.join(name);
        fsdp_gpt::weights_file::write_atomically(&path, data)
            .with_context(|| format!("cannot write {}", path.display()))
    };
    let mut names = vec![];
    let mut all = vec![];
    for (r, t) in traces.iter().enumerate() {
        let events = chrome_events(t, r);
        let name = format!("trace-rank{r}.json");
        save(&name, serde_json::to_string(&json!({"traceEvents": events, "displayTimeUnit": "ms"}))?.as_bytes())?;
        names.push(name);
        all.extend(events);
    }
    save("trace.json", serde_json::to_string(&json!({"traceEvents": all, "displayTimeUnit": "ms"}))?.as_bytes())?;
    names.push("trace.json".into());
    if let Some(last) = traces.iter().flat_map(|t| t.spans.iter().map(|s| s.step)).max() {
        save("timeline.svg", timeline_svg(&[panel(title, traces, last)]).as_bytes())?;
        names.push("timeline.svg".into());
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_pick_their_colours() {
        assert_eq!(color("wait all_gather h.1"), color("wait"));
        assert_eq!(color("recompute+backward h.2"), color("backward"));
        assert_eq!(color("forward h.0"), color("embed root"));
        assert_ne!(color("all_gather h.1"), color("reduce_scatter h.1"));
    }
}
