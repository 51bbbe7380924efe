//! Answers to lesson 03's exercises (compiled in place of `src/exercises.rs`
//! with `--features solutions`; CI checks them against the snapshots).
#![allow(dead_code)]

/// Exercise 3.1: the root, or `g` blocks (fewer when the model has fewer).
pub fn largest_unit(root: usize, block: usize, n_layer: usize, g: usize) -> usize {
    root.max(g.min(n_layer) * block)
}

/// Exercise 3.2: every gather sends one padded shard to N − 1 ranks.
pub fn all_gather_bytes(unit_numels: &[usize], ranks: usize) -> u64 {
    unit_numels.iter().map(|&numel| (2 * (ranks - 1) * numel.div_ceil(ranks) * 4) as u64).sum()
}

/// Exercise 3.3: the sum over ranks first, then over micro-batches.
pub fn reduce_every_micro_batch(grads: &[Vec<Vec<f32>>]) -> Vec<f32> {
    let len = grads[0][0].len();
    let mut total = vec![0.0f32; len];
    for k in 0..grads[0].len() {
        let mut reduced = grads[0][k].clone();
        for r in &grads[1..] {
            reduced.iter_mut().zip(&r[k]).for_each(|(a, b)| *a += b);
        }
        total.iter_mut().zip(&reduced).for_each(|(t, x)| *t += x);
    }
    total
}
