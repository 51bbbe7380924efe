//! # Lesson 03 — the answers to `src/exercises.rs`
//!
//! The lesson runs these unless `--mine K` switches exercise 3.K to yours.
use anyhow::Context;
use candle_core::{Tensor, Var};
use fsdp_comm::{Comm, ExactSquares, MicroBatchSum, World};
use fsdp_gpt::model::BlockTape;
use fsdp_gpt::params::PARAMS_PER_BLOCK;
use fsdp_harness::Session;

use crate::units::FsdpUnit;

/// 3.1: each of the unit's blocks recomputed on a tape (chapter 01's), then
/// the upstream gradient pulled back through the tapes, last block first:
/// each block's backward gives its weights' gradients and its input's, the
/// bits of one backward through the whole graph (and lesson 01's). The
/// micro-batch's slot of the sum is taken once its first gradients exist,
/// and each block's gradients go onto it as soon as they are made.
pub fn backward_entry(
    s: &Session,
    unit: &FsdpUnit,
    p: &[Var],
    inputs: &[Tensor],
    upstream: &mut [Tensor],
) -> anyhow::Result<MicroBatchSum> {
    let detached: Vec<Tensor> = p.iter().map(|v| v.as_detached_tensor()).collect(); // a tape needs no graph
    let block = |b: usize| b * PARAMS_PER_BLOCK..(b + 1) * PARAMS_PER_BLOCK;
    let mut sum = s.grad_sum(unit.layout().padded);
    for (x, g) in inputs.iter().zip(upstream.iter_mut()) {
        let mut tapes = Vec::with_capacity(unit.blocks());
        let mut x = x.clone();
        for b in 0..unit.blocks() {
            let (y, tape) = s.model.block_taped(&detached[block(b)], &x)?; // recompute, keeping the tape
            tapes.push(tape);
            x = y;
        }
        drop(x); // the unit's output: forward already passed it on
        // Pulls g back through block b's tape (dropping it): the block's gradients, by parameter entry.
        let back = |b: usize, tape: BlockTape, g: &mut Tensor| -> anyhow::Result<Vec<(usize, Tensor)>> {
            let (dx, grads) = tape.backward(g)?;
            *g = dx; // the block below's upstream gradient
            Ok(unit.params()[block(b)].iter().copied().zip(grads).collect())
        };
        let mut tapes = tapes.into_iter().enumerate().rev();
        let (last, tape) = tapes.next().context("a unit of no blocks has no backward")?;
        let grads = back(last, tape, g)?;
        let mut slot = sum.begin(); // the micro-batch's slot of the sum, once its first gradients exist
        unit.add_grads(&grads, slot.gradient())?;
        drop(grads);
        for (b, tape) in tapes {
            unit.add_grads(&back(b, tape, g)?, slot.gradient())?;
        }
        slot.done(0..slot.len());
        slot.finish();
    }
    Ok(sum)
}

/// 3.2: each element squared exactly and added into one fixed-point
/// integer, then every rank's integer added (exact: any order, the same
/// bits); only the square root rounds.
pub fn global_norm(comm: &Comm, shards: &[&[f32]]) -> f64 {
    let mut mine = ExactSquares::default();
    for g in shards {
        mine.merge(&ExactSquares::of(g));
    }
    comm.exact_sum(&mine).norm()
}

/// 3.3: the leaf pushed into the unit's sum; after my last micro-batch the
/// sum reduce-scattered, then dropped.
pub fn no_sync_hand_off(w: &World, unit: &mut FsdpUnit, held: &mut Option<MicroBatchSum>, leaf: Vec<f32>, last: bool) {
    let sum = held.as_mut().expect("a unit's sum lives until my last micro-batch");
    sum.push(leaf); // this micro-batch's gradient, into the tree
    if last {
        unit.reduce_scatter(w, sum); // my shard of the sum over all ranks
        *held = None; // the unit's unsharded gradient, freed
    }
}
