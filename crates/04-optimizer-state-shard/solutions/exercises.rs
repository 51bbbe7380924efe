//! Answers to lesson 04's exercises (compiled in place of `src/exercises.rs`
//! with `--features solutions`; CI checks them against the snapshots).
#![allow(dead_code)]

/// Exercise 4.1: each stage moves one more term under the `/ N`.
pub fn bytes_per_device(params: f64, ranks: u64, stage: u8, k: f64) -> f64 {
    let (p, n) = (params, ranks as f64);
    match stage {
        0 => (2.0 + 2.0 + k) * p,
        1 => (2.0 + 2.0) * p + k * p / n,
        2 => 2.0 * p + (2.0 + k) * p / n,
        _ => (2.0 + 2.0 + k) * p / n,
    }
}

/// Exercise 4.2: the replicated part must fit on its own; then solve for N.
pub fn min_ranks_to_fit(params: f64, stage: u8, device_bytes: f64) -> Option<u64> {
    let (replicated, sharded) = match stage {
        0 => (16.0 * params, 0.0),
        1 => (4.0 * params, 12.0 * params),
        2 => (2.0 * params, 14.0 * params),
        _ => (0.0, 16.0 * params),
    };
    if replicated > device_bytes || (replicated == device_bytes && sharded > 0.0) {
        return None;
    }
    if sharded == 0.0 {
        return Some(1);
    }
    let mut n = (sharded / (device_bytes - replicated)).ceil().max(1.0) as u64;
    // Guard against the division's rounding: step to the exact boundary.
    while n > 1 && replicated + sharded / (n - 1) as f64 <= device_bytes {
        n -= 1;
    }
    while replicated + sharded / n as f64 > device_bytes {
        n += 1;
    }
    Some(n)
}

/// Exercise 4.3: add half of the dropped part (minus one when the kept part
/// is even, so exact ties go to even), then drop the low 16 bits.
pub fn round_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x0040; // keep the sign, force a quiet NaN
    }
    let keep_odd = (bits >> 16) & 1;
    ((bits + 0x7FFF + keep_odd) >> 16) as u16
}
