//! # Lesson 03 exercises
//!
//! Each function below has a `TODO(exercise)`: replace the `todo!()` with
//! your answer, then check it with `cargo test --release -p
//! step03-layerwise-shard exercise_3_N` (the book's chapter 03 has hints).
//! The committed snapshot under `src/snapshots/` is the specification: do
//! not accept a new snapshot — make your code produce the committed one.
//! Answers live apart, in `solutions/exercises.rs`.
#![allow(dead_code)]

/// **Exercise 3.1 — group two blocks per unit.** A model has a root unit of
/// `root` parameters and `n_layer` blocks of `block` parameters each. With
/// `g` consecutive blocks per unit (`--blocks-per-unit g`; the last unit
/// may get fewer), how many parameters does the largest unit hold? That is
/// the most a rank ever holds unsharded, without prefetch.
pub fn largest_unit(root: usize, block: usize, n_layer: usize, g: usize) -> usize {
    // TODO(exercise): 3.1
    let _ = (root, block, n_layer, g);
    todo!("exercise 3.1: the parameter count of the largest unit")
}

/// **Exercise 3.2 — count the all-gathers.** Each step gathers every unit
/// twice (a block for its forward and its backward; the root for the
/// embedding and the head). A unit of `numel` parameters is padded to a
/// multiple of `ranks`, and a gather sends your shard to each of the other
/// ranks. Return the bytes of fp32 one rank sends in all-gathers per step;
/// `unit_numels` lists the units.
pub fn all_gather_bytes(unit_numels: &[usize], ranks: usize) -> u64 {
    // TODO(exercise): 3.2
    let _ = (unit_numels, ranks);
    todo!("exercise 3.2: bytes sent in all-gathers per step, per rank")
}

/// **Exercise 3.3 — reduce once, or after every micro-batch?** `grads[r][k]`
/// is rank r's gradient of its k-th micro-batch (all ranks have the same
/// number). Lesson 03 sums each rank's micro-batches first and reduces
/// once. Return instead what a rank gets by reducing after *every*
/// micro-batch: for k = 0, 1, …, sum `grads[0][k] + grads[1][k] + …` in rank
/// order, and add that onto a running total that starts at zero.
pub fn reduce_every_micro_batch(grads: &[Vec<Vec<f32>>]) -> Vec<f32> {
    // TODO(exercise): 3.3
    let _ = grads;
    todo!("exercise 3.3: for each micro-batch, the rank-order sum, added onto the total")
}
