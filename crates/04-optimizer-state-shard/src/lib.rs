//! # step04-optimizer-state-shard — where the memory really goes
//!
//! [`OptimizerStateShard`] trains at ZeRO stage 1, 2 or 3 over lesson 03's
//! units; [`zero`] holds the bytes: the paper's per-device formulas (the
//! `zero-tally` binary behind `just tally`) and this run's tally per stage.
//!
//! ```
//! use step04_optimizer_state_shard::zero::model_state_bytes;
//! // 7B parameters, 16 bytes each, replicated: 112 GB per device.
//! assert_eq!(model_state_bytes(7e9, 64, 0, 12.0), 112e9);
//! // ZeRO-3 on 64 ranks: 1.75 GB.
//! assert_eq!(model_state_bytes(7e9, 64, 3, 12.0), 1.75e9);
//! ```
pub mod optimizer_state_shard;
pub mod zero;

pub use optimizer_state_shard::OptimizerStateShard;

// The exercises: yours (src/exercises.rs) and the answers, with the same
// signatures; `--mine K` makes the step call yours (fsdp_harness::exercise).
#[doc(hidden)]
#[path = "../solutions/exercises.rs"]
pub mod answers;
#[doc(hidden)]
#[path = "exercises.rs"]
pub mod mine;

#[cfg(test)]
mod tests {
    /// Exercise 4.2's answer rounds as candle's `to_dtype(BF16)` does
    /// (`half`), at the edges a gather can meet: ties either way, the
    /// largest finite values, infinities, subnormals, NaNs.
    #[test]
    fn the_bf16_answer_rounds_as_candle_does() {
        let mut v: Vec<f32> = vec![0.0, -0.0, 1.0, f32::MAX, f32::MIN, f32::INFINITY, f32::NEG_INFINITY, 1e-40, -1e-45];
        v.extend(
            [0x3f80_8000u32, 0x3f81_8000, 0x3f80_8001, 0x3f80_7fff, 0x7f7f_ffff, 0x7fc0_0001, 0xffa0_0000]
                .map(f32::from_bits),
        );
        let mut x = 0x1234_5678u32;
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            v.push(f32::from_bits(x));
        }
        let (ours, candle) = (crate::answers::to_bf16_bits(&v), fsdp_gpt::precision::bf16_bits(&v));
        for ((a, b), x) in ours.iter().zip(&candle).zip(&v) {
            if x.is_nan() {
                assert!(half_is_nan(*a) && half_is_nan(*b), "{x:?}");
            } else {
                assert_eq!(a, b, "{x:e} ({:#010x})", x.to_bits());
            }
        }
    }

    fn half_is_nan(bits: u16) -> bool {
        bits & 0x7f80 == 0x7f80 && bits & 0x007f != 0
    }
}
