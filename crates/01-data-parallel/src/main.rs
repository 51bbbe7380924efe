//! `step01-data-parallel`: trains the GPT with plain data parallelism.
//!
//! ```text
//! just step 01            # 2 ranks
//! just step 01 4          # 4 ranks
//! cargo run --release -p step01-data-parallel -- --accumulate 2   # one process, 2 simulated ranks
//! ```
use std::process::ExitCode;

use clap::Parser;
use fsdp_comm::Collective;
use fsdp_gpt::Precision;
use fsdp_harness::config_table::recompute_note;
use fsdp_harness::{Lesson, Report, Session, TrainArgs, exercise, print0};
use step01_data_parallel::{DataParallel, Reduce};

const LESSON: Lesson = Lesson {
    package: "step01-data-parallel",
    title: "data parallelism, everything replicated (the oracle)",
    exercises: 2,
};

#[derive(Debug, Parser)]
struct Args {
    #[command(flatten)]
    train: TrainArgs,
    /// Run in one process, accumulating the micro-batches of N simulated ranks
    /// and adding their sums as N ranks would: bit for bit what N ranks compute.
    #[arg(long, allow_negative_numbers = true, value_name = "N", value_parser = ranks_to_stand_in_for)]
    accumulate: Option<u32>,
    /// How to all-reduce the gradient: ordered (bitwise reproducible) or native (MPI_Allreduce).
    #[arg(long, value_enum, default_value = "ordered")]
    reduce: Reduce,
    /// Verify every this many steps that the ranks' replicas agree bit for bit (0: never).
    #[arg(long, default_value_t = 10)]
    check_every: u64,
    /// Activation checkpointing: keep only each block's input in forward and
    /// recompute the block just before its backward (less memory, one more
    /// forward, the same bits).
    #[arg(long)]
    recompute: bool,
    /// DDP's buckets: all-reduce the gradient in buckets of at least this
    /// many MB (10⁶ bytes; DDP's bucket_cap_mb counts MiB, default 25) of
    /// fp32 gradient, each handed to a communication thread as soon as my
    /// last micro-batch's backward completes it, while the backward goes on.
    /// The same bits.
    #[arg(long, allow_negative_numbers = true, value_name = "MB", value_parser = fsdp_harness::cli::positive_mb)]
    bucket_mb: Option<f64>,
    /// Compute precision: fp32, or bf16 (bf16 compute copy and gradients;
    /// fp32 master weights, gradient sums and AdamW state).
    #[arg(long, default_value = "fp32", value_parser = |s: &str| s.parse::<Precision>())]
    precision: Precision,
}

/// `--accumulate N`: a number of ranks, 1 to 4096. Lesson 03's `--accumulate`
/// takes a mode instead; a learner who passes one here is told where it goes.
fn ranks_to_stand_in_for(s: &str) -> Result<u32, String> {
    match s.parse::<i64>() {
        Ok(n) if (1..=4096).contains(&n) => Ok(n as u32),
        _ if s.starts_with(|c: char| c.is_ascii_alphabetic()) => Err("pass a number of ranks to stand in for, \
             e.g. 2 (in lessons 03 and 04, --accumulate takes a mode: just step 03 2 --accumulate no-sync)"
            .into()),
        _ => Err("pass a number of ranks from 1 to 4096".into()),
    }
}

fn main() -> ExitCode {
    fsdp_harness::main(LESSON, |world, lesson| {
        let args: Args = fsdp_harness::parse_args(lesson)?;
        let accumulate = args.accumulate.map(|n| n as usize);
        let check = |m: u32| -> anyhow::Result<()> {
            if let Some(n) = accumulate {
                if world.size() > 1 {
                    anyhow::bail!("--accumulate simulates ranks in one process: run it without mpirun (or with -n 1)");
                }
                if n > m as usize || !(m as usize).is_multiple_of(n) {
                    anyhow::bail!("--accumulate {n} needs --micro-batches to be a multiple of {n} (it is {m})");
                }
            }
            Ok(())
        };
        let mut train = args.train.clone();
        if train.sum_groups.is_none() {
            train.sum_groups = args.accumulate; // N simulated ranks sum in N groups, resumed or not
        }
        let (s, start) = Session::with_flags(
            world,
            lesson,
            train,
            &[("--precision", args.precision.to_string()), ("--reduce", format!("{:?}", args.reduce).to_lowercase())],
        )?;
        fsdp_harness::lesson::agree(world, check(s.sampler.micro_batches as u32))?;
        // The ranks' (or groups') sums are added by exercise 1.1's code only when there are several.
        // (--accumulate adds the group sums itself, whatever --reduce says.)
        let ordered = accumulate.is_some() || args.reduce == Reduce::Ordered;
        let adds = ordered && (world.size() > 1 || s.sum_groups.groups > 1);
        let needs = exercise::needs(
            1,
            1,
            adds,
            "when sums are added: run 2 or more ranks (or --accumulate 2), --reduce ordered",
        );
        fsdp_harness::lesson::agree(world, needs)?;
        let groups = s.sum_groups.per_rank();
        let bucket_bytes = step01_data_parallel::buckets::cap_bytes(args.bucket_mb);
        if bucket_bytes.is_some() {
            let refuse = match (accumulate.is_some(), args.reduce) {
                (true, _) => Err(anyhow::anyhow!(
                    "--bucket-mb all-reduces between ranks while the backward runs: leave it out under --accumulate (one process)"
                )),
                (_, Reduce::Native) => Err(anyhow::anyhow!(
                    "--bucket-mb all-reduces each bucket in the ordered way: leave out --reduce native"
                )),
                _ => Ok(()),
            };
            fsdp_harness::lesson::agree(world, refuse)?;
            let per_rank = s.my_micro_batches().len();
            fsdp_harness::lesson::agree(
                world,
                exercise::needs(
                    1,
                    2,
                    per_rank > 1,
                    "with --bucket-mb when a rank has 2 or more micro-batches (the last one goes to the buckets): pass --micro-batches 8",
                ),
            )?;
            // DDP's buckets go to a communication thread of their own, on every rank.
            s.start_stream()?;
        }
        if args.reduce == Reduce::Native && accumulate.is_none() && groups > 1 {
            fsdp_harness::lesson::agree(
                world,
                Err::<(), _>(anyhow::anyhow!(
                    "--reduce native sums one buffer per rank, but this run sums {groups} gradient groups per rank (--sum-groups, or the checkpoint's): use --reduce ordered"
                )),
            )?;
        }
        let mut extra = vec![
            ("all-reduce", format!("{:?}", args.reduce).to_lowercase()),
            ("activations", recompute_note(args.recompute)),
        ];
        if args.precision != Precision::Fp32 {
            extra.push(("precision", format!("{}: compute copy and grads; fp32 master, sums, AdamW", args.precision)));
        }
        if let Some(n) = accumulate {
            extra.push(("accumulate", format!("{n} simulated ranks in one process")));
        }
        // The reduce-scatter inside the ordered all-reduce adds what the
        // all-to-all delivered with exercise 1.1 (the answer's unless --mine 1).
        world.set_rank_sum(step01_data_parallel::data_parallel::sum_received);
        let (mut dp, mut buckets) = match bucket_bytes {
            Some(cap) => {
                let (dp, b) = DataParallel::with_buckets(&s, start, args.reduce, args.precision, args.recompute, cap)?;
                (dp, Some(b))
            }
            None => (DataParallel::new(&s, start, args.reduce, args.precision, args.recompute)?, None),
        };
        if let Some(b) = &buckets {
            extra.push(("DDP buckets", step01_data_parallel::buckets::describe(b, args.bucket_mb.unwrap_or(0.0))));
        }
        s.print_config(&extra);
        match (&buckets, accumulate) {
            (Some(b), _) => b.reserve_receive_buffer(&s), // on the stream's thread, where its reduce-scatters run
            (None, None) => dp.reserve_buffers(&s),
            (None, Some(_)) => {} // --accumulate adds the group sums itself
        }
        let mut run = s.start_training()?; // the clock, a fresh peak; does the state alone fit the budget?
        let mut checks = 0;
        for step in s.steps() {
            let loss = match (accumulate, buckets.as_mut()) {
                (Some(_), _) => dp.accumulate_step(&s, step)?,
                (None, Some(b)) => dp.bucketed_step(&s, step, b)?,
                (None, None) => dp.step(&s, step)?,
            };
            s.end_step(step, &mut run, loss, || dp.checkpoint_pieces(&s))?; // budget, checkpoint, stop
            if args.check_every > 0 && (step % args.check_every == 0 || step == s.args.steps) {
                dp.check_replicas(&s, step)?;
                checks += 1;
            }
        }
        run.finish();
        match checks {
            0 => print0!("replica check: off (--check-every 0)\n"),
            _ => print0!("replica check: {checks} checks, every rank's weights bitwise identical\n"),
        }

        let n = world.size() as u64;
        let shard = 4 * s.table.numel().div_ceil(world.size()) as u64;
        let groups = s.sum_groups.per_rank() as u64; // sum groups of mine: that many reduce-scatters' bytes, one all-gather's
        let memory = match &buckets {
            Some(b) => dp.bucketed_tally(&s, b),
            None => dp.tally(&s, accumulate),
        };
        let mut report = Report::new(&s, &run, memory);
        report.expect_traffic(
            Collective::AllReduce,
            buckets.as_ref().map_or((groups + 1) * (n - 1) * shard, |b| b.bytes_per_step()),
        );
        if let Some(b) = &buckets {
            report.json("buckets", step01_data_parallel::buckets::buckets_json(b));
        }
        report.finish(Some(&dp.params))
    })
}
