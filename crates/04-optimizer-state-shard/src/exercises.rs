//! # Lesson 04 exercises
//!
//! Each function below has a `TODO(exercise)`: replace the `todo!()` with
//! your answer, then check it with `cargo test --release -p
//! step04-optimizer-state-shard exercise_4_N` (the book's chapter 04 has
//! hints). The committed snapshot under `src/snapshots/` is the
//! specification: do not accept a new snapshot — make your code produce the
//! committed one. Answers live apart, in `solutions/exercises.rs`.
#![allow(dead_code)]

/// **Exercise 4.1 — the 16 bytes.** Model-state bytes per device for
/// `params` parameters on `ranks` ranks: bf16 weights (2 bytes), bf16
/// gradients (2 bytes) and `k` bytes of optimizer state per parameter.
/// `stage` 0 is data parallelism (all replicated); stage 1 shards the
/// optimizer state, stage 2 also the gradients, stage 3 also the weights.
pub fn bytes_per_device(params: f64, ranks: u64, stage: u8, k: f64) -> f64 {
    // TODO(exercise): 4.1
    let _ = (params, ranks, stage, k);
    todo!("exercise 4.1: the ZeRO paper's model-state bytes per device")
}

/// **Exercise 4.2 — how many GPUs?** The smallest number of ranks on which
/// the model states of `params` parameters (K = 12) fit in `device_bytes`
/// per device at `stage`, or `None` if no number of ranks is enough.
pub fn min_ranks_to_fit(params: f64, stage: u8, device_bytes: f64) -> Option<u64> {
    // TODO(exercise): 4.2
    let _ = (params, stage, device_bytes);
    todo!("exercise 4.2: the fewest ranks that fit, or None")
}

/// **Exercise 4.3 — round to bf16.** bf16 keeps the top 16 bits of an f32
/// (sign, 8 exponent bits, 7 mantissa bits). Return the bf16 bits of `x`
/// rounded to nearest, ties to even — what candle's `to_dtype(BF16)` and
/// every compute copy in this lesson do. A NaN must stay a NaN.
pub fn round_to_bf16(x: f32) -> u16 {
    // TODO(exercise): 4.3
    let _ = x;
    todo!("exercise 4.3: the bf16 bits of x, round to nearest even")
}
