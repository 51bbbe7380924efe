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
//! step against a fully replicated reference fed the same gradient.
use std::borrow::Cow;

use fsdp_comm::{MicroBatchSum, ShardLayout, World};
use fsdp_gpt::AdamW;
use fsdp_harness::checkpoint::ShardPiece;
use fsdp_harness::{MemoryTally, MemoryTimeline, Moment, Session, Start, exercise};
use step01_data_parallel::{Buckets, backward_in_buckets};

/// One rank's share of the training state.
pub struct WholeModelShard {
    pub layout: ShardLayout,
    /// My shard of the fp32 parameters (the "master" weights), padding included.
    master: Vec<f32>,
    /// AdamW over my shard only: `m` and `v` are 1/N of the model each.
    opt: AdamW,
    /// The all-gather's output: the full, padded parameter vector.
    gathered: Vec<f32>,
    /// The sum of my micro-batches' full gradients, padded, and my shard of
    /// it inside the all-reduce.
    grads: MicroBatchSum,
    grad_shard: Vec<f32>,
    /// `--check`: a fully replicated copy (lesson 01's state) fed the same gradient.
    reference: Option<Reference>,
    /// `--recompute`: activation checkpointing, block by block.
    recompute: bool,
    /// `--check-probe`: a known fault planted in the reference ([`plant_fault`]).
    pub probe: bool,
    /// `--bucket-mb`: the all-reduce in buckets during my last micro-batch's
    /// backward, on the communication stream (lesson 01's DDP buckets).
    buckets: Option<Buckets>,
}

/// The replicated reference of `--check`.
struct Reference {
    params: Vec<f32>,
    opt: AdamW,
}

/// What one step reports.
pub struct StepResult {
    pub loss: f32,
    /// `--check` only: the replicated reference's loss on the same batch.
    pub reference_loss: Option<f32>,
    /// `--check` only: max |sharded − replicated| over all elements of all ranks.
    pub divergence: Option<f32>,
}

impl WholeModelShard {
    /// `bucket_bytes`: `--bucket-mb`, in bytes (the stream must be started).
    pub fn new(
        s: &Session,
        start: &Start,
        check: bool,
        recompute: bool,
        bucket_bytes: Option<usize>,
    ) -> anyhow::Result<Self> {
        let (rank, n) = (s.world.rank(), s.world.size());
        let layout = ShardLayout::new(s.table.numel(), n);
        // My slice of the initial weights (or of the checkpoint's), and
        // nothing else: computed from the seed, or read where it lies.
        let mine = layout.shard(rank).offset..layout.shard(rank).offset + layout.real_len(rank);
        let mine = std::slice::from_ref(&mine);
        let padded = |mut v: Vec<f32>| {
            v.resize(layout.shard_len, 0.0); // padding: zeros that no parameter uses
            v
        };
        let master = padded(start.weights(mine)?);
        // nanoGPT's decay rule on my window of the flat vector (pieces of several tensors)
        let mut opt =
            AdamW::new(s.adamw, layout.shard_len).with_no_decay(s.table.no_decay_in(layout.shard(rank).range()));
        if let Some(r) = start.moments(mine)? {
            (opt.m, opt.v, opt.t) = (padded(r.m), padded(r.v), r.t);
        }
        let reference = match check {
            false => None,
            true => {
                // --check: lesson 01's whole state beside, a diagnostic.
                let all = 0..layout.numel;
                let all = std::slice::from_ref(&all);
                let mut opt = AdamW::new(s.adamw, layout.numel).with_no_decay(s.table.no_decay_in(0..layout.numel));
                if let Some(r) = start.moments(all)? {
                    (opt.m, opt.v, opt.t) = (r.m, r.v, r.t);
                }
                Some(Reference { params: start.weights(all)?, opt })
            }
        };
        let buckets = bucket_bytes.map(|cap| Buckets::for_session(s, layout.padded, cap));
        match &buckets {
            Some(b) => b.reserve_receive_buffer(s),
            None => s.reserve_receive_buffer(layout.padded, false),
        }
        Ok(Self {
            layout,
            master,
            opt,
            gathered: vec![0.0; layout.padded],
            grads: s.grad_sum(layout.padded).preallocated(),
            grad_shard: if buckets.is_some() { vec![] } else { vec![0.0; layout.shard_len] }, // buckets have their own
            reference,
            recompute,
            probe: false,
            buckets,
        })
    }

    // ANCHOR: step
    pub fn step(&mut self, s: &Session, step: u64, tl: &mut MemoryTimeline) -> anyhow::Result<StepResult> {
        let (w, numel) = (s.world, self.layout.numel);

        // 1. all-gather: every rank's shard → the full weight vector
        w.all_gather(&self.master, &mut self.gathered);
        let vars = s.model.vars_from_flat(&s.table, &self.gathered[..numel])?;
        let all: Vec<usize> = (0..vars.len()).collect();
        tl.mark("all-gather the whole model");

        // 2. forward/backward on my micro-batches (with --bucket-mb, the last in buckets)
        self.grads.reset();
        let mut loss_sum = 0.0;
        let mine = s.my_micro_batches();
        for k in mine.clone() {
            if let Some(b) = self.buckets.as_mut().filter(|_| k + 1 == mine.end) {
                loss_sum += backward_in_buckets(s, &vars, step, k, self.recompute, &mut self.grads, b)? as f64;
            } else {
                let (loss, grads) = w.traced(
                    || format!("forward+backward, micro-batch {k}"),
                    || s.forward_backward(&vars, step, k, self.recompute),
                )?;
                self.grads.add(|sum| grads.add_to(&all, &vars, &mut sum[..numel]))?;
                loss_sum += loss as f64;
            }
            tl.mark(format!("forward+backward, micro-batch {k}"));
        }
        drop(vars); // the full copy is not needed again this step
        tl.mark("drop the full copy");

        // 3. all-reduce: the sum over ranks, then the mean
        let grads = match self.buckets.as_mut() {
            Some(b) => b.all_reduced(w, &mut self.grads), // handed to the stream in the backward
            None => w.all_reduce_sum(&mut self.grads, &mut self.grad_shard),
        };
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

        let m = s.sampler.micro_batches as f64;
        let loss = (w.sum_f64(&[loss_sum])[0] / m) as f32;
        let (reference_loss, divergence) = match self.reference.as_mut() {
            None => (None, None),
            Some(r) => {
                let ref_loss = reference_loss(s, &r.params, step)?;
                r.opt.step(&mut r.params, &self.grads.sums()[0][..numel]);
                if self.probe {
                    plant_fault(&mut r.params, step);
                }
                let d = exercise!(2, 2, divergence(w, &self.master, &r.params, self.layout, w.rank()));
                (Some(ref_loss), Some(d))
            }
        };
        Ok(StepResult { loss, reference_loss, divergence })
    }
    // ANCHOR_END: step

    /// The buckets under `--bucket-mb`.
    pub fn buckets(&self) -> Option<&Buckets> {
        self.buckets.as_ref()
    }

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
    /// backward). `--check`'s replicated reference is a diagnostic, apart.
    pub fn tally(&self, s: &Session) -> MemoryTally {
        let (l, numel) = (self.layout, self.layout.numel);
        let (n, groups) = (l.world, s.sum_groups.per_rank());
        let mut t = MemoryTally::new();
        let share = format!("1/{n} of the model");
        t.add("master params shard (fp32)", l.shard_len, 4, &share)
            .add("AdamW m shard", l.shard_len, 4, &share)
            .add("AdamW v shard", l.shard_len, 4, &share)
            .add("gathered full params", l.padded, 4, "all-gather output, full copy, kept")
            .add("grad sums (fp32)", s.sum_groups.buffers() * l.padded, 4, "full, all-reduced");
        match &self.buckets {
            None => {
                t.add("grad shard", l.shard_len, 4, "my 1/N inside the ordered all-reduce");
                if let Some(len) = s.receive_buffer_len(l.padded) {
                    t.add("all-to-all receive buffer", len, 4, "the reduce-scatter's input from every rank, kept");
                }
            }
            Some(b) => b.tally_rows(s, &mut t),
        }
        s.data_tally(&mut t);
        let vars_note = "compute copy, full";
        let add = "adding a micro-batch's gradients to the sum";
        // With buckets my last micro-batch hands each block's gradient on as its backward ends; the
        // others (all, without) are collected whole.
        let whole = s.my_micro_batches().len() - usize::from(self.buckets.is_some());
        let mut moments = match whole {
            0 => vec![],
            _ => s.whole_model_moments(4, self.recompute, "a micro-batch", add, &mut |_, m| {
                m.add("params as candle Vars", numel, 4, vars_note);
            }),
        };
        if let Some(b) = &self.buckets {
            moments.extend(b.last_micro_batch_moments(s, 4, self.recompute, &mut |m| {
                m.add("params as candle Vars", numel, 4, vars_note);
            }));
        }
        if groups > 1 && self.buckets.is_none() {
            let mut m = Moment::new("all-reduce of several group sums");
            m.add("send buffer", groups * l.padded, 4, "group sums packed per destination");
            moments.push(m);
        }
        t.peak(moments);
        if self.reference.is_some() {
            t.apart("--check reference", 3 * numel, 4, "replicated params, m, v: lesson 01's state, to compare");
        }
        t
    }
    // ANCHOR_END: tally
}

/// The loss of the replicated reference on this step's global batch
/// (forward only, without a graph: it keeps no activations).
fn reference_loss(s: &Session, params: &[f32], step: u64) -> anyhow::Result<f32> {
    let vars = s.model.vars_from_flat(&s.table, params)?;
    let ps: Vec<_> = vars.iter().map(|v| v.as_detached_tensor()).collect();
    let mut sum = 0.0;
    for k in s.my_micro_batches() {
        let b = s.sampler.micro_batch(step, k)?;
        let logits = s.model.forward(&s.table, &ps, &b.inputs)?;
        sum += fsdp_gpt::model::loss(&logits, &b.targets)?.to_scalar::<f32>()? as f64;
    }
    Ok((s.world.sum_f64(&[sum])[0] / s.sampler.micro_batches as f64) as f32)
}

/// `--check-probe`, for exercise 2.2's check: `--check` must see a fault in
/// the last rank's shard — the last parameter of the replicated reference
/// moved by 2⁻¹⁰ after step 2, made NaN after step 3.
fn plant_fault(params: &mut [f32], step: u64) {
    if let Some(last) = params.last_mut() {
        match step {
            2 => *last += 1.0 / 1024.0,
            3 => *last = f32::NAN,
            _ => {}
        }
    }
}
