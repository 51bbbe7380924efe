//! The end-of-run report: memory per rank computed from shapes beside the
//! heap the counting allocator measured, bytes on the wire beside the
//! theoretical count, the final loss and a digest of the final weights; the
//! same as JSON, plus the loss curve and the weights on disk.
use anyhow::Context;
use fsdp_comm::{Collective, World};
use serde_json::{Value, json};

use crate::memory_tally::MemoryTally;
use crate::plot::{Chart, Series};
use crate::run::Run;
use crate::session::Session;
use crate::table::{Table, mb_measured, thousands};

/// One communicator's traffic (a name like "shard group (2 ranks)") and
/// the bytes per step its theory gives, by kind.
struct CommTraffic {
    name: String,
    traffic: fsdp_comm::Traffic,
    theory: Vec<(Collective, u64)>,
}

/// Collects what a lesson wants reported, then prints and writes it all.
pub struct Report<'a, 'w> {
    session: &'a Session<'w>,
    run: &'a Run,
    tally: MemoryTally,
    tables: Vec<String>,
    expected: Vec<(Collective, u64)>,
    json: serde_json::Map<String, Value>,
    charts: Vec<(String, Vec<Chart>)>,
    traffic: Option<fsdp_comm::Traffic>,
    /// Under HSDP: the traffic of each communicator, with its theory.
    comms: Vec<CommTraffic>,
}

impl<'a, 'w> Report<'a, 'w> {
    pub fn new(session: &'a Session<'w>, run: &'a Run, mut tally: MemoryTally) -> Self {
        let trace = session.world.trace().heap_bytes();
        if trace > 0 {
            tally.apart("--trace: its spans", trace, 1, "storage allocated when training began");
        }
        Self {
            session,
            run,
            tally,
            tables: vec![],
            expected: vec![],
            json: Default::default(),
            charts: vec![],
            traffic: None,
            comms: vec![],
        }
    }

    /// The theoretical bytes each rank must send per step for `kind`, shown
    /// beside what was counted.
    pub fn expect_traffic(&mut self, kind: Collective, bytes_per_step: u64) -> &mut Self {
        self.expected.push((kind, bytes_per_step));
        self
    }

    /// [`Report::expect_traffic`] when there is an expectation (a flag that is on).
    pub fn expect_traffic_if(&mut self, kind: Collective, bytes_per_step: Option<u64>) -> &mut Self {
        if let Some(b) = bytes_per_step {
            self.expected.push((kind, b));
        }
        self
    }

    /// Report this traffic instead of the world's at `finish` — e.g. taken
    /// before a final gather that is not part of training.
    pub fn traffic(&mut self, traffic: fsdp_comm::Traffic) -> &mut Self {
        self.traffic = Some(traffic);
        self
    }

    /// One communicator's share of the traffic (HSDP's shard and replica
    /// groups), with the bytes per step its theory gives by kind: printed
    /// as a table of its own after the totals, and kept in report.json.
    pub fn comm_traffic(
        &mut self,
        name: String,
        traffic: fsdp_comm::Traffic,
        theory: Vec<(Collective, u64)>,
    ) -> &mut Self {
        self.comms.push(CommTraffic { name, traffic, theory });
        self
    }

    /// A lesson's own table, printed before the memory tally.
    pub fn table(&mut self, rendered: String) -> &mut Self {
        self.tables.push(rendered);
        self
    }

    /// An extra field of report.json.
    pub fn json(&mut self, key: &str, value: Value) -> &mut Self {
        self.json.insert(key.into(), value);
        self
    }

    /// An extra SVG figure under `--out`.
    pub fn chart(&mut self, file: &str, charts: Vec<Chart>) -> &mut Self {
        self.charts.push((file.into(), charts));
        self
    }

    /// Prints the report on rank 0 and writes report.json, loss.svg, the
    /// figures and (when `final_params` is given on rank 0) weights.safetensors.
    /// Collective: every rank calls it.
    pub fn finish(self, final_params: Option<&[f32]>) -> anyhow::Result<()> {
        crate::stop::while_writing(|| self.finish_writing(final_params))
    }

    fn finish_writing(self, final_params: Option<&[f32]>) -> anyhow::Result<()> {
        let s = self.session;
        let w: &World = s.world;
        let r = self.run;
        // Taken when training finished (before this report gathered the final weights).
        let training_peak = if r.training_peak > 0 { r.training_peak } else { crate::alloc::peak_bytes() };
        let peak = w.gather_control(&[training_peak as u64]);
        let base = w.gather_control(&[r.baseline_live as u64]);
        let setup = w.gather_control(&[r.setup_peak as u64]);
        let kept = w.gather_control(&[r.final_live as u64]);
        let rss = w.gather_control(&[crate::alloc::peak_rss_bytes().unwrap_or(0) as u64]);
        let traffic = self.traffic.clone().unwrap_or_else(|| w.traffic());
        // Across machines: every rank's bytes to ranks on other nodes, and its node.
        let remote: u64 = traffic.stats.iter().map(|t| t.bytes_remote).sum();
        let remote_by_rank = w.gather_control(&[remote]);
        let nodes = w.nodes().iter().copied().max().map_or(1, |m| m + 1);
        let traces = s.args.trace.as_ref().and_then(|_| crate::trace_files::gather(w));
        if !w.is_root() {
            return Ok(());
        }
        for t in &self.tables {
            println!("{t}");
        }
        println!("{}", self.tally.table().render());
        // Measured numbers vary a little from run to run: they get their own
        // table, so the tally from shapes above stays exactly reproducible.
        let mut m = Table::new(
            std::iter::once("measured, per rank".to_string())
                .chain((0..w.size()).map(|r| format!("rank {r}")))
                .chain(["tally (from shapes)".to_string()]),
        );
        let row = |label: &str, v: &[u64], tally: Option<u64>| {
            std::iter::once(label.to_string())
                .chain(v.iter().map(|&b| mb_measured(b)))
                .chain([tally.map_or("—".to_string(), mb_measured)])
                .collect::<Vec<_>>()
        };
        let (kept_tally, expected) =
            (self.tally.kept_bytes() + self.tally.apart_bytes(), self.tally.expected_peak_bytes());
        m.row(row("peak live heap while setting up", &setup, None));
        m.row(row("live heap as training began", &base, None));
        m.row(row("live heap when training ended", &kept, Some(kept_tally)));
        m.row(row("peak live heap while training", &peak, Some(expected)));
        m.row(
            std::iter::once("measured peak heap / tally's peak".to_string())
                .chain(peak.iter().map(|&p| format!("{:.3}", p as f64 / expected as f64)))
                .chain(["—".to_string()])
                .collect::<Vec<_>>(),
        );
        m.row(row("peak RSS (incl. MPI, code)", &rss, None));
        println!("{}", m.render());

        let steps = self.run.losses.len().max(1) as u64; // trained in this run (fewer after --resume)
        let across = nodes > 1; // a column for the bytes between machines
        let mut head = vec!["collective (per step, per rank)", "calls", "bytes sent", "theory"];
        if across {
            head.push("to other nodes");
        }
        let mut tt = Table::new(head);
        let mut secs = vec![];
        for kind in Collective::ALL {
            let st = traffic.get(kind);
            if st.calls == 0 || kind == Collective::Control {
                continue;
            }
            let theory =
                self.expected.iter().find(|(k, _)| *k == kind).map_or("—".to_string(), |(_, b)| thousands(*b));
            let mut row = vec![
                kind.name().to_string(),
                format!("{:.1}", st.calls as f64 / steps as f64),
                thousands(st.bytes_sent / steps),
                theory,
            ];
            if across {
                row.push(thousands(st.bytes_remote / steps));
            }
            tt.row(row);
            secs.push(format!("{} {:.2} ms", kind.name(), st.seconds / steps as f64 * 1e3));
        }
        if !secs.is_empty() {
            println!("{}", tt.render());
            println!("measured time in collectives per step: {}", secs.join(", "));
            let ms = |x: f64| x / steps as f64 * 1e3;
            let (all, exposed) = (traffic.seconds(), traffic.exposed());
            if !self.comms.is_empty() {
                let mut head = vec!["communicator", "collective", "calls", "bytes sent", "theory"];
                if across {
                    head.push("to other nodes");
                }
                let mut g = Table::new(head);
                for CommTraffic { name, traffic: t, theory } in &self.comms {
                    for kind in Collective::ALL {
                        let st = t.get(kind);
                        if st.calls == 0 || kind == Collective::Control {
                            continue;
                        }
                        let th =
                            theory.iter().find(|(k, _)| *k == kind).map_or("—".to_string(), |(_, b)| thousands(*b));
                        let mut row = vec![
                            name.clone(),
                            kind.name().to_string(),
                            format!("{:.1}", st.calls as f64 / steps as f64),
                            thousands(st.bytes_sent / steps),
                            th,
                        ];
                        if across {
                            row.push(thousands(st.bytes_remote / steps));
                        }
                        g.row(row);
                    }
                }
                println!("by communicator, per step, rank 0 (every rank sends the same):\n{}", g.render());
            }
            if w.stream().is_some() {
                println!(
                    "measured on the communication stream, per step: {:.2} ms in collectives, {:.2} ms of it exposed (the compute thread waited), {:.0}% hidden; the stream's thread used {:.2} ms of CPU and made {} allocations in training",
                    ms(all),
                    ms(exposed),
                    if all > 0.0 { 100.0 * (1.0 - exposed / all).max(0.0) } else { 0.0 },
                    ms(traffic.cpu()),
                    crate::alloc::stream_allocations()
                );
            }
            println!();
        }

        let digest = final_params.map(|p| format!("{:016x}", fsdp_gpt::params::digest_f32(&p[..s.table.numel()])));
        let final_loss = self.run.losses.last().copied().unwrap_or(f32::NAN);
        println!("final loss {final_loss:.6} (ln vocab = {:.4})", (s.cfg.vocab_size as f64).ln());
        if let Some(d) = &digest {
            println!("final weights digest {d}");
        }
        println!(
            "\nmeasured {} tok/s over all ranks (median step {:.1} ms)",
            thousands(self.run.tokens_per_second() as u64),
            self.run.median_step_seconds() * 1e3
        );

        // Files.
        let mut j = json!({
            "lesson": s.lesson.package,
            "world_size": w.size(),
            "preset": s.args.preset,
            "params": s.table.numel(),
            "steps": s.args.steps,
            "first_step": s.first_step,
            "resume_notes": s.resume_notes,
            "tokens_per_step": s.sampler.tokens_per_step(),
            "losses": self.run.losses,
            "grad_norms": self.run.grad_norms,
            "unit_grad_digests": self.run.unit_grad_digests,
            "final_loss": final_loss,
            "tokens_per_second": self.run.tokens_per_second(),
            "median_step_seconds": self.run.median_step_seconds(),
            "step_seconds": self.run.step_seconds,
            "expected_bytes_per_step": self.expected.iter().map(|(k, b)| (k.name().to_string(), json!(b))).collect::<serde_json::Map<_, _>>(),
            "weights_digest": digest,
            "stream_allocations": w.stream().map(|_| crate::alloc::stream_allocations()),
            "tally": self.tally.rows.iter().map(|r| json!({"category": r.category, "elements": r.elems, "bytes": r.bytes(), "note": r.note, "held": format!("{:?}", r.residency).to_lowercase()})).collect::<Vec<_>>(),
            "tally_peak_at": self.tally.peak_at,
            "tally_total_bytes": self.tally.total_bytes(),
            "tally_kept_bytes": self.tally.kept_bytes(),
            "tally_apart_bytes": self.tally.apart_bytes(),
            "tally_expected_peak_bytes": self.tally.expected_peak_bytes(),
            "measured_baseline_bytes": base,
            "measured_peak_bytes": peak,
            "node_of_rank": w.nodes(),
            "bytes_remote_by_rank": remote_by_rank,
            "measured_setup_peak_bytes": setup,
            "measured_final_live_bytes": kept,
            "peak_rss_bytes": rss,
            "traffic": Collective::ALL.iter().map(|k| {
                let st = traffic.get(*k);
                (k.name().to_string(), json!({"calls": st.calls, "bytes_sent": st.bytes_sent, "bytes_remote": st.bytes_remote, "bytes_received": st.bytes_received, "seconds": st.seconds, "waited_seconds": st.waited, "exposed_seconds": st.exposed, "stream_cpu_seconds": st.cpu}))
            }).collect::<serde_json::Map<_, _>>(),
        });
        // The transport's setting between machines that overlap depends on (fsdp_comm::world::TCP_EAGER_LIMIT).
        j["tcp_eager_limit_bytes"] = json!(fsdp_comm::world::tcp_eager_limit());
        if !self.comms.is_empty() {
            let by_group: serde_json::Map<_, _> = self
                .comms
                .iter()
                .map(|CommTraffic { name, traffic: t, theory }| {
                    let kinds: serde_json::Map<_, _> = Collective::ALL
                        .iter()
                        .map(|k| {
                            let st = t.get(*k);
                            let th = theory.iter().find(|(x, _)| x == k).map(|(_, b)| *b);
                            (k.name().to_string(), json!({"calls": st.calls, "bytes_sent": st.bytes_sent, "bytes_remote": st.bytes_remote, "theory_bytes_per_step": th}))
                        })
                        .collect();
                    (name.clone(), Value::Object(kinds))
                })
                .collect();
            j["traffic_by_group"] = Value::Object(by_group);
        }
        if let Value::Object(o) = &mut j {
            o.extend(self.json);
        }
        let write = |name: &str, data: &[u8]| {
            let path = s.out.join(name);
            fsdp_gpt::weights_file::write_atomically(&path, data)
                .with_context(|| format!("cannot write {}", path.display()))
        };
        write("report.json", serde_json::to_string_pretty(&j)?.as_bytes())?;
        let loss = Chart {
            title: format!("{} · {} rank(s)", s.lesson.package, w.size()),
            x_label: "step".into(),
            y_label: "loss".into(),
            series: vec![Series {
                name: "train loss".into(),
                color: "#1f77b4",
                points: points_from(s.first_step, &self.run.losses),
                dashed: false,
            }],
            ..Default::default()
        };
        write("loss.svg", crate::plot::svg(&[loss]).as_bytes())?;
        for (file, charts) in &self.charts {
            write(file, crate::plot::svg(charts).as_bytes())?;
        }
        if let Some(p) = final_params {
            let path = s.out.join("weights.safetensors");
            fsdp_gpt::weights_file::save(&path, &s.cfg, &s.corpus.vocab_string(), &p[..s.table.numel()])?;
        }
        println!(
            "wrote {}/{{report.json, loss.svg{}}}",
            s.out.display(),
            if final_params.is_some() { ", weights.safetensors" } else { "" }
        );
        if let (Some(dir), Some(traces)) = (&s.args.trace, traces) {
            let title = format!("{} · {} rank(s)", s.lesson.package, w.size());
            let names = crate::trace_files::write(dir, &title, &traces)?;
            let dropped: usize = traces.iter().map(|t| t.dropped).sum();
            let note =
                if dropped > 0 { format!(" ({dropped} spans past its capacity not recorded)") } else { String::new() };
            println!("wrote {}/{{{}}}{note}", dir.display(), names.join(", "));
        }
        Ok(())
    }
}

/// `(step, value)` points for a per-step series, steps counted from 1.
pub fn points(values: &[f32]) -> Vec<(f64, f64)> {
    points_from(1, values)
}

/// `(step, value)` points for a per-step series starting at step `first`
/// (a resumed run's first step).
pub fn points_from(first: u64, values: &[f32]) -> Vec<(f64, f64)> {
    values.iter().enumerate().map(|(i, &v)| ((first + i as u64) as f64, v as f64)).collect()
}
