//! # Lesson 03 exercises — your code, inside the real step
//!
//! Each function below is a piece of lesson 03's step. The step calls the
//! answer (`solutions/exercises.rs`) unless you switch it to yours:
//!
//! ```text
//! just step 03 4 --mine 1      # lesson 03 on 4 ranks, exercise 3.1 with your code
//! just exercise 03-1           # the same run, checked bit for bit against the committed snapshot
//! just step 03 4               # back to the answers
//! ```
//!
//! Replace a `todo!()` under `TODO(exercise)` with your code. The check
//! compares your run's losses, each unit's gradient (a digest of rank 0's
//! shard, every step: the first that differs is named), the gradient norms
//! (3.2's run clips), bytes sent and final weights with the committed
//! snapshot, bit for bit. Hints are in the book's chapter 03.
#![allow(dead_code)]
use candle_core::{Tensor, Var};
use fsdp_comm::{Comm, MicroBatchSum, World};
use fsdp_harness::Session;

use crate::units::FsdpUnit;

/// **Exercise 3.1 — a unit's backward entry.** The step has just
/// re-gathered `unit`'s weights: `p`, as candle `Var`s in the unit's order.
/// `inputs[k]` is the unit's input (B, T, C) that forward saved for my
/// micro-batch k, and `upstream[k]` the gradient of the loss with respect
/// to the unit's *output* for that micro-batch, (B, T, C). For each of my
/// micro-batches, in order:
///
/// 1. recompute the unit's forward from its saved input, each of its blocks
///    on a tape (`Gpt::block_taped`, chapter 01's "The backward, block by
///    block"), keeping every block's tape;
/// 2. pull `upstream[k]` back through the tapes, last block first
///    (`BlockTape::backward`): each gives its block's weight gradients, and
///    its input's gradient, the upstream gradient of the block below;
/// 3. add the weight gradients to the unit's gradient sum (a
///    `MicroBatchSum` of the unit's padded length, which the session makes;
///    `FsdpUnit::add_grads` puts gradients given by parameter entry in
///    their places);
/// 4. replace `upstream[k]` by the unit input's gradient: the next unit down needs it.
///
/// (candle's autograd gives the same bits — one backward of a scalar whose
/// gradient with respect to the unit's output is `upstream[k]` — holding
/// more memory: its graph, and every gradient added into zeros first.)
///
/// Return the sum; the step reduce-scatters it and frees the weights.
pub fn backward_entry(
    s: &Session,
    unit: &FsdpUnit,
    p: &[Var],
    inputs: &[Tensor],
    upstream: &mut [Tensor],
) -> anyhow::Result<MicroBatchSum> {
    // TODO(exercise): 3.1
    let _ = (s, unit, p, inputs, upstream);
    todo!("exercise 3.1: recompute, pull the upstream gradient back, sum the unit's gradients")
}

/// **Exercise 3.2 — the global norm across shards.** Under `--grad-clip`
/// the mean gradient is scaled by min(1, C / (‖g‖ + 1e-6)), where ‖g‖ is
/// the norm of the *whole* gradient. This rank holds only `shards`: its
/// shard of every unit's mean gradient (padding is zeros); `comm` is the
/// ranks that share the model between them (the world; under `--hsdp`, my
/// shard group). Return ‖g‖ over every element of every shard in `comm`,
/// the same f64 on every rank, with the sum of squares exact
/// (`fsdp_comm::ExactSquares`), so that no split of the model over ranks
/// changes a bit of it.
pub fn global_norm(comm: &Comm, shards: &[&[f32]]) -> f64 {
    // TODO(exercise): 3.2
    let _ = (comm, shards);
    todo!("exercise 3.2: the norm of the whole gradient, from every rank's shards")
}

/// **Exercise 3.3 — no-sync's hand-off.** Under `--accumulate no-sync`
/// (FSDP2's `set_requires_gradient_sync(False)` until the last micro-batch)
/// my micro-batches run one after another, each a whole forward and
/// backward. Each time a unit's backward is done, this is called with the
/// unit, its unsharded gradient sum over my micro-batches so far (`held`:
/// `Some` until handed off) and this micro-batch's gradient of the whole
/// unit (`leaf`, padded). Add the leaf to the sum, in the one pairwise tree
/// (`MicroBatchSum::push`). After my *last* micro-batch (`last`) the sum is
/// complete: reduce-scatter it (`unit.reduce_scatter` keeps my shard of the
/// sum over all ranks) and free it. Until then nothing of the unit crosses
/// between ranks, and every rank holds every unit's whole fp32 gradient.
pub fn no_sync_hand_off(w: &World, unit: &mut FsdpUnit, held: &mut Option<MicroBatchSum>, leaf: Vec<f32>, last: bool) {
    // TODO(exercise): 3.3
    let _ = (w, unit, held, leaf, last);
    todo!("exercise 3.3: push the leaf onto the unit's sum; after the last, reduce-scatter it and free it")
}
