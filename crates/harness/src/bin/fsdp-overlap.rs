//! `fsdp-overlap` (`just overlap` runs it): what overlapping communication
//! with compute bought, configuration by configuration, from runs on one
//! shaped wire — and what the α–β model predicts for each.
//!
//! For every run of ours it reads the ranks' traces (`--trace`): per step, the
//! **compute** (the step's time less the compute thread's waits), the
//! **communication** (every collective's time on the wire), the **exposed**
//! part (the waits: where the step needed a result that was not there) and
//! the share hidden (OSU's overlap: 1 − exposed / communication), on the
//! rank that waited least — the slowest, on the critical path: another
//! rank's extra waits are for it, not for the wire (shown apart). Then it
//! **replays** the step with the wire's model in place of the measured
//! collectives: the same compute between the same events, each collective
//! handed over where it was and waited for where it was, the stream running
//! them one after another, each taking (rounds)·(N − 1)·α + bytes·β. That
//! predicts the exposed time and the step from the fitted α and β and the
//! measured compute alone. PyTorch's runs (DDP, FSDP2) give their step
//! times, on the shaped wire and on an unshaped one.
//!
//! ```text
//! fsdp-overlap --manifest out/overlap/manifest.json --out out/overlap
//! ```
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::Parser;
use fsdp_harness::table::Table;
use serde_json::Value;

#[derive(Debug, Parser)]
#[command(name = "fsdp-overlap", about = "overlap measured against the α–β model, per configuration")]
struct Args {
    /// What was run (written by scripts/overlap.py): the wire, the α–β fit
    /// and every configuration's runs.
    #[arg(long)]
    manifest: PathBuf,
    /// Write overlap.txt and overlap.json here.
    #[arg(long)]
    out: PathBuf,
}

/// One collective of a traced step, on rank 0.
#[derive(Debug, Clone)]
struct Collective {
    kind: String,
    bytes: f64,
    issued: f64,
    start: f64,
    end: f64,
}

/// One traced step of one rank: its collectives by number, its waits
/// (number, from, to), and when its first forward began and its last backward ended.
#[derive(Debug, Default, Clone)]
struct Step {
    ops: BTreeMap<u64, Collective>,
    waits: Vec<(u64, f64, f64)>,
    start: f64,
    end: f64,
    first_forward: f64,
    last_backward: f64,
    /// The block units' forward spans, µs.
    forwards: Vec<f64>,
}

/// The α–β model of one collective: `rounds` rounds of N − 1 messages, and its bytes.
fn predict(c: &Collective, alpha: f64, beta: f64, ranks: f64) -> f64 {
    let rounds = if c.kind == "all_reduce" { 2.0 } else { 1.0 };
    rounds * (ranks - 1.0) * alpha + c.bytes * beta
}

/// The step replayed with modelled collectives: (predicted exposed, predicted step), in µs.
fn replay(s: &Step, model: impl Fn(&Collective) -> f64) -> (f64, f64) {
    // The compute thread's events in time order: hand-overs, then waits.
    let mut events: Vec<(f64, u8, u64)> = s.ops.iter().map(|(&op, c)| (c.issued, 0, op)).collect();
    events.extend(s.waits.iter().map(|&(op, from, _)| (from, 1, op)));
    events.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let wait_end: BTreeMap<u64, f64> = s.waits.iter().map(|&(op, _, to)| (op, to)).collect();
    let (mut sim, mut real, mut free, mut exposed) = (0.0f64, s.start, 0.0f64, 0.0f64);
    let mut done: BTreeMap<u64, f64> = BTreeMap::new();
    for (t, what, op) in events {
        sim += (t - real).max(0.0); // the compute between two events, as measured
        real = t.max(real);
        match what {
            0 => {
                // handed over: it runs when the stream is free, in order
                let start = sim.max(free);
                free = start + model(&s.ops[&op]);
                done.insert(op, free);
            }
            _ => {
                let end = done.get(&op).copied().unwrap_or(sim);
                exposed += (end - sim).max(0.0);
                sim = sim.max(end);
                real = wait_end.get(&op).copied().unwrap_or(real); // the real wait is replaced by the model's
            }
        }
    }
    sim += (s.end - real).max(0.0);
    (exposed, sim)
}

/// Every rank's steps from a trace.json, each from its first span to its last: `[rank][step]`.
fn steps(trace: &Path) -> anyhow::Result<Vec<BTreeMap<u64, Step>>> {
    let v: Value = serde_json::from_str(
        &std::fs::read_to_string(trace).with_context(|| format!("cannot read {}", trace.display()))?,
    )
    .with_context(|| format!("{} is not a trace", trace.display()))?;
    let mut out: Vec<BTreeMap<u64, Step>> = vec![];
    for e in v["traceEvents"].as_array().context("traceEvents")? {
        let Some(rank) = e["pid"].as_u64().map(|r| r as usize) else { continue };
        if e["ph"] != "X" {
            continue;
        }
        while out.len() <= rank {
            out.push(BTreeMap::new());
        }
        let (ts, dur) = (e["ts"].as_f64().unwrap_or(0.0), e["dur"].as_f64().unwrap_or(0.0));
        let args = &e["args"];
        let step = args["step"].as_u64().unwrap_or(0);
        let s = out[rank].entry(step).or_insert_with(|| Step {
            start: f64::INFINITY,
            first_forward: f64::INFINITY,
            ..Default::default()
        });
        s.start = s.start.min(ts);
        s.end = s.end.max(ts + dur);
        let name = e["name"].as_str().unwrap_or("");
        let op = args["op"].as_u64().unwrap_or(0);
        match (e["tid"].as_u64(), op) {
            (Some(2), op) if op > 0 => {
                let kind = name.split_whitespace().next().unwrap_or("").to_string();
                let issued = args["issued_us"].as_f64().unwrap_or(ts);
                let bytes = args["bytes"].as_f64().unwrap_or(0.0);
                s.ops.insert(op, Collective { kind, bytes, issued, start: ts, end: ts + dur });
            }
            (Some(1), op) if op > 0 && name.starts_with("wait") => s.waits.push((op, ts, ts + dur)),
            (Some(1), _) if name.starts_with("forward") => {
                s.first_forward = s.first_forward.min(ts);
                if name.starts_with("forward h.") {
                    s.forwards.push(dur);
                }
            }
            (Some(1), _) if name.contains("backward") && !name.starts_with("forward") => {
                s.last_backward = s.last_backward.max(ts + dur)
            }
            _ => {}
        }
    }
    Ok(out)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| x.is_finite());
    v.sort_by(f64::total_cmp);
    if v.is_empty() { f64::NAN } else { v[v.len() / 2] }
}

/// One configuration of ours, over its runs: medians over every step but each run's first.
#[derive(Debug, Default)]
struct Measured {
    compute: f64,
    comm: f64,
    exposed: f64,
    step: f64,
    model_comm: f64,
    model_exposed: f64,
    model_step: f64,
    /// The exposed part that no schedule of this kind can hide: the first
    /// collective's wait and the last one's, ms.
    ends: f64,
    /// The last collective's time on the wire (DDP: the last bucket), ms.
    last: f64,
    /// Bytes per second over the wire, for the collectives of 100 kB or more.
    rate: f64,
    /// Rank 0's waits beyond the slowest rank's: for that rank, not the wire, ms.
    skew: f64,
}

/// The measures of one traced step of one rank: [compute, comm, exposed, step,
/// model comm, model exposed, model step, first + last wait, last collective, rate].
fn one_step(s: &Step, wall: f64, alpha: f64, beta: f64, ranks: f64) -> [f64; 10] {
    let waits: f64 = s.waits.iter().map(|w| w.2 - w.1).sum::<f64>() / 1e3;
    let comm: f64 = s.ops.values().map(|c| c.end - c.start).sum::<f64>() / 1e3;
    let model = |c: &Collective| predict(c, alpha, beta, ranks) * 1e6;
    let model_comm: f64 = s.ops.values().map(model).sum::<f64>() / 1e3;
    let (model_exposed, model_span) = replay(s, model);
    let span = (s.end - s.start) / 1e3;
    // The step's wall time beyond its traced spans (the end-of-step bookkeeping) is added to the model's too.
    let model_step = model_span / 1e3 + (wall - span).max(0.0);
    // The waits no schedule of this kind can hide: before the first forward
    // (the first units' gathers) and after the last backward (the last
    // reduce-scatters, the last bucket), where there is no compute left.
    let ends: f64 = s
        .waits
        .iter()
        .filter(|w| w.2 <= s.first_forward + 1.0 || w.1 >= s.last_backward - 1.0)
        .filter(|w| s.ops.get(&w.0).is_some_and(|c| c.kind != "control"))
        .map(|w| (w.2 - w.1) / 1e3)
        .sum();
    let big: Vec<&Collective> = s.ops.values().filter(|c| c.bytes >= 1e5).collect();
    let rate = big.iter().map(|c| c.bytes).sum::<f64>() / big.iter().map(|c| (c.end - c.start) / 1e6).sum::<f64>();
    let last = s.ops.values().rfind(|c| c.kind != "control").map_or(0.0, |c| (c.end - c.start) / 1e3);
    [wall - waits, comm, waits, wall, model_comm, model_exposed / 1e3, model_step, ends, last, rate]
}

fn measure(runs: &[PathBuf], alpha: f64, beta: f64) -> anyhow::Result<Measured> {
    let mut rows: Vec<[f64; 10]> = vec![];
    let mut skew = vec![];
    for dir in runs {
        let report: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("report.json"))?)?;
        let ranks = report["world_size"].as_f64().unwrap_or(1.0);
        let seconds: Vec<f64> =
            report["step_seconds"].as_array().context("step_seconds")?.iter().filter_map(Value::as_f64).collect();
        let first = report["first_step"].as_u64().unwrap_or(1);
        let by_rank = steps(&dir.join("trace/trace.json"))?;
        for (&step, _) in by_rank.first().map(|r| r.iter()).into_iter().flatten() {
            let Some(&wall) = seconds.get((step - first) as usize) else { continue };
            if step == first {
                continue; // the warm-up
            }
            // Every rank's view of the step; the one that waited least is the
            // slowest, on the critical path: the others' extra waits are for it,
            // not for the wire.
            let views: Vec<[f64; 10]> = by_rank
                .iter()
                .filter_map(|r| r.get(&step))
                .map(|s| one_step(s, wall * 1e3, alpha, beta, ranks))
                .collect();
            let critical = views.iter().min_by(|a, b| a[2].total_cmp(&b[2])).copied().expect("a rank");
            skew.push(views[0][2] - critical[2]);
            rows.push(critical);
        }
    }
    if rows.is_empty() {
        bail!("no traced steps in {runs:?}: run with --steps 2 or more and --trace");
    }
    let col = |i: usize| median(rows.iter().map(|r| r[i]).collect());
    Ok(Measured {
        compute: col(0),
        comm: col(1),
        exposed: col(2),
        step: col(3),
        model_comm: col(4),
        model_exposed: col(5),
        model_step: col(6),
        ends: col(7),
        last: col(8),
        rate: col(9),
        skew: median(skew),
    })
}

impl Measured {
    /// What the step's schedule can hide, ms: its communication but the
    /// ends — the waits before the first forward and after the last backward
    /// (the first units' gathers, the last reduce-scatters), where no compute
    /// of the step is left to hide behind — and no more than the compute
    /// there is to hide behind: on a wire slower than the compute, the compute.
    fn hideable(&self) -> f64 {
        (self.comm - self.ends).min(self.compute).max(0.0)
    }

    /// The communication hidden, ms (OSU's: the part not exposed).
    fn hidden(&self) -> f64 {
        (self.comm - self.exposed).max(0.0)
    }

    /// The hidden share of what the schedule can hide, %.
    fn of_hideable(&self) -> f64 {
        let h = self.hideable();
        if h > 0.0 { 100.0 * self.hidden() / h } else { f64::NAN }
    }
}

/// PyTorch's median step over its runs' JSON files (every step but the warm-up), ms.
fn torch_step(files: &[PathBuf], warmup: usize) -> anyhow::Result<f64> {
    let mut all = vec![];
    for f in files {
        let v: Value =
            serde_json::from_str(&std::fs::read_to_string(f).with_context(|| format!("cannot read {}", f.display()))?)?;
        all.extend(
            v["step_seconds"]
                .as_array()
                .context("step_seconds")?
                .iter()
                .skip(warmup)
                .filter_map(Value::as_f64)
                .map(|s| s * 1e3),
        );
    }
    Ok(median(all))
}

/// The most a blocking configuration's step could shrink by overlap on its
/// wire: its step over the longer of its compute and its communication.
fn ceiling(blocking: &Measured) -> f64 {
    blocking.step / blocking.compute.max(blocking.comm)
}

fn ms(x: f64) -> String {
    if x.is_finite() { format!("{x:.1}") } else { "—".into() }
}

fn main() -> std::process::ExitCode {
    fsdp_harness::launch::tool_main(|a: Args| {
        let m: Value = serde_json::from_str(
            &std::fs::read_to_string(&a.manifest).with_context(|| format!("cannot read {}", a.manifest.display()))?,
        )
        .context("the manifest is not JSON")?;
        let fit: Value =
            serde_json::from_str(&std::fs::read_to_string(m["alpha_beta"].as_str().context("alpha_beta")?)?)?;
        let (alpha, beta) = (
            fit["alpha_seconds"].as_f64().context("alpha_seconds")?,
            fit["beta_seconds_per_byte"].as_f64().context("beta")?,
        );
        let rate = m["rate_bytes_per_second"].as_f64().context("rate_bytes_per_second")?;
        let warmup = m["torch_warmup"].as_u64().unwrap_or(1) as usize;
        let paths = |v: &Value| -> Vec<PathBuf> {
            v.as_array().map(|a| a.iter().filter_map(Value::as_str).map(PathBuf::from).collect()).unwrap_or_default()
        };
        let mut t = Table::new([
            "configuration",
            "compute",
            "comm",
            "exposed",
            "hidden",
            "rank 0 waits besides",
            "step",
            "model: comm",
            "model: exposed",
            "model: step",
            "step / model",
        ]);
        let mut json_rows = vec![];
        let mut targets = vec![];
        let mut torch_by_group: BTreeMap<String, f64> = BTreeMap::new();
        for r in m["rows"].as_array().context("rows")? {
            if r["kind"] == "torch" {
                let shaped = torch_step(&paths(&r["runs"]), warmup)?;
                let unshaped = torch_step(&paths(&r["unshaped_runs"]), warmup)?;
                torch_by_group.insert(r["group"].as_str().unwrap_or("").into(), shaped);
                let label = r["label"].as_str().unwrap_or("?");
                t.row([
                    format!("{label} (PyTorch)"),
                    format!("≈ {}", ms(unshaped)),
                    "—".into(),
                    format!("≈ {}", ms(shaped - unshaped)),
                    "—".into(),
                    "—".into(),
                    ms(shaped),
                    "—".into(),
                    "—".into(),
                    "—".into(),
                    "—".into(),
                ]);
                json_rows.push(serde_json::json!({"label": label, "kind": "torch", "step_ms": shaped, "unshaped_step_ms": unshaped}));
            }
        }
        let mut sweep = Table::new(["--bucket-mb", "buckets", "compute", "comm", "exposed", "step", "model: step"]);
        let mut blocking_of: BTreeMap<String, Measured> = BTreeMap::new(); // each blocking configuration, measured
        let mut sweep_json = vec![];
        let mut vector_bytes = 0.0;
        let mut unit_bytes: f64 = 0.0;
        let mut ranks = 2.0;
        for r in m["rows"].as_array().context("rows")? {
            if r["kind"] == "torch" {
                continue;
            }
            if r["table"] == "sweep" {
                let runs = paths(&r["runs"]);
                let x = measure(&runs, alpha, beta)?;
                let report: Value = serde_json::from_str(&std::fs::read_to_string(runs[0].join("report.json"))?)?;
                let steps = report["losses"].as_array().map_or(1, Vec::len) as f64;
                let buckets = report["traffic"]["all_reduce"]["calls"].as_f64().unwrap_or(0.0) / steps;
                ranks = report["world_size"].as_f64().unwrap_or(2.0);
                vector_bytes = 4.0 * report["params"].as_f64().unwrap_or(0.0);
                // The largest one-unit bucket: a whole unit is the finest a bucket can be.
                let one_unit = report["buckets"].as_array().into_iter().flatten().filter(|b| b["units"] == 1);
                unit_bytes = one_unit.filter_map(|b| b["elements"].as_f64()).fold(unit_bytes, |m, e| m.max(4.0 * e));
                let mb = r["label"].as_str().unwrap_or("").rsplit(' ').next().unwrap_or("?").to_string();
                sweep.row([
                    mb.clone(),
                    format!("{buckets:.0}"),
                    ms(x.compute),
                    ms(x.comm),
                    ms(x.exposed),
                    ms(x.step),
                    ms(x.model_step),
                ]);
                sweep_json.push(serde_json::json!({"bucket_mb": mb, "buckets": buckets, "step_ms": x.step, "model_step_ms": x.model_step, "exposed_ms": x.exposed}));
                continue;
            }
            let label = r["label"].as_str().unwrap_or("?").to_string();
            let x = measure(&paths(&r["runs"]), alpha, beta)?;
            let hidden = if x.comm > 0.0 { 100.0 * (1.0 - x.exposed / x.comm).max(0.0) } else { 0.0 };
            t.row([
                label.clone(),
                ms(x.compute),
                ms(x.comm),
                ms(x.exposed),
                format!("{hidden:.0}%"),
                ms(x.skew),
                ms(x.step),
                ms(x.model_comm),
                ms(x.model_exposed),
                ms(x.model_step),
                format!("{:.2}", x.step / x.model_step),
            ]);
            let group = r["group"].as_str().unwrap_or("").to_string();
            let overlap = r["overlap"].as_str().unwrap_or("");
            // How much longer the same compute took beside the communication (its blocking twin's first).
            let inflation = r["twin"].as_str().and_then(|t| blocking_of.get(t)).map(|b| x.compute / b.compute);
            let inflated = inflation.map_or(String::new(), |f| {
                format!(
                    "; the compute itself took {f:.2}× its time without overlap: the communication's CPU work — the stream's thread, the kernel's TCP and shaping — shares the rank's one core"
                )
            });
            let check = |ok: bool, what: String, why: String| -> String {
                if ok { format!("✓ {what}") } else { format!("✗ {what}: {why}") }
            };
            let twin = r["twin"].as_str().and_then(|t| blocking_of.get(t));
            if overlap == "fsdp" {
                let share = x.of_hideable();
                targets.push(check(
                    share >= 85.0,
                    format!(
                        "{label} hides {share:.0}% of what its schedule can hide (target ≥ 85%): {:.1} ms of min(comm {:.1} − the ends' {:.1}, compute {:.1}) = {:.1} ms",
                        x.hidden(),
                        x.comm,
                        x.ends,
                        x.compute,
                        x.hideable()
                    ),
                    format!(
                        "{:.1} ms exposed besides the ends (the first units' gathers, the last reduce-scatters, where no compute is left to hide behind)",
                        x.exposed - x.ends
                    ),
                ));
                if let Some(b) = twin {
                    let ratio = b.step / x.step;
                    targets.push(check(
                        ratio >= 1.3,
                        format!(
                            "{label}: {ratio:.2}× its blocking twin's step ({} against {} ms; target ≥ 1.3×)",
                            ms(x.step),
                            ms(b.step)
                        ),
                        format!(
                            "at most {:.2}× on this wire: the twin's compute and communication, {} and {} ms, overlapped perfectly",
                            ceiling(b),
                            ms(b.compute),
                            ms(b.comm)
                        ),
                    ));
                }
                let bound = x.compute.max(x.comm);
                targets.push(check(
                    x.step <= 1.1 * bound,
                    format!("{label}: step {} ms within 1.1× of max(compute, comm) = {} ms", ms(x.step), ms(bound)),
                    format!("{:.2}× it: {} ms exposed{inflated}", x.step / bound, ms(x.exposed)),
                ));
            }
            if overlap == "buckets" {
                let bound = x.compute + x.last;
                targets.push(check(
                    x.step <= 1.1 * bound,
                    format!(
                        "{label}: step {} ms within 1.1× of compute + the last bucket = {} ms",
                        ms(x.step),
                        ms(bound)
                    ),
                    format!(
                        "{:.2}× it: {:.1} ms of its exposed {:.1} ms wait after the backward — the buckets' all-reduces outlast the backward left after the first bucket is complete{inflated}",
                        x.step / bound,
                        x.ends,
                        x.exposed
                    ),
                ));
            }
            if let (Some(theirs), true) = (torch_by_group.get(&group), !overlap.is_empty()) {
                targets.push(check(
                    x.step <= *theirs,
                    format!("{label} ({} ms) at least as fast as {group} ({} ms)", ms(x.step), ms(*theirs)),
                    format!("{:.2}× its step", x.step / theirs),
                ));
            }
            let off = x.step / x.model_step - 1.0;
            targets.push(check(
                off.abs() <= 0.10,
                format!("the model predicts {label}'s step within 10% ({:+.0}%)", 100.0 * off),
                "the model's collectives are the wire's time alone: the measured ones also wait for the other rank and pay the stream's hand-over".into(),
            ));
            json_rows.push(serde_json::json!({
                "label": label, "kind": "ours", "compute_ms": x.compute, "comm_ms": x.comm, "exposed_ms": x.exposed,
                "hidden_percent": hidden, "hideable_ms": x.hideable(), "hidden_of_hideable_percent": x.of_hideable(),
                "step_ms": x.step, "model_comm_ms": x.model_comm, "model_exposed_ms": x.model_exposed,
                "model_step_ms": x.model_step, "wire_bytes_per_second": x.rate,
            }));
            if overlap.is_empty() {
                blocking_of.insert(label, x);
            }
        }
        // The appendix's hiding floor, checked: does a unit's gather fit behind the forward of the unit before it?
        let mut hiding = String::new();
        if let Some(r) = m["rows"].as_array().context("rows")?.iter().find(|r| r["hiding"] == true) {
            let (mut fwd, mut gather) = (vec![], vec![]);
            for dir in paths(&r["runs"]) {
                for s in steps(&dir.join("trace/trace.json"))?.iter().flat_map(|r| r.values()) {
                    fwd.extend(s.forwards.iter().map(|d| d / 1e3));
                    gather.extend(
                        s.ops
                            .values()
                            .filter(|c| c.kind == "all_gather" && c.bytes >= 1e5)
                            .map(|c| (c.end - c.start) / 1e3),
                    );
                }
            }
            let bytes = m["unit_gather_bytes"].as_f64().unwrap_or(0.0);
            let model = (alpha + bytes * beta) * 1e3;
            hiding = format!(
                "The hiding floor, checked (the performance appendix): a block unit's forward takes {} ms here, its all-gather {} ms on the wire ({} ms by the model, α + b·β for its {:.0} kB): {}.\n",
                ms(median(fwd.clone())),
                ms(median(gather.clone())),
                ms(model),
                bytes / 1e3,
                if median(fwd) >= median(gather) {
                    "the forward outlasts the gather, so --prefetch can hide every forward gather but the first"
                } else {
                    "the gather outlasts the forward: the wire, not the compute, sets the pace of the forward under --prefetch"
                }
            );
        }
        let wire = 1.0 / beta;
        let mut text = format!(
            "The wire: {} ({:.1} MB/s each way); the α–β fit on it: α = {:.1} µs, 1/β = {:.1} MB/s ({:.0}% of the shaped rate).\n\n",
            m["rate"].as_str().unwrap_or("?"),
            rate / 1e6,
            alpha * 1e6,
            wire / 1e6,
            100.0 * wire / rate
        );
        targets.insert(
            0,
            format!(
                "{} collectives move their bytes at ≥ 90% of the shaped rate: 1/β = {:.0}% of it",
                if wire >= 0.9 * rate { "✓" } else { "✗" },
                100.0 * wire / rate
            ),
        );
        text += &format!(
            "Per step, ms, on the rank that waited least (the critical path; rank 0's extra waits apart), medians over every step but each run's first, and over the runs:\n{}\n",
            t.render()
        );
        text += &format!("\n{hiding}");
        text += "\nTargets:\n";
        for line in &targets {
            text += &format!("- {line}\n");
        }
        if !sweep_json.is_empty() {
            // CS336's derivation: n buckets of S/n bytes each cost n rounds of latency, and
            // the last one's bytes cannot hide: exposed(n) ≈ n·A + D/n (while the rest hides
            // behind the backward), least at n* = √(D/A).
            let (a_term, d_term) = (2.0 * (ranks - 1.0) * alpha, 2.0 * (ranks - 1.0) / ranks * vector_bytes * beta);
            let n_star = (d_term / a_term).sqrt();
            text += &format!(
                "\nThe bucket-size sweep, lesson 01 ({}; every bucket goes during the last one's backward):\n{}\n",
                match (m["micro_batches"].as_f64().unwrap_or(2.0) / ranks) as usize {
                    1 => "one micro-batch per rank".to_string(),
                    k => format!("{k} micro-batches per rank"),
                },
                sweep.render()
            );
            text += &format!(
                "The α–β optimum (CS336's): n buckets cost n·A of latency, A = 2(N−1)α = {:.0} µs, and the last bucket's bytes, D/n with D = 2(N−1)/N·S·β = {:.1} ms (S = {:.2} MB of gradient), cannot hide: least at n* = √(D/A) = {n_star:.0} buckets of {:.2} MB. Here a bucket is whole units (a block is {:.2} MB), so the sweep cannot go below one unit per bucket.\n",
                a_term * 1e6,
                d_term * 1e3,
                vector_bytes / 1e6,
                vector_bytes / n_star / 1e6,
                unit_bytes / 1e6
            );
        }
        // Each overlapped configuration beside its blocking twin, rate by rate.
        let mut rates_json = vec![];
        if let Some(rows) = m["rate_rows"].as_array().filter(|r| !r.is_empty()) {
            let mut t = Table::new([
                "wire",
                "configuration",
                "blocking step",
                "step",
                "step ratio",
                "at most",
                "compute",
                "comm",
                "exposed",
                "hidden",
                "of what its schedule can hide",
            ]);
            let mut last_rate = "";
            for r in rows {
                let (x, b) =
                    (measure(&paths(&r["runs"]), alpha, beta)?, measure(&paths(&r["twin_runs"]), alpha, beta)?);
                let rate = r["rate"].as_str().unwrap_or("?");
                if !last_rate.is_empty() && rate != last_rate {
                    t.separator();
                }
                last_rate = rate;
                let fsdp = r["overlap"] == "fsdp";
                let share = if fsdp { format!("{:.0}%", x.of_hideable()) } else { "—".into() };
                t.row([
                    rate.to_string(),
                    r["label"].as_str().unwrap_or("?").to_string(),
                    ms(b.step),
                    ms(x.step),
                    format!("{:.2}×", b.step / x.step),
                    format!("{:.2}×", ceiling(&b)),
                    format!("{} ({:.2}×)", ms(x.compute), x.compute / b.compute),
                    ms(x.comm),
                    ms(x.exposed),
                    format!("{:.0}%", 100.0 * x.hidden() / x.comm),
                    share,
                ]);
                rates_json.push(serde_json::json!({
                    "rate": rate, "label": r["label"], "blocking_step_ms": b.step, "step_ms": x.step,
                    "step_ratio": b.step / x.step, "ceiling": ceiling(&b), "comm_ms": x.comm, "exposed_ms": x.exposed,
                    "compute_ms": x.compute, "ends_ms": x.ends, "hideable_ms": x.hideable(),
                    "hidden_of_hideable_percent": fsdp.then(|| x.of_hideable()),
                }));
            }
            text += &format!(
                "\nEvery overlapped configuration beside its blocking twin, at each rate (their runs alternated on that wire), ms as above:\n{}",
                t.render()
            );
            text += "Step ratio: the blocking twin's step over the overlapped one's; at most: the twin's step over the longer of its compute and its communication, what a perfect overlap would give. Compute: the step less its waits, and in brackets against the twin's (the communication's CPU work, the stream's thread and the kernel's TCP, runs on the rank's one core beside it). Hidden: 1 − exposed / comm. Of what its schedule can hide (FSDP2's prefetch): the hidden time over min(comm − the ends, compute), the ends being the waits before the first forward and after the last backward, where no compute of the step is left to hide behind (the first units' gathers, the last reduce-scatters); the buckets' and overlap_comm's collectives start only in the last micro-batch's backward.\n";
        }
        print!("{text}");
        std::fs::create_dir_all(&a.out).with_context(|| format!("cannot create {}", a.out.display()))?;
        std::fs::write(a.out.join("overlap.txt"), &text)?;
        let json = serde_json::json!({"rate": m["rate"], "alpha_seconds": alpha, "beta_seconds_per_byte": beta, "rows": json_rows, "targets": targets, "sweep": sweep_json, "rates": rates_json});
        std::fs::write(a.out.join("overlap.json"), serde_json::to_string_pretty(&json)?)?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(kind: &str, issued: f64) -> Collective {
        Collective { kind: kind.into(), bytes: 1e6, issued, start: issued, end: issued }
    }

    /// The replay: blocking collectives add their model time to the step;
    /// one handed over early hides behind the compute after it, and only
    /// what outlasts that compute is exposed; the stream runs them in order.
    #[test]
    fn the_replay_hides_what_the_compute_covers() {
        let ms = |x: f64| x * 1e3; // µs
        // 10 ms of compute, then a blocking collective, then 10 ms more.
        let blocking = Step {
            ops: [(1, op("all_gather", ms(10.0)))].into(),
            waits: vec![(1, ms(10.0), ms(12.0))],
            start: 0.0,
            end: ms(22.0),
            ..Default::default()
        };
        let (exposed, step) = replay(&blocking, |_| ms(5.0));
        assert_eq!((exposed, step), (ms(5.0), ms(25.0)), "compute 20 ms + the model's 5 ms");
        // Handed over at 0, waited for at 10 ms: 5 ms of model time hides entirely …
        let early = Step {
            ops: [(1, op("all_gather", 0.0))].into(),
            waits: vec![(1, ms(10.0), ms(10.0))],
            start: 0.0,
            end: ms(20.0),
            ..Default::default()
        };
        assert_eq!(replay(&early, |_| ms(5.0)), (0.0, ms(20.0)));
        // … 15 ms shows 5 ms.
        assert_eq!(replay(&early, |_| ms(15.0)), (ms(5.0), ms(25.0)));
        // Two handed over at 0 run one after the other: the second ends at 2 × 6 ms.
        let two = Step {
            ops: [(1, op("all_gather", 0.0)), (2, op("reduce_scatter", 0.0))].into(),
            waits: vec![(1, ms(8.0), ms(8.0)), (2, ms(10.0), ms(10.0))],
            start: 0.0,
            end: ms(10.0),
            ..Default::default()
        };
        assert_eq!(replay(&two, |_| ms(6.0)), (ms(2.0), ms(12.0)));
        // What a schedule can hide: on a fast wire its communication but the ends …
        let fast = Measured { compute: 100.0, comm: 40.0, exposed: 8.0, ends: 6.0, ..Default::default() };
        assert_eq!((fast.hideable(), fast.hidden()), (34.0, 32.0));
        assert!((fast.of_hideable() - 100.0 * 32.0 / 34.0).abs() < 1e-9);
        // … on a slow one no more than the compute: 150 ms on the wire behind 100 of compute.
        let slow = Measured { compute: 100.0, comm: 150.0, exposed: 60.0, ends: 25.0, ..Default::default() };
        assert_eq!((slow.hideable(), slow.of_hideable()), (100.0, 90.0));
        // A perfect overlap of the blocking twin: its step over the longer of the two.
        let twin = Measured { compute: 100.0, comm: 150.0, step: 250.0, ..Default::default() };
        assert_eq!(ceiling(&twin), 250.0 / 150.0);
        // The model of a collective: rounds × (N − 1) × α + bytes × β.
        assert_eq!(predict(&op("all_reduce", 0.0), 1e-5, 1e-8, 2.0), 2e-5 + 1e-2);
        assert_eq!(predict(&op("all_gather", 0.0), 1e-5, 1e-8, 4.0), 3e-5 + 1e-2);
    }
}
