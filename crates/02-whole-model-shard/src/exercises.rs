//! # Lesson 02 exercises — your code, inside the real step
//!
//! Each function below is a piece of lesson 02's step. The step calls the
//! answer (`solutions/exercises.rs`) unless you switch it to yours:
//!
//! ```text
//! just step 02 4 --mine 1      # lesson 02 on 4 ranks, exercise 2.1 with your code
//! just exercise 02-1           # the same run, checked bit for bit against the committed snapshot
//! just step 02 4               # back to the answers
//! ```
//!
//! Replace a `todo!()` under `TODO(exercise)` with your code. The check
//! compares your run's losses, `--check` divergence, bytes sent and final
//! weights with the committed snapshot, bit for bit. Hints are in the
//! book's chapter 02.
#![allow(dead_code)]
use fsdp_comm::{ShardLayout, World};
use fsdp_gpt::AdamW;

/// **Exercise 2.1 — update only your shard.** The all-reduce has left the
/// whole mean gradient on every rank: `grads`, padded to `layout.padded`
/// elements. This rank owns shard `rank` of the flat parameter vector and
/// holds only that: `master` (its fp32 weights, `layout.shard_len`
/// elements, padding included) and `opt` (AdamW's `m` and `v` for the same
/// elements). Take one AdamW step on your shard with your shard's gradient.
pub fn update_my_shard(opt: &mut AdamW, master: &mut [f32], grads: &[f32], layout: ShardLayout, rank: usize) {
    // TODO(exercise): 2.1
    let _ = (opt, master, grads, layout, rank);
    todo!("exercise 2.1: AdamW on my shard, with my shard's gradient")
}

/// **Exercise 2.2 — the proof, every step.** `--check` keeps lesson 01's
/// whole replicated state beside the shards and feeds it the same
/// gradient. Return the largest |sharded − replicated| over *every* real
/// parameter of the model: this rank compares its shard (`master`, padding
/// excluded: the model has `layout.numel` parameters) with the same
/// elements of `replicated` (the whole model), then the ranks agree on the
/// largest (`w.gather_control` gives every rank every rank's value). A NaN
/// anywhere must come out as NaN: a broken run must not read as 0.
pub fn divergence(w: &World, master: &[f32], replicated: &[f32], layout: ShardLayout, rank: usize) -> f32 {
    // TODO(exercise): 2.2
    let _ = (w, master, replicated, layout, rank);
    todo!("exercise 2.2: max |sharded − replicated| over every rank's real elements")
}
