//! Overlap in lesson 04 — communication on the stream while compute goes on:
//! at stage 3, lesson 03's `--prefetch` (FSDP2's); at stages 1 and 2,
//! DeepSpeed's `overlap_comm` (`--overlap-comm`): each unit's reduce-scatter
//! handed to the communication stream as soon as my last micro-batch's
//! backward completes its sum, while the blocks below still compute. The
//! blocking steps of `optimizer_state_shard.rs` are the idea; this is them
//! with the waits moved.
use fsdp_comm::MicroBatchSum;
use fsdp_harness::{MemoryTimeline, Session};
use step03_layerwise_shard::units::{FsdpUnit, update_all};

use crate::optimizer_state_shard::{OptimizerStateShard, Overlap, blockwise_step, hand_offs, resident_vars};

impl Overlap {
    /// Whether stage `stage`'s reduce-scatters go to the communication stream.
    pub fn on_stream(&self, stage: u8) -> bool {
        let (prefetch, overlap_comm) =
            (if stage == 3 { self.prefetch.depth } else { 0 }, self.overlap_comm && stage < 3);
        prefetch > 0 || overlap_comm
    }
}

impl OptimizerStateShard<'_> {
    /// Whether a step overlaps (then [`OptimizerStateShard::overlapped_step`]).
    pub fn overlapped(&self) -> bool {
        self.overlap_comm || self.prefetch.is_some()
    }

    /// Entries gathered ahead at stage 3 (0 without `--prefetch`).
    pub fn prefetch_depth(&self) -> usize {
        self.prefetch.as_ref().map_or(0, |p| p.depth)
    }

    /// One training step with the overlap flags: stage 1's whole-model step
    /// with its last micro-batch handed on unit by unit, stage 2's (whose
    /// hand-offs go to the stream), stage 3's lesson 03 `--prefetch` step.
    pub fn overlapped_step(&mut self, s: &Session, step: u64, tl: &mut MemoryTimeline) -> anyhow::Result<f32> {
        match (self.stage, &self.prefetch) {
            (1, _) => overlapped_whole_model_step(&mut self.fsdp.units, s, step, self.recompute, tl),
            (2, _) => blockwise_step(&mut self.fsdp.units, s, step, self.recompute, tl),
            (_, Some(plan)) => self.fsdp.overlapped_step(s, step, tl, plan),
            (_, None) => self.fsdp.step(s, step, tl),
        }
    }
}

// ANCHOR: overlapped_stage1
/// ZeRO-1 under `--overlap-comm`: the step of `optimizer_state_shard.rs`,
/// but my last micro-batch runs block by block, and each unit's sum goes to
/// the stream as soon as that backward completes it.
fn overlapped_whole_model_step(
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
    let mut sums: Vec<Option<MicroBatchSum>> = units.iter().map(|u| Some(s.grad_sum(u.layout().padded))).collect(); // one per unit
    let (mut loss_sum, last) = (0.0, s.my_micro_batches().end - 1);
    for k in s.my_micro_batches() {
        let loss = if k == last {
            hand_offs(units, &mut sums, s, &vars, step, k, recompute, |unit, sum, grads| {
                let mut sum = sum.take().expect("a unit is handed on once");
                sum.add(|buf| unit.add_grads(grads, buf))?;
                unit.reduce_scatter(w, &mut sum); // on the stream; the sum's buffers go with it
                Ok(())
            })?
        } else {
            let (loss, grads) = w.traced(
                || format!("forward+backward, micro-batch {k}"),
                || s.forward_backward(&vars, step, k, recompute),
            )?;
            for ((sum, vs), u) in sums.iter_mut().flatten().zip(&per_unit).zip(units.iter()) {
                sum.add(|buf| grads.add_to(u.params(), vs, buf))?;
            }
            loss
        };
        loss_sum += loss as f64;
        tl.mark(format!("forward+backward, micro-batch {k}"));
    }
    drop((vars, per_unit));

    // 2. reduce-scatter: I keep the rank-ordered sum of my shard, and free the rest
    for (u, sum) in units.iter_mut().zip(&mut sums) {
        if let Some(sum) = sum {
            u.reduce_scatter(w, sum); // any not yet handed on (the backward hands on every unit)
        }
    }
    drop(sums);
    tl.mark("reduce-scatter the gradient");

    // 3. AdamW on my fp32 shard; 4. all-gather the new compute copy (inside `update`)
    w.traced(|| "AdamW update".into(), || update_all(units, s, 1.0 / s.sampler.micro_batches as f32))?;
    tl.mark("AdamW on my shard, all-gather the new weights");
    Ok((w.sum_f64(&[loss_sum])[0] / s.sampler.micro_batches as f64) as f32)
}
// ANCHOR_END: overlapped_stage1
