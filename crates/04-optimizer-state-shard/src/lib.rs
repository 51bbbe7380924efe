//! # step04-optimizer-state-shard — where the memory really goes
//!
//! [`OptimizerStateShard`] trains at ZeRO stage 1, 2 or 3 over lesson 03's
//! units; [`overlap`] overlaps its communication with compute (stage 3's
//! `--prefetch`, stages 1 and 2's `--overlap-comm`); [`zero`] holds the bytes: the paper's per-device formulas (the
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
pub mod overlap;
pub mod zero;

pub use optimizer_state_shard::{OptimizerStateShard, Overlap};

// The exercises: yours (src/exercises.rs) and the answers, with the same
// signatures; `--mine K` makes the step call yours (fsdp_harness::exercise).
#[doc(hidden)]
#[path = "../solutions/exercises.rs"]
pub mod answers;
#[doc(hidden)]
#[path = "exercises.rs"]
pub mod mine;

/// Exercise 4.2's edge cases: `round` against candle's `to_dtype(BF16)`
/// (`half`) on values a run seldom meets — ties either way, the largest
/// finite floats, infinities, subnormals, NaNs (any NaN bits will do) — and
/// 100,000 arbitrary bit patterns. `Err` names the first difference.
#[doc(hidden)]
pub fn check_bf16_rounding(round: fn(&[f32]) -> Vec<u16>) -> Result<(), String> {
    let mut v: Vec<f32> = vec![0.0, -0.0, 1.0, f32::MAX, f32::MIN, f32::INFINITY, f32::NEG_INFINITY, 1e-40, -1e-45];
    let edges = [0x3f80_8000u32, 0x3f81_8000, 0x3f80_8001, 0x3f80_7fff, 0x7f7f_ffff, 0x7fc0_0001, 0xffa0_0000];
    v.extend(edges.iter().chain(&[0x7f80_0001, 0x7fff_ffff, 0xffff_ffff]).map(|&b| f32::from_bits(b)));
    let mut x = 0x1234_5678u32; // xorshift32
    for _ in 0..100_000 {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        v.push(f32::from_bits(x));
    }
    let is_nan = |bits: u16| bits & 0x7f80 == 0x7f80 && bits & 0x007f != 0;
    let (ours, candle) = (round(&v), fsdp_gpt::precision::bf16_bits(&v));
    if ours.len() != v.len() {
        return Err(format!("{} values in, {} bf16 values out", v.len(), ours.len()));
    }
    match ours.iter().zip(&candle).zip(&v).find(|((a, b), x)| if x.is_nan() { !is_nan(**a) } else { a != b }) {
        None => Ok(()),
        Some(((a, b), x)) => {
            Err(format!("{x:e} (bits {:#010x}) gives bf16 bits {a:#06x}, candle's {b:#06x}", x.to_bits()))
        }
    }
}

#[cfg(test)]
mod tests {
    /// Exercise 4.2's answer rounds as candle does, at the edges.
    #[test]
    fn the_bf16_answer_rounds_as_candle_does() {
        assert_eq!(crate::check_bf16_rounding(crate::answers::to_bf16_bits), Ok(()));
        // The check can fail: truncation is caught.
        let truncate: fn(&[f32]) -> Vec<u16> = |v| v.iter().map(|x| (x.to_bits() >> 16) as u16).collect();
        assert!(crate::check_bf16_rounding(truncate).is_err());
    }
}
