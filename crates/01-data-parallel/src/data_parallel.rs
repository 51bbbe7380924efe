//! # Lesson 01 — data parallelism: the oracle
//!
//! Every rank holds *everything*: the full parameters, the full gradient, the
//! full AdamW state. Each step:
//!
//! 1. **forward/backward** on this rank's micro-batches (its share of the
//!    global batch), summing their gradients locally;
//! 2. **all-reduce** the gradient: every rank gets the sum over ranks, added
//!    as a fixed pairwise tree, then divides by the number of micro-batches;
//! 3. **update**: every rank takes the same AdamW step on the same numbers,
//!    so the replicas stay identical — which we check, bit for bit.
//!
//! Later lessons delete the redundant copies and must produce these bits.
use std::borrow::Cow;
use std::ops::Range;

use anyhow::bail;
use candle_core::Var;
use fsdp_comm::{MicroBatchSum, ShardLayout};
use fsdp_gpt::params::digest_f32;
use fsdp_gpt::{AdamW, Precision};
use fsdp_harness::checkpoint::{ShardPiece, cut_shard};
use fsdp_harness::{MemoryTally, Moment, Session, Start, exercise};

use crate::buckets::{Buckets, backward_in_buckets};

/// How the gradient is all-reduced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Reduce {
    /// Reduce-scatter + all-gather with the pairwise sum over ranks: bitwise reproducible.
    Ordered,
    /// MPI's own MPI_Allreduce: its summation order is MPI's choice.
    Native,
}

/// One rank's replica of the whole training state.
pub struct DataParallel {
    /// The full fp32 parameters, identical on every rank.
    pub params: Vec<f32>,
    /// The sum of my micro-batches' full gradients, padded to a multiple of
    /// N for the all-reduce.
    grads: MicroBatchSum,
    /// This rank's shard of the gradient inside the ordered all-reduce.
    grad_shard: Vec<f32>,
    opt: AdamW,
    reduce: Reduce,
    /// The compute copy's dtype (`--precision`); params, sums, `m`, `v` stay fp32.
    precision: Precision,
    /// `--recompute`: activation checkpointing, block by block.
    recompute: bool,
    /// `--bucket-mb`: the gradient all-reduced bucket by bucket on the
    /// communication stream, during my last micro-batch's backward (DDP).
    buckets: Option<Buckets>,
}

impl DataParallel {
    pub fn new(
        s: &Session,
        start: Start,
        reduce: Reduce,
        precision: Precision,
        recompute: bool,
        bucket_bytes: Option<usize>,
    ) -> anyhow::Result<Self> {
        let numel = s.table.numel();
        let layout = ShardLayout::new(numel, s.world.size());
        let buckets = bucket_bytes.map(|cap| Buckets::for_session(s, layout.padded, cap));
        // The same seed (or checkpoint), the same bits, on every rank: kept whole.
        let (params, moments) = start.into_parts()?;
        let mut opt = AdamW::new(s.adamw, numel).with_no_decay(s.table.no_decay_in(0..numel));
        if let Some(m) = moments {
            (opt.m, opt.v, opt.t) = (m.m, m.v, m.t);
        }
        Ok(Self {
            params,
            grads: s.grad_sum(layout.padded).preallocated(),
            // the buckets have shards of their own
            grad_shard: if buckets.is_some() { vec![] } else { vec![0.0; layout.shard_len] },
            opt,
            reduce,
            precision,
            recompute,
            buckets,
        })
    }

    /// Allocates now the ordered all-reduce's receive buffer, which the
    /// tally counts as kept (not under `--accumulate`, which adds the group
    /// sums itself).
    pub fn reserve_buffers(&self, s: &Session) {
        match &self.buckets {
            Some(b) => b.reserve_receive_buffer(s),
            None if self.reduce == Reduce::Ordered => {
                s.reserve_receive_buffer(self.grad_shard.len() * s.world.size(), false)
            }
            None => {}
        }
    }

    /// The buckets under `--bucket-mb`.
    pub fn buckets(&self) -> Option<&Buckets> {
        self.buckets.as_ref()
    }

    // ANCHOR: step
    /// One optimizer step; returns the mean loss over the global batch.
    pub fn step(&mut self, s: &Session, step: u64) -> anyhow::Result<f32> {
        let (w, numel) = (s.world, s.table.numel());
        // 1. forward/backward on my micro-batches, gradients summed in order (exercise 1.2)
        let vars = s.model.vars_in(&s.table, &self.params, self.precision)?;
        self.grads.reset();
        let mine = s.my_micro_batches();
        // (With buckets my last micro-batch goes apart: its backward all-reduces as it goes.)
        let (summed, last) = match self.buckets {
            Some(_) => (mine.start..mine.end - 1, Some(mine.end - 1)),
            None => (mine, None),
        };
        let mut loss_sum = w.traced(
            || "forward+backward of my micro-batches".into(),
            || accumulate_micro_batches(s, &vars, step, summed, self.recompute, &mut self.grads),
        )?;
        if let (Some(k), Some(b)) = (last, self.buckets.as_mut()) {
            loss_sum += backward_in_buckets(s, &vars, step, k, self.recompute, &mut self.grads, b)? as f64;
        }
        drop(vars);

        // 2. all-reduce: the sum over ranks (its reduce-scatter adds with `sum_received`), then the mean
        let grads = match (self.buckets.as_mut(), self.reduce) {
            (Some(b), _) => b.all_reduced(w, &mut self.grads), // handed to the stream in the backward
            (None, Reduce::Ordered) => w.all_reduce_sum(&mut self.grads, &mut self.grad_shard),
            (None, Reduce::Native) => w.all_reduce_native(&mut self.grads.sums()[0]),
        };
        let (m, grads) = (s.sampler.micro_batches, &mut grads[..numel]);
        scale(grads, m);
        s.clip_whole(grads); // --grad-clip: every rank holds the whole gradient

        // 3. update: the same AdamW step on every rank
        w.traced(|| "AdamW update".into(), || self.opt.step(&mut self.params, grads));
        Ok((w.sum_f64(&[loss_sum])[0] / m as f64) as f32)
    }
    // ANCHOR_END: step

    // ANCHOR: accumulate
    /// The same step in one process: the micro-batches of G groups (one per
    /// simulated rank, `--accumulate N`), each group summed as its rank
    /// would, the group sums then added as the pairwise tree over ranks —
    /// the additions of N-rank data parallelism, one by one.
    pub fn accumulate_step(&mut self, s: &Session, step: u64) -> anyhow::Result<f32> {
        let numel = s.table.numel();
        let vars = s.model.vars_in(&s.table, &self.params, self.precision)?;
        self.grads.reset(); // one process: all G group sums are mine
        let every = 0..s.sampler.micro_batches;
        let loss_sum = accumulate_micro_batches(s, &vars, step, every, self.recompute, &mut self.grads)?;
        drop(vars);
        let mut total = vec![0.0f32; numel];
        let mut parts: Vec<&mut [f32]> = self.grads.sums().iter_mut().map(|g| &mut g[..numel]).collect();
        sum_received(&mut parts); // in place, into the first group's sum: the tree over ranks
        total.copy_from_slice(parts[0]);
        let m = s.sampler.micro_batches;
        scale(&mut total, m);
        s.clip_whole(&mut total);
        self.opt.step(&mut self.params, &total);
        Ok((loss_sum / m as f64) as f32)
    }
    // ANCHOR_END: accumulate

    /// Every rank's digest of its replica must be the same: cheap (8 bytes
    /// per rank) and exact. Stops the whole job if they differ.
    pub fn check_replicas(&self, s: &Session, step: u64) -> anyhow::Result<()> {
        let digests = s.world.gather_control(&[digest_f32(&self.params)]);
        if digests.iter().any(|&d| d != digests[0]) {
            let list: Vec<String> = digests.iter().map(|d| format!("{d:016x}")).collect();
            bail!("replicas diverged at step {step}: per-rank weight digests {}", list.join(", "));
        }
        Ok(())
    }

    /// My shard of the replicated state, for a checkpoint: every rank holds
    /// everything, so each writes only its 1/N (the files are those of lesson 02).
    pub fn checkpoint_pieces(&self, s: &Session) -> Vec<ShardPiece<'static>> {
        let layout = ShardLayout::new(s.table.numel(), s.world.size());
        let cut = |full: &[f32]| Cow::Owned(cut_shard(full, layout, s.world.rank()));
        vec![ShardPiece::flat(&s.table, cut(&self.params), cut(&self.opt.m), cut(&self.opt.v))]
    }

    /// Bytes this rank holds, by category, from shapes: the replicated
    /// state, and the step's peak — a micro-batch's backward, with the whole
    /// model's compute copy and every block's tape.
    pub fn tally(&self, s: &Session, simulated_ranks: Option<usize>) -> MemoryTally {
        let numel = s.table.numel();
        let padded = ShardLayout::new(numel, s.world.size()).padded;
        let groups = s.sum_groups.per_rank();
        let mut t = MemoryTally::new();
        t.add("params (fp32)", numel, 4, "full copy on every rank")
            .add("AdamW m", numel, 4, "full")
            .add("AdamW v", numel, 4, "full")
            .add("grad sums (fp32)", s.sum_groups.buffers() * padded, 4, &sums_note(s.sum_groups.buffers()));
        let simulated = simulated_ranks.is_some(); // --accumulate: no all-to-all
        match &self.buckets {
            None => {
                t.add("grad shard", self.grad_shard.len(), 4, "my 1/N inside the ordered all-reduce");
                if let Some(len) = s.receive_buffer_len(padded).filter(|_| self.reduce == Reduce::Ordered && !simulated)
                {
                    t.add("all-to-all receive buffer", len, 4, "the reduce-scatter's input from every rank, kept");
                }
            }
            Some(b) => b.tally_rows(s, &mut t),
        }
        s.data_tally(&mut t);
        let (e, vars_note) = (self.precision.bytes(), "compute copy, rebuilt each step");
        let vars_row = format!("params as candle Vars ({})", self.precision);
        let add = "adding a micro-batch's gradients to the sum";
        // With buckets my last micro-batch hands each block's gradient on as its backward ends; the
        // others (all, without) are collected whole.
        let whole = s.my_micro_batches().len() - usize::from(self.buckets.is_some());
        let mut moments = match whole {
            0 => vec![],
            _ => s.whole_model_moments(e, self.recompute, "a micro-batch", add, &mut |_, m| {
                m.add(&vars_row, numel, e, vars_note);
            }),
        };
        if let Some(b) = &self.buckets {
            // Each unit's gradient added to the sum as the unit is handed on.
            moments.extend(b.last_micro_batch_moments(s, e, self.recompute, &mut |m| {
                m.add(&vars_row, numel, e, vars_note);
            }));
        }
        if groups > 1 && !simulated && self.buckets.is_none() {
            let mut m = Moment::new("all-reduce of several group sums");
            m.add("send buffer", groups * padded, 4, "group sums packed per destination");
            moments.push(m);
        }
        if simulated_ranks.is_some() {
            let mut m = Moment::new("the update");
            m.add("sum over the groups", numel, 4, "the simulated all-reduce's result");
            moments.push(m);
        }
        t.peak(moments);
        t
    }
}

/// Forward/backward on `micro_batches`, their gradients added onto `sums`
/// in its order; returns the losses' sum: exercise 1.2, the learner's
/// under `--mine 2`.
pub fn accumulate_micro_batches(
    s: &Session,
    vars: &[Var],
    step: u64,
    micro_batches: Range<usize>,
    recompute: bool,
    sums: &mut MicroBatchSum,
) -> anyhow::Result<f64> {
    exercise!(1, 2, accumulate_micro_batches(s, vars, step, micro_batches, recompute, sums))
}

/// The ranks' parts added as the pairwise tree: exercise 1.1, the learner's
/// under `--mine 1`. The ordered all-reduce calls it (`World::set_rank_sum`).
pub fn sum_received(parts: &mut [&mut [f32]]) {
    exercise!(1, 1, sum_received(parts))
}

/// `g ← g · (1/M)`: the mean over the global batch's M micro-batches.
pub fn scale(grads: &mut [f32], micro_batches: usize) {
    let inv = 1.0 / micro_batches as f32;
    grads.iter_mut().for_each(|g| *g *= inv);
}

fn sums_note(buffers: usize) -> String {
    match buffers {
        1 => "full, padded to a multiple of N".into(),
        k => format!("full, padded; {k} partial sums of the pairwise tree at most"),
    }
}
