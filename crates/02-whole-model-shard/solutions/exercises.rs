//! Answers to lesson 02's exercises (compiled in place of `src/exercises.rs`
//! with `--features solutions`; CI checks them against the snapshots).
#![allow(dead_code)]
use std::ops::Range;

/// 2.1: round up to a multiple of the world size, then divide.
pub fn shard_len_and_padding(numel: usize, ranks: usize) -> (usize, usize) {
    let shard = numel.div_ceil(ranks);
    (shard, shard * ranks - numel)
}

/// 2.2: the same additions, the other way round.
pub fn sum_in_reverse_rank_order(contributions: &[Vec<f32>]) -> Vec<f32> {
    let mut out = contributions.last().expect("at least one rank").clone();
    for c in contributions.iter().rev().skip(1) {
        out.iter_mut().zip(c).for_each(|(o, x)| *o += x);
    }
    out
}

/// 2.3: the first half only.
pub fn elements_to_update(shard: Range<usize>) -> Range<usize> {
    shard.start..shard.start + shard.len() / 2
}
