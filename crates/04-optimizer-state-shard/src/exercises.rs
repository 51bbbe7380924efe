//! # Lesson 04 exercises — your code, inside the real step
//!
//! Each function below is a piece of lesson 04's step. The step calls the
//! answer (`solutions/exercises.rs`) unless you switch it to yours:
//!
//! ```text
//! just step 04 4 --stage 2 --mine 1   # ZeRO-2 on 4 ranks, exercise 4.1 with your code
//! just exercise 04-1                  # the same run, checked bit for bit against the committed snapshot
//! just step 04 4 --stage 2            # back to the answers
//! ```
//!
//! Replace a `todo!()` under `TODO(exercise)` with your code. The check
//! compares your run's losses, bytes sent and final weights with the
//! committed snapshot, bit for bit. Hints are in the book's chapter 04.
#![allow(dead_code)]
use candle_core::Tensor;
use fsdp_comm::{MicroBatchSum, World};
use fsdp_gpt::GptError;
use step03_layerwise_shard::units::FsdpUnit;

/// **Exercise 4.1 — ZeRO-2's gradient hand-off.** ZeRO-2's backward runs
/// block by block through the resident compute copy, one micro-batch of
/// mine after another. Each time a unit's backward is done, this is called
/// with that unit, its gradient sum over my micro-batches so far (`sum`:
/// `Some` until handed off) and this micro-batch's gradients of the unit
/// (`grads`: parameter-table entry, gradient). Add them to the sum
/// (`unit.add_grads`). After my *last* micro-batch (`last`), my share of
/// the unit's gradient is complete: reduce-scatter it (`unit.reduce_scatter`
/// keeps my shard of the sum over all ranks) and free the sum — so that in
/// my last backward no rank holds every unit's full gradient at once (with
/// several micro-batches of mine, the units' sums live until then).
pub fn hand_off(
    w: &World,
    unit: &mut FsdpUnit,
    sum: &mut Option<MicroBatchSum>,
    grads: &[(usize, Tensor)],
    last: bool,
) -> Result<(), GptError> {
    // TODO(exercise): 4.1
    let _ = (w, unit, sum, grads, last);
    todo!("exercise 4.1: add to the unit's sum; after the last micro-batch, reduce-scatter it and free it")
}

/// **Exercise 4.2 — bf16 on the wire.** Under `--precision bf16` a unit is
/// all-gathered as bf16: every rank rounds its fp32 master shard to bf16
/// and sends 2 bytes per element, half of fp32's. Return the bf16 bits of
/// each element of `shard`: the top 16 bits of the f32 (sign, 8 exponent
/// bits, 7 mantissa bits), *rounded to nearest, ties to even* — what
/// candle's `to_dtype(BF16)` does, so the gathered copy is the one lesson 01
/// computes with. A NaN must stay a NaN.
pub fn to_bf16_bits(shard: &[f32]) -> Vec<u16> {
    // TODO(exercise): 4.2
    let _ = shard;
    todo!("exercise 4.2: the bf16 bits of each element, rounded to nearest even")
}
