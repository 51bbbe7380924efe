//! # Lesson 02 — whole-model shard: the classic FSDP toy
//!
//! Each rank keeps only **its shard** — 1/N of the flat fp32 parameter
//! vector — and only its shard of AdamW's `m` and `v`. Each step:
//!
//! 1. **all-gather** the shards into the full weight vector and load it into the model;
//! 2. **forward/backward** on this rank's micro-batches;
//! 3. **all-reduce** the gradient (the pairwise sum over ranks, then the mean);
//! 4. **update** — AdamW on *only* this rank's shard.
//!
//! AdamW is elementwise, so the owner of an element cannot change its new
//! value: the weights are lesson 01's, bit for bit. `--check` proves it every
//! step against a fully replicated reference fed the same gradient
//! ([`crate::check`]); DDP's buckets for the all-reduce are [`crate::buckets`].
use std::borrow::Cow;

use fsdp_comm::{MicroBatchSum, ShardLayout, World};
use fsdp_gpt::AdamW;
use fsdp_harness::checkpoint::ShardPiece;
use fsdp_harness::{MemoryTally, MemoryTimeline, Moment, Session, Start, exercise};

/// One rank's share of the training state.
pub struct WholeModelShard {
    pub layout: ShardLayout,
    /// My shard of the fp32 parameters (the "master" weights), padding included.
    pub(crate) master: Vec<f32>,
    /// AdamW over my shard only: `m` and `v` are 1/N of the model each.
    pub(crate) opt: AdamW,
    /// The all-gather's output: the full, padded parameter vector.
    pub(crate) gathered: Vec<f32>,
    /// The sum of my micro-batches' full gradients, padded, and my shard of
    /// it inside the all-reduce.
    pub(crate) grads: MicroBatchSum,
    grad_shard: Vec<f32>,
    /// `--recompute`: activation checkpointing, block by block.
    pub(crate) recompute: bool,
}

/// My shard of the master weights and of AdamW's state, read from the
/// start: the first part of a [`WholeModelShard`], before its buffers.
pub struct MyShard {
    layout: ShardLayout,
    master: Vec<f32>,
    opt: AdamW,
}

impl MyShard {
    pub fn layout(&self) -> ShardLayout {
        self.layout
    }
}

impl WholeModelShard {
    pub fn new(s: &Session, start: &Start, recompute: bool) -> anyhow::Result<Self> {
        Ok(Self::from_shard(s, Self::read_shard(s, start)?, recompute))
    }

    /// My slice of the initial weights (or of the checkpoint's), and AdamW's
    /// state over it: computed from the seed, or read where it lies.
    pub fn read_shard(s: &Session, start: &Start) -> anyhow::Result<MyShard> {
        let (rank, n) = (s.world.rank(), s.world.size());
        let layout = ShardLayout::new(s.table.numel(), n);
        let mine = layout.shard(rank).offset..layout.shard(rank).offset + layout.real_len(rank);
        let mine = std::slice::from_ref(&mine);
        let master = layout.pad(start.weights(mine)?); // padding: zeros that no parameter uses
        // nanoGPT's decay rule on my window of the flat vector (pieces of several tensors)
        let mut opt =
            AdamW::new(s.adamw, layout.shard_len).with_no_decay(s.table.no_decay_in(layout.shard(rank).range()));
        if let Some(r) = start.moments(mine)? {
            (opt.m, opt.v, opt.t) = (layout.pad(r.m), layout.pad(r.v), r.t);
        }
        Ok(MyShard { layout, master, opt })
    }

    /// My shard with the step's whole-model buffers around it, and the
    /// all-reduce's receive buffer allocated now (the tally counts it kept).
    pub fn from_shard(s: &Session, shard: MyShard, recompute: bool) -> Self {
        s.reserve_receive_buffer(shard.layout.padded, false);
        let len = shard.layout.shard_len;
        Self::assemble(s, shard, recompute, len)
    }

    /// The buffers around `shard`, with `grad_shard_len` elements of
    /// gradient shard inside the all-reduce (none with buckets: they have their own).
    pub(crate) fn assemble(s: &Session, shard: MyShard, recompute: bool, grad_shard_len: usize) -> Self {
        let MyShard { layout, master, opt } = shard;
        Self {
            layout,
            master,
            opt,
            gathered: vec![0.0; layout.padded],
            grads: s.grad_sum(layout.padded).preallocated(),
            grad_shard: vec![0.0; grad_shard_len],
            recompute,
        }
    }

    // ANCHOR: step
    /// One training step; returns the mean loss over the global batch.
    pub fn step(&mut self, s: &Session, step: u64, tl: &mut MemoryTimeline) -> anyhow::Result<f32> {
        let (w, numel) = (s.world, self.layout.numel);

        // 1. all-gather: every rank's shard → the full weight vector
        w.all_gather(&self.master, &mut self.gathered);
        let vars = s.model.vars_from_flat(&s.table, &self.gathered[..numel])?;
        let all: Vec<usize> = (0..vars.len()).collect();
        tl.mark("all-gather the whole model");

        // 2. forward/backward on my micro-batches
        self.grads.reset();
        let mut loss_sum = 0.0;
        for k in s.my_micro_batches() {
            let (loss, grads) = w.traced(
                || format!("forward+backward, micro-batch {k}"),
                || s.forward_backward(&vars, step, k, self.recompute),
            )?;
            self.grads.add(|sum| grads.add_to(&all, &vars, &mut sum[..numel]))?;
            loss_sum += loss as f64;
            tl.mark(format!("forward+backward, micro-batch {k}"));
        }
        drop(vars); // the full copy is not needed again this step
        tl.mark("drop the full copy");

        // 3. all-reduce: the sum over ranks, then the mean
        let grads = w.all_reduce_sum(&mut self.grads, &mut self.grad_shard);
        let inv = 1.0 / s.sampler.micro_batches as f32;
        grads.iter_mut().for_each(|g| *g *= inv);
        s.clip_whole(&mut grads[..numel]); // --grad-clip: the all-reduce left the whole gradient here
        tl.mark("all-reduce the gradient");

        // 4. update: AdamW on my shard only (exercise 2.1)
        w.traced(
            || "AdamW update".into(),
            || exercise!(2, 1, update_my_shard(&mut self.opt, &mut self.master, grads, self.layout, w.rank())),
        );
        tl.mark("AdamW on my shard");
        Ok((w.sum_f64(&[loss_sum])[0] / s.sampler.micro_batches as f64) as f32)
    }
    // ANCHOR_END: step

    /// The full weights, gathered (every rank calls; all get them).
    pub fn gather_full(&mut self, w: &World) -> &[f32] {
        w.all_gather(&self.master, &mut self.gathered);
        &self.gathered[..self.layout.numel]
    }

    /// My shard of the master weights, `m` and `v`, for a checkpoint.
    pub fn checkpoint_pieces(&self, s: &Session) -> Vec<ShardPiece<'_>> {
        vec![ShardPiece::flat(
            &s.table,
            Cow::Borrowed(&self.master),
            Cow::Borrowed(&self.opt.m),
            Cow::Borrowed(&self.opt.v),
        )]
    }

    // ANCHOR: tally
    /// Bytes this rank holds, by category, from shapes: its shards, the
    /// whole-model buffers of the step, and the step's peak (a micro-batch's
    /// backward). `--check`'s replicated reference is a diagnostic, apart
    /// ([`crate::check::Reference::tally_apart`]).
    pub fn tally(&self, s: &Session) -> MemoryTally {
        let l = self.layout;
        let groups = s.sum_groups.per_rank();
        let mut t = self.state_rows(s);
        t.add("grad shard", l.shard_len, 4, "my 1/N inside the ordered all-reduce");
        if let Some(len) = s.receive_buffer_len(l.padded) {
            t.add("all-to-all receive buffer", len, 4, "the reduce-scatter's input from every rank, kept");
        }
        s.data_tally(&mut t);
        let mut moments = self.whole_moments(s, s.my_micro_batches().len());
        if groups > 1 {
            let mut m = Moment::new("all-reduce of several group sums");
            m.add("send buffer", groups * l.padded, 4, "group sums packed per destination");
            moments.push(m);
        }
        t.peak(moments);
        t
    }

    /// What a rank keeps: its shards, and the step's whole-model buffers.
    pub(crate) fn state_rows(&self, s: &Session) -> MemoryTally {
        let l = self.layout;
        let mut t = MemoryTally::new();
        let share = format!("1/{} of the model", l.world);
        t.add("master params shard (fp32)", l.shard_len, 4, &share)
            .add("AdamW m shard", l.shard_len, 4, &share)
            .add("AdamW v shard", l.shard_len, 4, &share)
            .add("gathered full params", l.padded, 4, "all-gather output, full copy, kept")
            .add("grad sums (fp32)", s.sum_groups.buffers() * l.padded, 4, "full, all-reduced");
        t
    }

    /// The moments of `whole` micro-batches collected whole (none for 0),
    /// each one's backward beside the full compute copy.
    pub(crate) fn whole_moments(&self, s: &Session, whole: usize) -> Vec<Moment> {
        let add = "adding a micro-batch's gradients to the sum";
        match whole {
            0 => vec![],
            _ => s.whole_model_moments(4, self.recompute, "a micro-batch", add, &mut |_, m| self.vars_row(m)),
        }
    }
    // ANCHOR_END: tally

    /// The compute copy's row, in every moment of the step.
    pub(crate) fn vars_row(&self, m: &mut Moment) {
        m.add("params as candle Vars", self.layout.numel, 4, "compute copy, full");
    }
}
