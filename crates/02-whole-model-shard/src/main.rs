//! `step02-whole-model-shard`: the classic FSDP toy — gather the whole model,
//! update only your shard — with its proof of bitwise equality.
//!
//! ```text
//! just step 02            # 2 ranks, --check and the figure on
//! just step 02 4 --steps 100
//! ```

use std::process::ExitCode;

use clap::Parser;
use fsdp_comm::{Collective, nan_max};
use fsdp_harness::config_table::recompute_note;
use fsdp_harness::plot::{Chart, Series};
use fsdp_harness::report::points_from;
use fsdp_harness::table::{Table, mb, sci, thousands};
use fsdp_harness::{Lesson, MemoryTimeline, Report, Session, TrainArgs, print0};
use step02_whole_model_shard::{Reference, WholeModelShard};

const LESSON: Lesson = Lesson {
    package: "step02-whole-model-shard",
    title: "whole-model shard: gather everything, update your shard",
    exercises: 2,
};

#[derive(Debug, Parser)]
struct Args {
    #[command(flatten)]
    train: TrainArgs,
    /// Skip the replicated reference (by default it runs beside the shards,
    /// max |sharded − replicated| is computed every step and printed with
    /// each loss line).
    #[arg(long)]
    no_check: bool,
    /// Skip the two-panel figure (by default written to <out>/shard_vs_replicated.svg).
    #[arg(long)]
    no_plot: bool,
    /// Activation checkpointing: keep only each block's input in forward and
    /// recompute the block just before its backward (less memory, one more
    /// forward, the same bits).
    #[arg(long)]
    recompute: bool,
    /// DDP's buckets for the gradient's all-reduce (lesson 01's --bucket-mb):
    /// buckets of at least this many MB of fp32 gradient, each all-reduced on
    /// a communication thread while my last micro-batch's backward goes on.
    #[arg(long, allow_negative_numbers = true, value_name = "MB", value_parser = fsdp_harness::cli::positive_mb)]
    bucket_mb: Option<f64>,
    /// Exercise 2.2's check: plant a known fault in the replicated reference
    /// (the last parameter, in the last rank's shard, moved by 2⁻¹⁰ after
    /// step 2 and made NaN after step 3), so that --check must report it.
    #[arg(long, hide = true)]
    check_probe: bool,
}

fn main() -> ExitCode {
    fsdp_harness::main(LESSON, |world, lesson| {
        let args: Args = fsdp_harness::parse_args(lesson)?;
        let check = !args.no_check;
        let (s, start) = Session::new(world, lesson, args.train)?;
        let needs = fsdp_harness::exercise::needs(2, 2, check, "with the --check reference: leave out --no-check");
        let probe = match (args.check_probe, check) {
            (true, false) => {
                Err(anyhow::anyhow!("--check-probe plants a fault for --check to find: leave out --no-check"))
            }
            _ => Ok(()),
        };
        fsdp_harness::lesson::agree(world, needs.and(probe))?;
        let bucket_bytes = step01_data_parallel::buckets::cap_bytes(args.bucket_mb);
        if bucket_bytes.is_some() {
            // DDP's buckets go to a communication thread of their own, on every rank.
            s.start_stream()?;
        }
        // My shard, then (--check) lesson 01's whole state beside it, then the step's buffers.
        let shard = WholeModelShard::read_shard(&s, &start)?;
        let mut reference = check.then(|| Reference::new(&s, &start, args.check_probe)).transpose()?;
        let (mut fsdp, mut buckets) = match bucket_bytes {
            Some(cap) => {
                let (fsdp, b) = WholeModelShard::with_buckets(&s, shard, args.recompute, cap);
                (fsdp, Some(b))
            }
            None => (WholeModelShard::from_shard(&s, shard, args.recompute), None),
        };
        let mut rows = vec![
            ("check against replicated", if check { "every step".into() } else { "off (--no-check)".into() }),
            ("activations", recompute_note(args.recompute)),
        ];
        if let Some(b) = &buckets {
            rows.push(("DDP buckets", step01_data_parallel::buckets::describe(b, args.bucket_mb.unwrap_or(0.0))));
        }
        s.print_config(&rows);
        drop(start); // my shard is read: the start's source goes
        let mut run = s.start_training()?; // the clock, a fresh peak; does the state alone fit the budget?
        let (mut ref_losses, mut divergence) = (vec![], vec![]);
        for step in s.steps() {
            let loss = match buckets.as_mut() {
                Some(b) => fsdp.bucketed_step(&s, step, &mut MemoryTimeline::off(), b)?,
                None => fsdp.step(&s, step, &mut MemoryTimeline::off())?,
            };
            // --check, inside the step's time (before its end: a checkpoint, a stop)
            let checked = reference.as_mut().map(|r| r.step(&s, step, &mut fsdp)).transpose()?;
            s.end_step(step, &mut run, loss, || fsdp.checkpoint_pieces(&s))?; // budget, checkpoint, stop
            if let Some((l, d)) = checked {
                ref_losses.push(l);
                divergence.push(d);
                if step == s.first_step || step % s.args.log_every == 0 || step == s.args.steps {
                    print0!("           max |sharded − replicated| = {}", sci(d as f64));
                }
            }
        }
        run.finish();
        let training_traffic = world.traffic(); // before the final gather for the report
        let full = fsdp.gather_full(world).to_vec();

        // The classic toy's results table.
        let l = fsdp.layout;
        let n = l.world;
        let max_div = divergence.iter().copied().fold(0.0f32, nan_max);
        let mut t = Table::new(["whole-model shard", "per rank"]);
        t.row(["world size".to_string(), n.to_string()]);
        t.row(["total params".to_string(), thousands(l.numel as u64)]);
        t.row(["sharded master / rank".to_string(), format!("{} (1/{n})", mb(4 * l.shard_len as u64))]);
        t.row(["replicated master / rank".to_string(), mb(4 * l.numel as u64)]);
        t.row(["padding".to_string(), format!("{} elements", l.padding())]);
        t.row([
            "max |sharded − replicated|".to_string(),
            if check {
                format!("{} over {} steps", sci(max_div as f64), divergence.len())
            } else {
                "not checked (--no-check)".into()
            },
        ]);

        let (shard, nn) = (4 * l.shard_len as u64, n as u64);
        let groups = s.sum_groups.per_rank() as u64; // sum groups of mine: that many reduce-scatters' bytes, one all-gather's
        let mut memory = match &buckets {
            Some(b) => fsdp.bucketed_tally(&s, b),
            None => fsdp.tally(&s),
        };
        if let Some(r) = &reference {
            r.tally_apart(&mut memory, l.numel);
        }
        let mut report = Report::new(&s, &run, memory);
        report
            .traffic(training_traffic)
            .table(t.render())
            .expect_traffic(Collective::AllGather, (nn - 1) * shard)
            .expect_traffic(
                Collective::AllReduce,
                buckets.as_ref().map_or((groups + 1) * (nn - 1) * shard, |b| b.bytes_per_step()),
            )
            .json("max_divergence", serde_json::json!(if check { Some(max_div) } else { None }))
            .json("divergence", serde_json::json!(divergence))
            .json("reference_losses", serde_json::json!(ref_losses))
            .json("master_shard_bytes", serde_json::json!(4 * l.shard_len))
            .json("replicated_master_bytes", serde_json::json!(4 * l.numel));
        if check && !args.no_plot {
            report.chart("shard_vs_replicated.svg", figure(s.first_step, &run.losses, &ref_losses, &divergence, n));
        }
        report.finish(Some(&full))
    })
}

/// Left: the two loss curves, on top of each other. Right: their weights'
/// max difference per step, on an axis centred on zero.
fn figure(first: u64, losses: &[f32], reference: &[f32], divergence: &[f32], n: usize) -> Vec<Chart> {
    vec![
        Chart {
            title: format!("loss: sharded ({n} ranks) vs replicated"),
            x_label: "step".into(),
            y_label: "loss".into(),
            series: vec![
                Series {
                    name: "replicated".into(),
                    color: "#1f77b4",
                    points: points_from(first, reference),
                    dashed: false,
                },
                Series { name: "sharded".into(), color: "#ff7f0e", points: points_from(first, losses), dashed: true },
            ],
            ..Default::default()
        },
        Chart {
            title: "max |sharded − replicated| per step".into(),
            x_label: "step".into(),
            y_label: "max abs difference of weights".into(),
            series: vec![Series {
                name: "divergence".into(),
                color: "#d62728",
                points: points_from(first, divergence),
                dashed: false,
            }],
            y_range: Some((-1e-6, 1e-6)),
            ..Default::default()
        },
    ]
}
