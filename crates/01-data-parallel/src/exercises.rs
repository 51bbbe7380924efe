//! # Lesson 01 exercises — your code, inside the real step
//!
//! Each function below is a piece of lesson 01's step. The step calls the
//! answer (`solutions/exercises.rs`) unless you switch it to yours:
//!
//! ```text
//! just step 01 4 --mine 1      # lesson 01 on 4 ranks, exercise 1.1 with your code
//! just exercise 01-1           # the same run, checked bit for bit against the committed snapshot
//! just step 01 4               # back to the answers
//! ```
//!
//! Replace a `todo!()` under `TODO(exercise)` with your code. The check
//! compares your run's losses, bytes sent and final weights with the
//! committed snapshot, bit for bit: the same arithmetic in another order
//! fails, and the check says so. Hints are in the book's chapter 01.
#![allow(dead_code)]
use std::ops::Range;

use candle_core::Var;
use fsdp_comm::MicroBatchSum;
use fsdp_harness::Session;

/// **Exercise 1.1 — add what the all-to-all delivered.** The ordered
/// all-reduce is a reduce-scatter then an all-gather. In the reduce-scatter
/// every rank receives one part per rank — the others' copies of its shard,
/// in rank order, its own among them (with `--sum-groups G`, one part per
/// group, in global order) — and adds them. Leave in `parts[0]`
/// the sum of all the parts, added as the pairwise tree split at midpoints:
/// the sum of the left half (parts `0..n/2`) plus the sum of the right half,
/// each half summed the same way. That order, not rank 0 + rank 1 + rank 2
/// + …, is what makes N ranks add exactly what one process adds.
pub fn sum_received(parts: &mut [&mut [f32]]) {
    // TODO(exercise): 1.1
    let _ = parts;
    todo!("exercise 1.1: add the parts into parts[0] as the midpoint tree")
}

/// **Exercise 1.2 — my micro-batches, summed in order.** The step's first
/// half: forward and backward through the whole model (`vars`, this step's
/// compute copy) on each of `micro_batches` (this rank's share of the
/// step's; under `--accumulate`, all of them), in order
/// (`s.forward_backward`, passing `recompute` on), each micro-batch's
/// gradients added onto the running sum `sums` (already emptied). The sum
/// forms the pairwise tree over the micro-batches, so hand it every one
/// through `sums.add` (it gives you a zeroed buffer of the padded length:
/// the model's `s.table.numel()` elements come first). Return the sum of
/// the micro-batches' losses, in f64.
pub fn accumulate_micro_batches(
    s: &Session,
    vars: &[Var],
    step: u64,
    micro_batches: Range<usize>,
    recompute: bool,
    sums: &mut MicroBatchSum,
) -> anyhow::Result<f64> {
    // TODO(exercise): 1.2
    let _ = (s, vars, step, micro_batches, recompute, sums);
    todo!("exercise 1.2: forward/backward on my micro-batches, their gradients added in the tree's order")
}
