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
//! | 2 | + gradients | backward block by block; each unit's gradient reduce-scattered and freed as soon as my last micro-batch's backward completes it; the bf16 copy still replicated |
//! | 3 | + parameters | lesson 03: every unit gathered just in time (in bf16: half the bytes), freed after use |
//!
//! The stages share everything but *where the compute copy lives*: stages 1
//! and 2 keep each unit's copy unsharded between steps (FSDP2's
//! `reshard_after_forward=False`, see [`build_units`]), stage 3 gathers it.
//! Stage 3 is lesson 03's [`LayerwiseShard`], reused, and so always
//! recomputes (a unit's graph would hold its gathered weights alive);
//! stages 1 and 2 keep the activations for backward unless `--recompute`
//! (the same mechanism, [`fsdp_gpt::blockwise`], in lessons 01 and 02).
//! All give lesson 01's weights under the same precision, bit for bit.
use candle_core::Var;
use fsdp_comm::MicroBatchSum;
use fsdp_gpt::Precision;
use fsdp_gpt::blockwise;
use fsdp_harness::{MemoryTimeline, Session, Start, exercise};
use step03_layerwise_shard::hsdp::UnitComms;
use step03_layerwise_shard::mixed_precision::MixedPrecision;
use step03_layerwise_shard::prefetch::prefetch_within_budget;
use step03_layerwise_shard::prefetch::{Prefetch, PrefetchAsked, one_in_flight, reduce_on_stream};
use step03_layerwise_shard::tally::reserve_receive_buffers;
use step03_layerwise_shard::units::{FsdpUnit, build_units, update_all};
use step03_layerwise_shard::{HeadGrad, LayerwiseShard, schedule};

/// The overlap flags as the command line gives them, each refused where it
/// does not apply: stage 3's `--prefetch` (and `--prefetch-depth`), stages
/// 1 and 2's `--overlap-comm`. What they do is `overlap.rs`'s.
#[derive(Debug, Clone, Copy)]
pub struct Overlap {
    pub prefetch: PrefetchAsked,
    pub overlap_comm: bool,
}

/// One rank's share of the training state at ZeRO stage `stage`.
pub struct OptimizerStateShard<'w> {
    pub stage: u8,
    /// `--recompute` (stages 1 and 2; stage 3 always recomputes).
    pub recompute: bool,
    /// `--overlap-comm` (stages 1 and 2, DeepSpeed's `overlap_comm`: `overlap.rs`).
    pub overlap_comm: bool,
    /// Stage 3's `--prefetch`: lesson 03's plan of the gathers handed to the stream.
    pub prefetch: Option<Prefetch>,
    /// The units (one per block, and the root) and lesson 03's schedule over them.
    pub fsdp: LayerwiseShard<'w>,
}

impl<'w> OptimizerStateShard<'w> {
    // ANCHOR: new
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        s: &Session,
        start: Start,
        stage: u8,
        precision: Precision,
        comms: UnitComms<'w>, // the world's, or under `--hsdp S` the mesh's (lesson 03's)
        recompute: bool,
        head_grad: Option<HeadGrad>,
        overlap: Overlap, // FSDP2's at stage 3 (`--prefetch`), DeepSpeed's `overlap_comm` at 1 and 2
    ) -> anyhow::Result<Self> {
        // Stages 1 and 2 keep each unit's compute copy unsharded from step to
        // step (FSDP2: `reshard_after_forward=False`); stage 3 reshards it.
        // bf16 travels as each element's rounded bits (exercise 4.2).
        let mp = MixedPrecision { param_dtype: precision.dtype(), bf16_wire };
        let mut units = build_units(s, 1, &start, comms, stage == 3, mp)?;
        if overlap.on_stream(stage) {
            reduce_on_stream(&mut units);
        }
        drop(start); // my shards are read: the start's source goes
        reserve_receive_buffers(s, &units); // on the stream's thread when it reduces
        // Stage 3 runs lesson 03's schedule: how far it prefetches, memory
        // allowing, and what waits for the tied wte (lesson 03's defaults).
        let (depth, head_grad) = match stage {
            3 => prefetch_within_budget(s, &units, overlap.prefetch, head_grad),
            _ => (0, HeadGrad::Keep), // unused: stages 1 and 2 run their own schedules
        };
        let prefetch = (depth > 0).then(|| Prefetch::new(&schedule(units.len() - 1, head_grad), depth));
        let overlap_comm = overlap.overlap_comm && stage < 3;
        Ok(Self { stage, recompute, overlap_comm, prefetch, fsdp: LayerwiseShard { units, head_grad } })
    }
    // ANCHOR_END: new

    /// One training step, every collective blocking; returns the mean loss
    /// over the global batch (with the overlap flags: `overlap.rs`).
    pub fn step(&mut self, s: &Session, step: u64, tl: &mut MemoryTimeline) -> anyhow::Result<f32> {
        match self.stage {
            1 => whole_model_step(&mut self.fsdp.units, s, step, self.recompute, tl),
            2 => blockwise_step(&mut self.fsdp.units, s, step, self.recompute, tl),
            _ => self.fsdp.step(s, step, tl), // stage 3: lesson 03's unit-by-unit step
        }
    }
}

// ANCHOR: stage1
// ANCHOR: step
/// ZeRO-1: forward/backward through the whole replicated compute copy,
/// reduce-scatter the gradient, update my shard, all-gather the new weights.
fn whole_model_step(
    units: &mut [FsdpUnit],
    s: &Session,
    step: u64,
    recompute: bool,
    tl: &mut MemoryTimeline,
) -> anyhow::Result<f32> {
    let w = s.world;
    let (per_unit, vars) = resident_vars(units, s)?;
    tl.mark("compute copy as candle Vars");

    // 1. forward/backward on my micro-batches: the *whole* gradient, summed in fp32
    let mut sums: Vec<MicroBatchSum> = units.iter().map(|u| s.grad_sum(u.layout().padded)).collect(); // one per unit
    let mut loss_sum = 0.0;
    for k in s.my_micro_batches() {
        let (loss, grads) = w.traced(
            || format!("forward+backward, micro-batch {k}"),
            || s.forward_backward(&vars, step, k, recompute),
        )?;
        for ((sum, vs), u) in sums.iter_mut().zip(&per_unit).zip(units.iter()) {
            sum.add(|buf| grads.add_to(u.params(), vs, buf))?;
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
    w.traced(|| "AdamW update".into(), || update_all(units, s, 1.0 / s.sampler.micro_batches as f32))?;
    tl.mark("AdamW on my shard, all-gather the new weights");
    Ok((w.sum_f64(&[loss_sum])[0] / s.sampler.micro_batches as f64) as f32)
}
// ANCHOR_END: step
// ANCHOR_END: stage1

/// Micro-batch `k` block by block through the resident compute copy `vars`:
/// as the backward completes a unit's gradients, `hand` gets the unit, its
/// sum and the gradients — with at most one reduce-scatter in flight
/// ([`one_in_flight`]), so that no more than one unit's sum travels at once.
#[allow(clippy::too_many_arguments)]
pub(crate) fn hand_offs(
    units: &mut [FsdpUnit],
    sums: &mut [Option<MicroBatchSum>],
    s: &Session,
    vars: &[Var],
    step: u64,
    k: usize,
    recompute: bool,
    mut hand: impl FnMut(
        &mut FsdpUnit,
        &mut Option<MicroBatchSum>,
        &[(usize, candle_core::Tensor)],
    ) -> fsdp_gpt::error::Result<()>,
) -> anyhow::Result<f32> {
    let w = s.world;
    let batch = s.sampler.micro_batch(step, k)?;
    let mut reducing = None; // the unit whose reduce-scatter is in flight
    Ok(w.traced(
        || format!("forward+backward, micro-batch {k}"),
        || {
            blockwise::forward_backward(&s.model, &s.table, vars, &batch, recompute, |_, grads| {
                let u = unit_of(units, &grads);
                one_in_flight(units, &mut reducing, u, w);
                hand(&mut units[u], &mut sums[u], &grads)
            })
        },
    )?)
}

/// The unit whose gradients a block-by-block backward hands on (each block,
/// and the root, is a unit of its own at stages 1 and 2).
fn unit_of(units: &[FsdpUnit], grads: &[(usize, candle_core::Tensor)]) -> usize {
    let u = units.iter().position(|u| u.params().contains(&grads[0].0)).expect("every gradient has a unit");
    assert!(units[u].blocks() <= 1, "a hand-off needs one block per unit");
    u
}

// ANCHOR: stage2
/// ZeRO-2: one micro-batch at a time through the resident compute copy,
/// block by block ([`blockwise`]). A unit's gradient sum is complete once my
/// last micro-batch's backward has passed all of it: it is reduce-scattered
/// at that moment and freed, while the blocks below still compute. (With one
/// micro-batch per rank the whole gradient never exists at once; with more,
/// each unit's sum lives from the first micro-batch to that hand-off.)
pub(crate) fn blockwise_step(
    units: &mut [FsdpUnit],
    s: &Session,
    step: u64,
    recompute: bool,
    tl: &mut MemoryTimeline,
) -> anyhow::Result<f32> {
    let w = s.world;
    let (per_unit, vars) = resident_vars(units, s)?;
    drop(per_unit); // `vars` holds the same tensors, in model order
    tl.mark("compute copy as candle Vars");
    let mut sums: Vec<Option<MicroBatchSum>> = units.iter().map(|u| Some(s.grad_sum(u.layout().padded))).collect();
    let last = s.my_micro_batches().end - 1;
    let mut loss_sum = 0.0;
    for k in s.my_micro_batches() {
        let loss = hand_offs(units, &mut sums, s, &vars, step, k, recompute, |unit, sum, grads| {
            // Add to the unit's sum; after my last micro-batch, reduce-scatter it
            // (on the stream under --overlap-comm) and free it (exercise 4.1).
            exercise!(4, 1, hand_off(w, unit, sum, grads, k == last))
        })?;
        loss_sum += loss as f64;
        tl.mark(format!("forward+backward, micro-batch {k}, units reduce-scattered after the last"));
    }
    // Stage 2's promise: after the hand-offs no unit's full gradient sum is left.
    anyhow::ensure!(
        sums.iter().all(Option::is_none),
        "exercise 4.1: a unit's gradient sum is still held after my last micro-batch: the hand-off must reduce-scatter it, then free it (set it to None)"
    );
    drop(vars);

    // AdamW on my fp32 shard; all-gather the new compute copy (inside `update`).
    w.traced(|| "AdamW update".into(), || update_all(units, s, 1.0 / s.sampler.micro_batches as f32))?;
    tl.mark("AdamW on my shard, all-gather the new weights");
    Ok((w.sum_f64(&[loss_sum])[0] / s.sampler.micro_batches as f64) as f32)
}
// ANCHOR_END: stage2

/// The resident compute copy as candle Vars: per unit, and in model order.
pub(crate) fn resident_vars(units: &[FsdpUnit], s: &Session) -> anyhow::Result<(Vec<Vec<Var>>, Vec<Var>)> {
    let per_unit: Vec<Vec<Var>> = units
        .iter()
        .map(|u| Ok(s.model.vars_from_tensor(&s.table, u.params(), &u.unshard()?)?))
        .collect::<anyhow::Result<_>>()?;
    let mut in_order: Vec<(usize, Var)> =
        units.iter().zip(&per_unit).flat_map(|(u, vs)| u.params().iter().copied().zip(vs.iter().cloned())).collect();
    in_order.sort_by_key(|(i, _)| *i);
    Ok((per_unit, in_order.into_iter().map(|(_, v)| v).collect()))
}

/// The bf16 bits a unit's all-gather sends: exercise 4.2, the learner's
/// under `--mine 2` ([`MixedPrecision::bf16_wire`]).
fn bf16_wire(shard: &[f32]) -> Vec<u16> {
    exercise!(4, 2, to_bf16_bits(shard))
}
