//! # Lesson 02 exercises
//!
//! Each function below has a `TODO(exercise)`: replace the `todo!()` with
//! your answer, then check it with `cargo test --release -p
//! step02-whole-model-shard exercise_2_N` (the book's chapter 02 has hints).
//! The committed snapshot under `src/snapshots/` is the specification: do
//! not accept a new snapshot — make your code produce the committed one.
//! Answers live apart, in `solutions/exercises.rs`.
#![allow(dead_code)]
use std::ops::Range;

/// **Exercise 2.1 — predict the tally.** For a flat vector of `numel`
/// parameters over `ranks` ranks, how many elements does each rank's shard
/// hold, and how many padding elements does the whole vector get?
/// (Shards are equal; padding is as small as it can be.)
pub fn shard_len_and_padding(numel: usize, ranks: usize) -> (usize, usize) {
    // TODO(exercise): 2.1
    let _ = (numel, ranks);
    todo!("exercise 2.1: return (elements per shard, padding elements)")
}

/// **Exercise 2.2 — the order of a sum.** Sum the ranks' contributions
/// element by element, but in *reverse* rank order (rank N−1 first). The
/// check counts how many elements then differ from the rank-order sum.
pub fn sum_in_reverse_rank_order(contributions: &[Vec<f32>]) -> Vec<f32> {
    // TODO(exercise): 2.2
    let _ = contributions;
    todo!("exercise 2.2: add the contributions from the last rank to the first")
}

/// **Exercise 2.3 — break the proof.** Lesson 02 updates every element of
/// a rank's shard. Return the part of `shard` a *buggy* rank updates: only
/// its first half. The check runs one AdamW step that way and prints the
/// divergence `--check` would have shown.
pub fn elements_to_update(shard: Range<usize>) -> Range<usize> {
    // TODO(exercise): 2.3
    let _ = shard;
    todo!("exercise 2.3: return the first half of the shard")
}
