//! # Lesson 04 — optimizer-state shard: ZeRO stages 1, 2 and 3
//!
//! In mixed precision each parameter costs ~16 bytes: a 2-byte bf16 weight
//! and a 2-byte bf16 gradient to compute with, and 12 bytes of fp32 master
//! weight, AdamW momentum and variance to update with. ZeRO shards them in
//! three stages, each keeping more of it 1/N per rank:
//!
//! | stage | sharded | the step |
//! |---|---|---|
//! | 1 | fp32 master, `m`, `v` | whole-model forward/backward on a replicated bf16 copy; reduce-scatter the gradient; update my shard; all-gather the new bf16 weights |
//! | 2 | + gradients | backward unit by unit, each unit's gradient reduce-scattered and freed at once; the bf16 copy still replicated |
//! | 3 | + parameters | lesson 03: every unit gathered just in time (in bf16: half the bytes), freed after use |
//!
//! The stages share everything but *where the compute copy lives*: stages 1
//! and 2 keep each unit's copy unsharded between steps (FSDP2's
//! `reshard_after_forward=False`, see [`UnitPolicy`]), stage 3 gathers it. Stages 2 and 3 are lesson 03's [`LayerwiseShard`], reused;
//! stage 1 is the whole-graph step below. All three give lesson 01's weights
//! under the same precision, bit for bit.
use candle_core::Var;
use fsdp_comm::MicroBatchSum;
use fsdp_gpt::Precision;
use fsdp_gpt::model::add_grads;
use fsdp_harness::{MemoryTimeline, Session, Start};
use step03_layerwise_shard::LayerwiseShard;
use step03_layerwise_shard::units::{FsdpUnit, UnitPolicy, build_units};

/// One rank's share of the training state at ZeRO stage `stage`.
pub struct OptimizerStateShard {
    pub stage: u8,
    /// The units (one per block, and the root) and lesson 03's schedule over them.
    pub fsdp: LayerwiseShard,
}

impl OptimizerStateShard {
    // ANCHOR: new
    pub fn new(s: &Session, start: Start, stage: u8, precision: Precision, prefetch: bool) -> anyhow::Result<Self> {
        // Stages 1 and 2 keep each unit's compute copy unsharded from step to
        // step (FSDP2: `reshard_after_forward=False`); stage 3 reshards it.
        let policy = UnitPolicy { reshard_after_forward: stage == 3, param_dtype: precision.dtype() };
        let units = build_units(&s.table, s.cfg.n_layer, 1, &start, s.world, s.adamw, policy)?;
        drop(start); // my shards are cut: the whole start state goes
        Ok(Self { stage, fsdp: LayerwiseShard { units, prefetch: prefetch && stage == 3 } })
    }
    // ANCHOR_END: new

    /// One training step; returns the mean loss over the global batch.
    pub fn step(&mut self, s: &Session, step: u64, tl: &mut MemoryTimeline) -> anyhow::Result<f32> {
        match self.stage {
            1 => whole_model_step(&mut self.fsdp.units, s, step, tl),
            _ => self.fsdp.step(s, step, tl), // stages 2 and 3: lesson 03's unit-by-unit step
        }
    }
}

// ANCHOR: stage1
// ANCHOR: step
/// ZeRO-1: forward/backward through the whole replicated compute copy,
/// reduce-scatter the gradient, update my shard, all-gather the new weights.
fn whole_model_step(units: &mut [FsdpUnit], s: &Session, step: u64, tl: &mut MemoryTimeline) -> anyhow::Result<f32> {
    let w = s.world;
    // The resident compute copy as candle Vars, per unit and in model order.
    let per_unit: Vec<Vec<Var>> = units
        .iter()
        .map(|u| Ok(s.model.vars_from_tensor(&s.table, u.params(), &u.unshard(w)?)?))
        .collect::<anyhow::Result<_>>()?;
    let mut in_order: Vec<(usize, Var)> =
        units.iter().zip(&per_unit).flat_map(|(u, vs)| u.params().iter().copied().zip(vs.iter().cloned())).collect();
    in_order.sort_by_key(|(i, _)| *i);
    let vars: Vec<Var> = in_order.into_iter().map(|(_, v)| v).collect();
    tl.mark("compute copy as candle Vars");

    // 1. forward/backward on my micro-batches: the *whole* gradient, summed in fp32
    let mut sums: Vec<MicroBatchSum> = units.iter().map(|u| s.grad_sum(u.layout().padded)).collect(); // one per unit
    let mut loss_sum = 0.0;
    for k in s.my_micro_batches() {
        let (loss, grads) = s.forward_backward(&vars, step, k)?;
        for (sum, vs) in sums.iter_mut().zip(&per_unit) {
            sum.add(|buf| add_grads(&grads, vs, buf))?;
        }
        loss_sum += loss as f64;
        tl.mark(format!("forward+backward, micro-batch {k}"));
    }
    drop((vars, per_unit));

    // 2. reduce-scatter: I keep the rank-ordered sum of my shard, and free the rest
    for (u, sum) in units.iter_mut().zip(&mut sums) {
        u.reduce_scatter(w, sum);
    }
    drop(sums);
    tl.mark("reduce-scatter the gradient");

    // 3. AdamW on my fp32 shard; 4. all-gather the new compute copy (inside `update`)
    let inv = 1.0 / s.sampler.micro_batches as f32;
    for u in units.iter_mut() {
        u.update(w, inv)?;
    }
    tl.mark("AdamW on my shard, all-gather the new weights");
    Ok((w.sum_f64(&[loss_sum])[0] / s.sampler.micro_batches as f64) as f32)
}
// ANCHOR_END: step
// ANCHOR_END: stage1
