//! `step04-optimizer-state-shard`: ZeRO stages 1, 2 and 3 in mixed
//! precision, with every byte per rank tallied beside the measured heap.
//!
//! ```text
//! just step 04                         # 2 ranks, stage 3, bf16
//! just step 04 4 --stage 1             # optimizer state sharded only
//! just step 04 4 --stage 2 --precision fp32
//! just tally 7B 64                     # the same accounting at any scale
//! just zero-memory                     # GPT-2 small's size: every scheme, measured beside its tally
//! just fits                            # data parallel and ZeRO-1 run out of memory; ZeRO-3 trains
//! just step 04 2 --accumulate reduce-every   # ZeRO-3 micro-batch after micro-batch (lesson 03's modes)
//! ```

use std::process::ExitCode;

use clap::Parser;
use fsdp_comm::ReduceDtype;
use fsdp_gpt::Precision;
use fsdp_harness::config_table::recompute_note;
use fsdp_harness::{Lesson, MemoryTimeline, Report, Session, TrainArgs, exercise};
use step03_layerwise_shard::accumulate::{self, Accumulate};
use step03_layerwise_shard::prefetch::{describe_prefetch, prefetch_depth};
use step03_layerwise_shard::{HeadGrad, describe_reduce, hsdp, reduce_flag};
use step04_optimizer_state_shard::zero::{Shapes, model_states, side_by_side, stage1_tally, stage2_tally};
use step04_optimizer_state_shard::{OptimizerStateShard, Overlap};

const LESSON: Lesson = Lesson {
    package: "step04-optimizer-state-shard",
    title: "optimizer-state shard: ZeRO stages 1, 2, 3 in mixed precision",
    exercises: 2,
};

#[derive(Debug, Parser)]
struct Args {
    #[command(flatten)]
    train: TrainArgs,
    /// ZeRO stage: 1 shards the fp32 master and AdamW state, 2 also the
    /// gradients, 3 also the parameters (lesson 03's units).
    #[arg(long, allow_negative_numbers = true, default_value_t = 3, value_parser = clap::value_parser!(u8).range(1..=3))]
    stage: u8,
    /// Compute precision: bf16 (bf16 compute copy and gradients; fp32 master,
    /// gradient sums and AdamW state) or fp32.
    #[arg(long, default_value = "bf16", value_parser = |s: &str| s.parse::<Precision>())]
    precision: Precision,
    /// Stage 3: FSDP2's overlap (lesson 03's --prefetch): a communication
    /// thread gathers the next units (two, or one where two would pass
    /// --mem-budget) while this one computes, forward and backward, and
    /// reduce-scatters each unit while the next unit's backward runs.
    #[arg(long)]
    prefetch: bool,
    /// Stage 3, with --prefetch: gather the units of the next K entries of
    /// lesson 03's schedule ahead (default 2; lesson 03's --prefetch-depth).
    #[arg(long, allow_negative_numbers = true, value_name = "K")]
    prefetch_depth: Option<usize>,
    /// Stages 1 and 2: DeepSpeed's overlap_comm — a communication thread
    /// reduce-scatters each unit's gradient as soon as my last micro-batch's
    /// backward completes it, while the blocks below still compute.
    #[arg(long)]
    overlap_comm: bool,
    /// Stage 3: where the tied wte's lm_head gradient waits for its
    /// embedding part: keep it, (V, C) per micro-batch, or recompute the
    /// head at the end from its input, (B, T, C). Default: whichever gives
    /// the lower peak by the tally.
    #[arg(long, value_name = "keep|recompute")]
    head_grad: Option<HeadGrad>,
    /// Stages 1 and 2: activation checkpointing, block by block (less
    /// memory, one more forward, the same bits). Stage 3 always recomputes.
    #[arg(long)]
    recompute: bool,
    /// Hybrid sharding (HSDP, lesson 03's): every stage sharded within
    /// groups of S consecutive ranks, replicated across the N/S groups.
    #[arg(long, allow_negative_numbers = true, value_name = "S")]
    hsdp: Option<usize>,
    /// The dtype gradients are summed and reduce-scattered in (FSDP2's
    /// `MixedPrecisionPolicy.reduce_dtype`): fp32, or bf16 — half the
    /// reduce-scatter's bytes, every sum of the fixed pairwise tree rounded
    /// to bf16 (a micro-batch's gradient, each addition on a rank or across
    /// ranks), so the bits still do not depend on the world size.
    #[arg(long, default_value = "fp32", value_parser = |s: &str| s.parse::<ReduceDtype>())]
    reduce_dtype: ReduceDtype,
    /// Stage 3: how my micro-batches go through the units (lesson 03's
    /// --accumulate): unit-major, reduce-every, no-sync or keep-unsharded.
    #[arg(long, default_value = "unit-major", value_name = "MODE", value_parser = |s: &str| s.parse::<Accumulate>())]
    accumulate: Accumulate,
}

const STAGES: [&str; 3] = [
    "1: fp32 master, AdamW m and v sharded; compute copy and gradients replicated",
    "2: + gradients sharded (reduce-scattered unit by unit in backward)",
    "3: + parameters sharded (each unit gathered just in time)",
];

fn main() -> ExitCode {
    fsdp_harness::main(LESSON, |world, lesson| {
        let args: Args = fsdp_harness::parse_args(lesson)?;
        // The stage does not change the arithmetic (a ZeRO-1 checkpoint resumes at ZeRO-3); the precision does.
        let mut flags = vec![("--precision", args.precision.to_string())];
        flags.extend(reduce_flag(args.reduce_dtype));
        let (mut s, start) = Session::with_flags(world, lesson, args.train, &flags)?;
        s.reduce_dtype = args.reduce_dtype;
        fsdp_harness::lesson::agree(
            world,
            match (args.head_grad, args.stage) {
                (Some(h), stage @ (1 | 2)) => Err(anyhow::anyhow!(
                    "--head-grad {} applies to stage 3 (lesson 03's schedule): leave it out at --stage {stage}",
                    h.name()
                )),
                _ if args.prefetch_depth.is_some() && args.stage < 3 => Err(anyhow::anyhow!(
                    "--prefetch-depth applies to stage 3 (lesson 03's schedule, with --prefetch): leave it out at --stage {}",
                    args.stage
                )),
                _ if args.prefetch && args.stage < 3 => Err(anyhow::anyhow!(
                    "--prefetch applies to stage 3 (lesson 03's schedule): at --stage {} the reduce-scatter overlaps the backward with --overlap-comm",
                    args.stage
                )),
                _ if args.overlap_comm && args.stage == 3 => Err(anyhow::anyhow!(
                    "--overlap-comm applies to stages 1 and 2: at --stage 3 pass --prefetch (FSDP2's overlap, lesson 03's)"
                )),
                _ if args.accumulate.micro_batch_major() && args.stage < 3 => Err(anyhow::anyhow!(
                    "--accumulate {} applies to stage 3 (lesson 03's schedule): stage {}'s step already runs micro-batch after micro-batch",
                    args.accumulate.name(),
                    args.stage
                )),
                _ => args
                    .accumulate
                    .refusal(args.prefetch, args.hsdp.is_some(), false, args.head_grad)
                    .map_or(Ok(()), Err),
            },
        )?;
        hsdp::check(&s, args.hsdp)?;
        let asked =
            fsdp_harness::lesson::agree(world, prefetch_depth(args.prefetch, args.prefetch_depth, s.cfg.n_layer))?;
        if args.prefetch || args.overlap_comm {
            // FSDP2's streams, DeepSpeed's overlap_comm: a communication thread of its own, on every rank.
            s.start_stream()?;
        }
        let needs = exercise::needs(4, 1, args.stage == 2, "at --stage 2 (ZeRO-2's hand-off)").and_then(|()| {
            exercise::needs(4, 2, args.precision == Precision::Bf16, "under --precision bf16 (the bf16 gathers)")
        });
        fsdp_harness::lesson::agree(world, needs)?;
        // The communicators, split once (under --hsdp the mesh), every rank together.
        let comms = hsdp::unit_comms(world, args.hsdp);
        let overlap = Overlap { prefetch: asked, overlap_comm: args.overlap_comm }; // each refused where it does not apply
        let mut zero = OptimizerStateShard::new(
            &s,
            start,
            args.stage,
            args.precision,
            comms,
            args.recompute,
            args.accumulate.head_grad(args.head_grad),
            overlap,
        )?;
        let head_grad = zero.fsdp.head_grad;
        let mut rows = vec![
            ("ZeRO stage", STAGES[args.stage as usize - 1].to_string()),
            (
                "precision",
                format!("{}: compute copy and grads; fp32 master, gradient sums, AdamW m and v", args.precision),
            ),
            ("gradient reduce dtype", describe_reduce(args.reduce_dtype)),
            ("sharding", hsdp::describe(world.size(), args.hsdp)),
            ("prefetch", describe_prefetch(zero.prefetch_depth(), asked)),
            (
                "tied wte's gradient",
                match args.stage {
                    3 => head_grad.describe(s.micro_batch_shape(), s.cfg.n_embd, s.cfg.vocab_size),
                    _ => "formed whole in each micro-batch's backward".into(),
                },
            ),
            (
                "activations",
                match args.stage {
                    3 => {
                        "recomputed unit by unit (always at stage 3: a graph would keep the gathered unit alive)".into()
                    }
                    _ => recompute_note(args.recompute),
                },
            ),
        ];
        rows.extend(args.accumulate.config_row());
        if args.overlap_comm {
            rows.push((
                "overlap-comm",
                "on: each unit reduce-scattered on the communication stream in backward".into(),
            ));
        }
        s.print_config(&rows);

        world.reset_traffic(); // stages 1–2 gathered their resident copies: setup, not a step
        let mut run = s.start_training()?; // the clock, a fresh peak; does the state alone fit the budget?
        for step in s.steps() {
            let loss = match zero.overlapped() {
                true => zero.overlapped_step(&s, step, &mut MemoryTimeline::off())?,
                false if args.accumulate.micro_batch_major() => {
                    zero.fsdp.accumulating_step(&s, step, &mut MemoryTimeline::off(), args.accumulate)? // stage 3
                }
                false => zero.step(&s, step, &mut MemoryTimeline::off())?,
            };
            s.end_step(step, &mut run, loss, || zero.fsdp.checkpoint_pieces())?; // budget, checkpoint, stop
        }
        run.finish();
        let sent = hsdp::TrainingTraffic::now(world);
        let full = zero.fsdp.gather_full(&s);

        let units = &zero.fsdp.units;
        let largest = units.iter().max_by_key(|u| u.layout().numel).expect("units");
        let shapes = Shapes {
            numel: s.table.numel(),
            padded: units.iter().map(|u| u.layout().padded).sum(),
            shards: units.iter().map(|u| u.layout().shard_len).sum(),
            largest: largest.layout().numel,
            largest_padded: largest.layout().padded,
            ranks: largest.layout().world, // N, or S under --hsdp
            compute_bytes: args.precision.bytes(),
            prefetch: zero.prefetch_depth(),
            sum_groups: s.sum_groups.per_rank(),
            sum_buffers: s.sum_groups.buffers(),
        };
        // Bytes on the wire: every gather moves the compute dtype, every
        // reduce-scatter fp32; stage 3 gathers each unit twice (the root a
        // third time if the head is recomputed), stages 1–2 once (the new
        // weights after the update).
        let sent_bytes = |bytes: usize| -> u64 {
            units.iter().map(|u| ((u.layout().world - 1) * u.layout().shard_len * bytes) as u64).sum()
        };
        let layouts: Vec<_> = units.iter().map(|u| u.layout()).collect();
        let groups = s.sum_groups.per_rank();
        let (gathered, scattered) = match args.stage {
            // lesson 03's schedule (in its --accumulate mode), gathering the compute dtype
            3 => {
                let (elems, mine) = ((args.precision.bytes(), s.reduce_dtype.bytes()), s.my_micro_batches().len());
                accumulate::bytes_per_step(args.accumulate, &layouts, head_grad, mine, groups, elems)
            }
            _ => (sent_bytes(args.precision.bytes()), groups as u64 * sent_bytes(s.reduce_dtype.bytes())),
        };
        let memory = match args.stage {
            1 => stage1_tally(&s, units, args.recompute, zero.overlap_comm),
            2 => stage2_tally(&s, units, args.recompute, zero.overlap_comm),
            _ => args.accumulate.tally(&s, units, zero.prefetch_depth(), head_grad), // lesson 03's schedule, in its mode
        };
        let mut report = Report::new(&s, &run, memory);
        hsdp::report_traffic(&mut report, &s, &layouts, sent, gathered, scattered);
        report
            .table(format!(
                "ZeRO side by side: {} parameters on {} rank(s){}, {} compute\n{}",
                fsdp_harness::table::thousands(shapes.numel as u64),
                world.size(),
                args.hsdp.map_or(String::new(), |size| format!(", sharded within groups of {size} (--hsdp)")),
                args.precision,
                side_by_side(shapes, 12.0).render()
            ))
            .json("stage", serde_json::json!(args.stage))
            .json("units", step03_layerwise_shard::tally::units_json(units))
            .json("head_grad", serde_json::json!((args.stage == 3).then(|| head_grad.name())))
            .json("precision", serde_json::json!(args.precision.to_string()))
            .json("accumulate", serde_json::json!(args.accumulate.name()))
            .json(
                "side_by_side_bytes",
                serde_json::json!(
                    [0u8, 1, 2, 3].iter().map(|&st| model_states(st, shapes).total_bytes()).collect::<Vec<_>>()
                ),
            );
        report.finish(Some(&full))
    })
}
