//! # Lesson 01 — the answers to `src/exercises.rs`
//!
//! The lesson runs these unless `--mine K` switches exercise 1.K to yours.
use std::ops::Range;

use candle_core::Var;
use fsdp_comm::MicroBatchSum;
use fsdp_harness::Session;

/// 1.1: the left half's sum plus the right half's, each half in place into
/// its own first part, recursively (what `fsdp_comm::sum_pairwise` does).
pub fn sum_received(parts: &mut [&mut [f32]]) {
    if parts.len() < 2 {
        return;
    }
    let (left, right) = parts.split_at_mut(parts.len() / 2);
    sum_received(left);
    sum_received(right);
    left[0].iter_mut().zip(right[0].iter()).for_each(|(l, r)| *l += r);
}

/// 1.2: each micro-batch's gradient handed to the sum, which merges
/// finished subtrees of the pairwise tree as it goes.
pub fn accumulate_micro_batches(
    s: &Session,
    vars: &[Var],
    step: u64,
    micro_batches: Range<usize>,
    recompute: bool,
    sums: &mut MicroBatchSum,
) -> anyhow::Result<f64> {
    let numel = s.table.numel();
    let all: Vec<usize> = (0..vars.len()).collect(); // every parameter-table entry
    let mut loss_sum = 0.0;
    for k in micro_batches {
        let (loss, grads) = s.forward_backward(vars, step, k, recompute)?;
        sums.add(|buf| grads.add_to(&all, vars, &mut buf[..numel]))?;
        loss_sum += loss as f64;
    }
    Ok(loss_sum)
}
