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
    pub(crate) grads: MicroBatchSum,
    /// This rank's shard of the gradient inside the ordered all-reduce.
    grad_shard: Vec<f32>,
    pub(crate) opt: AdamW,
    reduce: Reduce,
    /// The compute copy's dtype (`--precision`); params, sums, `m`, `v` stay fp32.
    pub(crate) precision: Precision,
    /// `--recompute`: activation checkpointing, block by block.
    pub(crate) recompute: bool,
}

impl DataParallel {
    pub fn new(
        s: &Session,
        start: Start,
        reduce: Reduce,
        precision: Precision,
        recompute: bool,
    ) -> anyhow::Result<Self> {
        let layout = ShardLayout::new(s.table.numel(), s.world.size());
        Self::build(s, start, reduce, precision, recompute, layout.shard_len)
    }

    /// The replica, with `grad_shard_len` elements of gradient shard inside
    /// the ordered all-reduce (none with DDP's buckets: they have their own).
    pub(crate) fn build(
        s: &Session,
        start: Start,
        reduce: Reduce,
        precision: Precision,
        recompute: bool,
        grad_shard_len: usize,
    ) -> anyhow::Result<Self> {
        let numel = s.table.numel();
        let layout = ShardLayout::new(numel, s.world.size());
        // The same seed (or checkpoint), the same bits, on every rank: kept whole.
        let (params, moments) = start.into_parts()?;
        let mut opt = AdamW::new(s.adamw, numel).with_no_decay(s.table.no_decay_in(0..numel));
        if let Some(m) = moments {
            (opt.m, opt.v, opt.t) = (m.m, m.v, m.t);
        }
        Ok(Self {
            params,
            grads: s.grad_sum(layout.padded).preallocated(),
            grad_shard: vec![0.0; grad_shard_len],
            opt,
            reduce,
            precision,
            recompute,
        })
    }

    /// Allocates now the ordered all-reduce's receive buffer, which the
    /// tally counts as kept (not under `--accumulate`, which adds the group
    /// sums itself; DDP's buckets reserve their own).
    pub fn reserve_buffers(&self, s: &Session) {
        if self.reduce == Reduce::Ordered {
            s.reserve_receive_buffer(self.grad_shard.len() * s.world.size(), false)
        }
    }

    // ANCHOR: step
    /// One optimizer step; returns the mean loss over the global batch.
    pub fn step(&mut self, s: &Session, step: u64) -> anyhow::Result<f32> {
        let (w, numel) = (s.world, s.table.numel());
        // 1. forward/backward on my micro-batches, gradients summed in order (exercise 1.2)
        let vars = s.model.vars_in(&s.table, &self.params, self.precision)?;
        self.grads.reset();
        let loss_sum = w.traced(
            || "forward+backward of my micro-batches".into(),
            || accumulate_micro_batches(s, &vars, step, s.my_micro_batches(), self.recompute, &mut self.grads),
        )?;
        drop(vars);

        // 2. all-reduce: the sum over ranks (its reduce-scatter adds with `sum_received`), then the mean
        let grads = match self.reduce {
            Reduce::Ordered => w.all_reduce_sum(&mut self.grads, &mut self.grad_shard),
            Reduce::Native => w.all_reduce_native(&mut self.grads.sums()[0]),
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
        let mut t = self.state_rows(s);
        let simulated = simulated_ranks.is_some(); // --accumulate: no all-to-all
        t.add("grad shard", self.grad_shard.len(), 4, "my 1/N inside the ordered all-reduce");
        if let Some(len) = s.receive_buffer_len(padded).filter(|_| self.reduce == Reduce::Ordered && !simulated) {
            t.add("all-to-all receive buffer", len, 4, "the reduce-scatter's input from every rank, kept");
        }
        s.data_tally(&mut t);
        let mut moments = self.whole_moments(s, s.my_micro_batches().len());
        if groups > 1 && !simulated {
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

    /// What a replica keeps: the fp32 params, AdamW's `m` and `v`, the gradient sums.
    pub(crate) fn state_rows(&self, s: &Session) -> MemoryTally {
        let numel = s.table.numel();
        let padded = ShardLayout::new(numel, s.world.size()).padded;
        let mut t = MemoryTally::new();
        t.add("params (fp32)", numel, 4, "full copy on every rank")
            .add("AdamW m", numel, 4, "full")
            .add("AdamW v", numel, 4, "full")
            .add("grad sums (fp32)", s.sum_groups.buffers() * padded, 4, &sums_note(s.sum_groups.buffers()));
        t
    }

    /// The moments of `whole` micro-batches collected whole (none for 0),
    /// each one's backward beside the compute copy.
    pub(crate) fn whole_moments(&self, s: &Session, whole: usize) -> Vec<Moment> {
        let (e, add) = (self.precision.bytes(), "adding a micro-batch's gradients to the sum");
        match whole {
            0 => vec![],
            _ => s.whole_model_moments(e, self.recompute, "a micro-batch", add, &mut |_, m| self.vars_row(s, m)),
        }
    }

    /// The compute copy's row, in every moment of the step.
    pub(crate) fn vars_row(&self, s: &Session, m: &mut Moment) {
        let vars_row = format!("params as candle Vars ({})", self.precision);
        m.add(&vars_row, s.table.numel(), self.precision.bytes(), "compute copy, rebuilt each step");
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
