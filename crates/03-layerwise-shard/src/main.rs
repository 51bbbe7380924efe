//! `step03-layerwise-shard`: real FSDP — gather one unit just in time, free
//! it, re-gather in backward, reduce-scatter its gradient.
//!
//! ```text
//! just step 03                      # 2 ranks: tally, unsharded peak, memory timeline
//! just step 03 4 --prefetch         # the next two units' all-gathers overlap compute
//! just step 03 2 --prefetch --prefetch-depth 1   # only the next unit's
//! just step 03 2 --blocks-per-unit 2 --check
//! just step 03 2 --accumulate no-sync   # micro-batch after micro-batch, one reduce-scatter per unit at the end
//! ```

use std::process::ExitCode;

use anyhow::anyhow;
use clap::Parser;
use fsdp_comm::{ReduceDtype, nan_max};
use fsdp_harness::plot::Chart;
use fsdp_harness::table::{Table, mb, mb_measured, sci};
use fsdp_harness::{Lesson, MemoryTimeline, Report, Session, TrainArgs, exercise, print0};
use step02_whole_model_shard::WholeModelShard;
use step03_layerwise_shard::accumulate::{self, Accumulate, calls_per_step};
use step03_layerwise_shard::mixed_precision::MixedPrecision;
use step03_layerwise_shard::prefetch::{Prefetch, prefetch_within_budget, reduce_on_stream};
use step03_layerwise_shard::tally::{reserve_receive_buffers, units_json, unsharded_peak_table};
use step03_layerwise_shard::units::build_units;
use step03_layerwise_shard::{HeadGrad, LayerwiseShard, hsdp, schedule};
use step03_layerwise_shard::{describe_reduce, reduce_flag};

const LESSON: Lesson =
    Lesson { package: "step03-layerwise-shard", title: "layer-wise shard: one unit unsharded at a time", exercises: 3 };

#[derive(Debug, Parser)]
struct Args {
    #[command(flatten)]
    train: TrainArgs,
    /// Start the next units' all-gathers (non-blocking, on a communication
    /// thread) while computing this one, and reduce-scatter there: FSDP2's
    /// overlap. Two entries ahead, or one where two would pass --mem-budget.
    #[arg(long)]
    prefetch: bool,
    /// With --prefetch: gather the units of the next K entries of the
    /// schedule ahead (default 2; FSDP2 prefetches 1 implicitly, more on
    /// request): the wire stays busy where a unit computes for longer than
    /// the next gather takes, for K more units unsharded (the tally counts them).
    #[arg(long, allow_negative_numbers = true, value_name = "K")]
    prefetch_depth: Option<usize>,
    /// Transformer blocks per FSDP unit (in PyTorch, the modules fully_shard wraps): more blocks,
    /// fewer and larger gathers, a higher unsharded peak.
    #[arg(long, allow_negative_numbers = true, default_value_t = 1, value_name = "K")]
    blocks_per_unit: usize,
    /// Where the tied wte's lm_head gradient waits for its embedding part:
    /// keep it, (V, C) per micro-batch, or recompute the head at the end
    /// from its input, (B, T, C) per micro-batch. Default: whichever gives
    /// the lower peak by the tally.
    #[arg(long, value_name = "keep|recompute")]
    head_grad: Option<HeadGrad>,
    /// Run lesson 02 (bitwise lesson 01) beside, compare the weights every
    /// step (report.json keeps each step's max |layer-wise − whole-model|;
    /// the log lines print it).
    #[arg(long)]
    check: bool,
    /// Skip the memory timeline (by default <out>/memory_timeline.svg: one
    /// step of lesson 02 against one step of lesson 03, same model, same batch).
    #[arg(long)]
    no_plot: bool,
    /// Record each unit's gradient digest (rank 0's shard) every step in
    /// report.json: what the exercise checks compare, to name the first
    /// unit whose gradient differs.
    #[arg(long)]
    unit_digests: bool,
    /// Hybrid sharding (HSDP, FSDP2's 2-D mesh): shard each unit within
    /// groups of S consecutive ranks, replicate across the N/S groups — an
    /// all-gather and reduce-scatter inside the group, then each gradient
    /// shard all-reduced across the groups. S = N is plain FSDP.
    #[arg(long, allow_negative_numbers = true, value_name = "S")]
    hsdp: Option<usize>,
    /// The dtype gradients are summed and reduce-scattered in (FSDP2's
    /// `MixedPrecisionPolicy.reduce_dtype`): fp32, or bf16 — half the
    /// reduce-scatter's bytes, every sum of the fixed pairwise tree rounded
    /// to bf16 (a micro-batch's gradient, each addition on a rank or across
    /// ranks), so the bits still do not depend on the world size.
    #[arg(long, default_value = "fp32", value_parser = |s: &str| s.parse::<ReduceDtype>())]
    reduce_dtype: ReduceDtype,
    /// How my micro-batches go through the units: unit-major (all of them
    /// through each unit together), or one after another, each unit's
    /// gradient reduce-scattered after every micro-batch (reduce-every), or
    /// summed unsharded and reduce-scattered after the last (no-sync), with
    /// every unit also kept unsharded between them (keep-unsharded).
    #[arg(long, default_value = "unit-major", value_name = "MODE", value_parser = |s: &str| s.parse::<Accumulate>())]
    accumulate: Accumulate,
}

fn main() -> ExitCode {
    fsdp_harness::main(LESSON, |world, lesson| {
        let args: Args = fsdp_harness::parse_args(lesson)?;
        let (mut s, start) = Session::with_flags(world, lesson, args.train, &reduce_flag(args.reduce_dtype))?;
        s.reduce_dtype = args.reduce_dtype;
        let check = match (args.check, args.reduce_dtype) {
            (true, ReduceDtype::Bf16) => Err(anyhow!(
                "--check compares against lesson 02, which reduces in fp32: leave out --check, or --reduce-dtype bf16"
            )),
            _ => Ok(()),
        };
        fsdp_harness::lesson::agree(world, check)?;
        let clip = s.args.grad_clip.is_some();
        fsdp_harness::lesson::agree(world, exercise::needs(3, 2, clip, "under --grad-clip: add --grad-clip 0.5"))?;
        let layers = s.cfg.n_layer;
        let blocks_per_unit = args.blocks_per_unit;
        fsdp_harness::lesson::agree(
            world,
            match blocks_per_unit {
                0 => Err(anyhow!("--blocks-per-unit 0: a unit needs at least one block (pass 1 to {layers})")),
                blocks_per_unit if blocks_per_unit > layers => Err(anyhow!(
                    "--blocks-per-unit {blocks_per_unit} exceeds the {} preset's {layers} blocks: pass 1 to {layers}",
                    s.args.preset
                )),
                _ => Ok(()),
            },
        )?;
        hsdp::check(&s, args.hsdp)?;
        let no_sync = matches!(args.accumulate, Accumulate::NoSync | Accumulate::KeepUnsharded);
        fsdp_harness::lesson::agree(
            world,
            exercise::needs(3, 3, no_sync, "under --accumulate no-sync (its hand-off)"),
        )?;
        let refused = args.accumulate.refusal(args.prefetch, args.hsdp.is_some(), args.check, args.head_grad);
        fsdp_harness::lesson::agree(world, refused.map_or(Ok(()), Err))?;
        let block_units = layers.div_ceil(blocks_per_unit); // 1 to `layers` (checked above)
        let asked = step03_layerwise_shard::prefetch::prefetch_depth(args.prefetch, args.prefetch_depth, block_units);
        let asked = fsdp_harness::lesson::agree(world, asked)?;
        if args.prefetch {
            // FSDP2's streams: a communication thread of its own, started on every rank together.
            s.start_stream()?;
        }
        // My shard of every unit, cut from the seed's weights (or the checkpoint's).
        // The communicators, split once (under --hsdp the mesh), every rank together.
        let comms = hsdp::unit_comms(world, args.hsdp);
        let mut units = build_units(&s, blocks_per_unit, &start, comms, true, MixedPrecision::default())?;
        if args.prefetch {
            reduce_on_stream(&mut units); // FSDP2's reduce-scatter stream
        }
        let unit_names: Vec<&str> = units.iter().map(|u| u.name()).collect();
        let head_grad = args.accumulate.head_grad(args.head_grad);
        let (prefetch, head_grad) = prefetch_within_budget(&s, &units, asked, head_grad); // the same on every rank
        let mut config = vec![
            ("FSDP units", format!("{} ({})", units.len(), unit_names.join(", "))),
            ("prefetch", step03_layerwise_shard::prefetch::describe_prefetch(prefetch, asked)),
            ("sharding", hsdp::describe(world.size(), args.hsdp)),
            ("gradient reduce dtype", describe_reduce(args.reduce_dtype)),
            ("tied wte's gradient", head_grad.describe(s.micro_batch_shape(), s.cfg.n_embd, s.cfg.vocab_size)),
            (
                "check against lesson 02",
                if args.check { "every step".into() } else { "off (--check turns it on)".into() },
            ),
        ];
        config.extend(args.accumulate.config_row());
        s.print_config(&config);

        reserve_receive_buffers(&s, &units); // on the stream's thread under --prefetch
        let mut fsdp = LayerwiseShard { units, head_grad };
        // --prefetch: which gathers each entry hands to the stream, decided once from the schedule.
        let plan = (prefetch > 0).then(|| Prefetch::new(&schedule(fsdp.units.len() - 1, head_grad), prefetch));
        let mut reference = args.check.then(|| WholeModelShard::new(&s, &start, true)).transpose()?; // recomputing, as this lesson does
        drop(start); // my shards are read: the start's source goes
        let mut timeline = MemoryTimeline::off();
        let mut divergence = vec![];
        let mut run = s.start_training()?; // the clock, a fresh peak; does the state alone fit the budget?
        for step in s.steps() {
            timeline.record(step == s.first_step && !args.no_plot);
            let loss = match &plan {
                Some(p) => fsdp.overlapped_step(&s, step, &mut timeline, p)?,
                None if args.accumulate.micro_batch_major() => {
                    fsdp.accumulating_step(&s, step, &mut timeline, args.accumulate)?
                }
                None => fsdp.step(&s, step, &mut timeline)?,
            };
            timeline.record(false);
            s.end_step(step, &mut run, loss, || fsdp.checkpoint_pieces())?; // budget, checkpoint, stop
            if args.unit_digests && world.is_root() {
                // After the step's clock, outside the measured peak: a diagnostic.
                fsdp_harness::alloc::host_side(|| run.unit_grad_digests.push(fsdp.grad_digests()));
            }
            if let Some(r) = reference.as_mut() {
                let d = world.untracked(|| -> anyhow::Result<f32> {
                    r.step(&s, step, &mut MemoryTimeline::off())?;
                    let mine = fsdp.gather_full(&s);
                    Ok(mine.iter().zip(r.gather_full(world)).map(|(a, b)| (a - b).abs()).fold(0.0, nan_max))
                })?;
                divergence.push(d);
                if step == s.first_step || step % s.args.log_every == 0 || step == s.args.steps {
                    print0!("           max |layer-wise − whole-model| = {}", sci(d as f64));
                }
            }
        }
        run.finish();
        let reference_tally = reference.as_ref().map(|r| r.tally(&s));
        drop(reference);
        let sent = hsdp::TrainingTraffic::now(world);
        let full = fsdp.gather_full(&s);

        let layouts: Vec<_> = fsdp.units.iter().map(|u| u.layout()).collect();
        let (mine, groups) = (s.my_micro_batches().len(), s.sum_groups.per_rank()); // one sum per group of mine
        let elems = (4, s.reduce_dtype.bytes());
        let (gather_bytes, scatter_bytes) =
            accumulate::bytes_per_step(args.accumulate, &layouts, head_grad, mine, groups, elems);
        let mut units = Table::new(["unit", "elements", "padding", "shard / rank", "MB unsharded"]);
        for u in &fsdp.units {
            let l = u.layout();
            units.row([
                u.name().to_string(),
                fsdp_harness::table::thousands(l.numel as u64),
                l.padding().to_string(),
                fsdp_harness::table::thousands(l.shard_len as u64),
                mb(4 * l.numel as u64),
            ]);
        }
        let max_div = divergence.iter().copied().fold(0.0, nan_max);
        let mut memory = args.accumulate.tally(&s, &fsdp.units, prefetch, head_grad);
        if let Some(r) = &reference_tally {
            // --check: lesson 02 beside, a diagnostic. Its state stays; its
            // step's peak shows only where it exceeds this lesson's.
            let state = r.kept_bytes() as usize - s.data_bytes(); // the data is the session's, counted once
            memory.apart("--check: lesson 02's state", state, 1, "its shards, full buffers, kept");
            let above = (r.total_bytes() - r.kept_bytes()).saturating_sub(memory.total_bytes() - memory.kept_bytes());
            memory.apart("--check: lesson 02's step, above this one's", above as usize, 1, "its whole-model backward");
        }
        let mut report = Report::new(&s, &run, memory);
        hsdp::report_traffic(&mut report, &s, &layouts, sent, gather_bytes, scatter_bytes);
        report.table(units.render());
        if args.accumulate != Accumulate::KeepUnsharded {
            report.table(unsharded_peak_table(&fsdp.units, prefetch, head_grad).render()); // (else: every unit)
        }
        if args.accumulate.micro_batch_major() {
            let (gathers, scatters) = calls_per_step(args.accumulate, fsdp.units.len(), mine, head_grad);
            report.table(format!(
                "--accumulate {}: {gathers} all-gathers and {scatters} reduce-scatters per step by theory \
                 ({} units, {mine} micro-batch(es) of mine)\n",
                args.accumulate.name(),
                fsdp.units.len()
            ));
        }
        report
            .json("max_divergence", serde_json::json!(args.check.then_some(max_div)))
            .json("divergence", serde_json::json!(divergence))
            .json("units", units_json(&fsdp.units))
            .json("head_grad", serde_json::json!(head_grad.name()))
            .json("accumulate", serde_json::json!(args.accumulate.name()))
            .json("memory_timeline", serde_json::json!(timeline.events));
        if args.check {
            report.table(format!(
                "max |layer-wise − whole-model| = {} over {} steps\n",
                sci(max_div as f64),
                divergence.len()
            ));
        }
        report.finish(Some(&full))?;
        drop((full, fsdp)); // lesson 02's step below starts from the session alone

        // The memory timeline: one step of lesson 02 on the same model and
        // batch, recomputing as lesson 03 does: the difference is the sharding.
        // Not under --check: its whole-model copy sat in lesson 03's heap all along.
        if !args.no_plot && args.check {
            print0!(
                "memory timeline: not drawn under --check (its whole-model copy counts in lesson 03's heap); run without --check to draw it"
            );
        }
        if !args.no_plot && !args.check {
            let mut whole = WholeModelShard::new(&s, &s.seed_start(), true)?; // the same activation policy
            let mut whole_timeline = MemoryTimeline::off();
            whole_timeline.record(true);
            whole.step(&s, s.first_step, &mut whole_timeline)?;
            whole_timeline.record(false);
            drop(whole);
            timeline_figure(&s, &whole_timeline, &timeline)?;
        }
        Ok(())
    })
}

/// Writes memory_timeline.svg: lesson 02's plateau beside lesson 03's sawtooth, on one scale.
fn timeline_figure(s: &Session, whole: &MemoryTimeline, layerwise: &MemoryTimeline) -> anyhow::Result<()> {
    if !s.world.is_root() {
        return Ok(());
    }
    let peaks = [whole.peak_bytes(), layerwise.peak_bytes()];
    let top = peaks[0].max(peaks[1]) as f64 / 1e6 * 1.08;
    let n = s.world.size();
    let charts: Vec<Chart> = vec![
        whole.chart(&format!("lesson 02 --recompute, whole model · rank 0 of {n}"), Some((0.0, top))),
        layerwise.chart(&format!("lesson 03, one unit at a time · rank 0 of {n}"), Some((0.0, top))),
    ];
    let path = s.out.join("memory_timeline.svg");
    fsdp_gpt::weights_file::write_atomically(&path, fsdp_harness::plot::svg(&charts).as_bytes())?;
    let json = serde_json::json!({"rank": 0, "step": s.first_step, "whole_model": whole.events, "layerwise": layerwise.events});
    fsdp_gpt::weights_file::write_atomically(
        &s.out.join("memory_timeline.json"),
        serde_json::to_string_pretty(&json)?.as_bytes(),
    )?;
    let mut t = Table::new(["one step, rank 0", "measured peak heap", "events"]);
    t.row(["lesson 02 --recompute (whole model)".to_string(), mb_measured(peaks[0]), whole.events.len().to_string()]);
    t.row(["lesson 03 (layer-wise)".to_string(), mb_measured(peaks[1]), layerwise.events.len().to_string()]);
    println!("{}wrote {} and memory_timeline.json", t.render(), path.display());
    Ok(())
}
