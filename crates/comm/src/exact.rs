//! A sum of squares that no order of addition can change: for the global
//! gradient norm, the one quantity of an update that needs every shard.
//!
//! Every f32 squared is exact in f64 (24 significant bits squared fit in
//! 53), and here it is added into a 384-bit fixed-point integer whose last
//! bit is 2⁻¹⁹². Integer addition is associative, so the total is the same
//! bits however the elements are split among ranks and in whatever order
//! the parts are combined: lesson 01 with the whole gradient on one rank and
//! ZeRO-3 with 1/N of it on each get the same norm, without agreeing on any
//! order at all. (Each square is rounded down to a multiple of 2⁻¹⁹² — exact
//! for |g| ≥ 2⁻⁷², dropped below 2⁻⁹⁶ — the same for an element on every
//! rank; a sum reaching 2¹⁹² is reported infinite.)
/// 64-bit limbs of the fixed-point sum, least significant first.
const LIMBS: usize = 6;
/// The weight of the lowest bit: 2^LSB.
const LSB: i32 = -192;

/// An exact sum of squares of f32 values. [`ExactSquares::norm`] reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExactSquares {
    limbs: [u64; LIMBS],
    /// A NaN or ±∞ was added (the norm is NaN), or the sum overflowed (∞).
    nan: bool,
    overflow: bool,
}

impl ExactSquares {
    /// The sum of the squares of `xs`.
    pub fn of(xs: &[f32]) -> Self {
        let mut s = Self::default();
        xs.iter().for_each(|&x| s.add_square(x));
        s
    }

    /// `self += x²`, exactly.
    pub fn add_square(&mut self, x: f32) {
        if !x.is_finite() {
            self.nan = true;
            return;
        }
        let sq = x as f64 * x as f64; // exact
        if sq == 0.0 {
            return;
        }
        // sq = m · 2^e, m an integer below 2^53
        let bits = sq.to_bits();
        let (exp, frac) = (((bits >> 52) & 0x7ff) as i32, bits & ((1 << 52) - 1));
        let (m, e) = if exp == 0 { (frac, -1074) } else { (frac | (1 << 52), exp - 1075) };
        let shift = e - LSB; // where m's lowest bit lands
        let (m, shift) = match shift {
            s if s < 0 && -s >= 64 => return, // below the last bit: dropped
            s if s < 0 => (m >> -s, 0),
            s => (m, s as usize),
        };
        let (limb, off) = (shift / 64, shift % 64);
        let wide = (m as u128) << off; // at most 53 + 63 bits
        self.add_at(limb, wide as u64);
        self.add_at(limb + 1, (wide >> 64) as u64);
    }

    /// Adds `v` at limb `i`, carrying upwards.
    fn add_at(&mut self, mut i: usize, mut v: u64) {
        while v != 0 {
            if i >= LIMBS {
                self.overflow = true;
                return;
            }
            let (sum, carry) = self.limbs[i].overflowing_add(v);
            self.limbs[i] = sum;
            v = carry as u64;
            i += 1;
        }
    }

    /// `self += other`, exactly: the order of merging changes nothing.
    pub fn merge(&mut self, other: &Self) {
        for i in 0..LIMBS {
            self.add_at(i, other.limbs[i]);
        }
        self.nan |= other.nan;
        self.overflow |= other.overflow;
    }

    /// √(the sum), in f64: the limbs converted from the top down, one fixed way.
    pub fn norm(&self) -> f64 {
        if self.nan {
            return f64::NAN;
        }
        if self.overflow {
            return f64::INFINITY;
        }
        let mut v = 0.0f64;
        for &l in self.limbs.iter().rev() {
            v = v * 18_446_744_073_709_551_616.0 + l as f64; // · 2⁶⁴
        }
        (v * 2f64.powi(LSB)).sqrt()
    }

    /// The wire form: the limbs and the two flags, as u64s.
    pub fn to_words(&self) -> [u64; LIMBS + 1] {
        let mut w = [0; LIMBS + 1];
        w[..LIMBS].copy_from_slice(&self.limbs);
        w[LIMBS] = self.nan as u64 | (self.overflow as u64) << 1;
        w
    }

    /// From [`ExactSquares::to_words`].
    pub fn from_words(w: &[u64]) -> Self {
        let mut limbs = [0; LIMBS];
        limbs.copy_from_slice(&w[..LIMBS]);
        Self { limbs, nan: w[LIMBS] & 1 != 0, overflow: w[LIMBS] & 2 != 0 }
    }

    /// Words per [`ExactSquares`] on the wire.
    pub const WORDS: usize = LIMBS + 1;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        // a spread of magnitudes: 1e-30 … 1e10, both signs
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let mant = (x % 10_000) as f32 / 10_000.0 + 0.5;
                let exp = (x >> 20) % 40;
                let sign = if x & 1 == 0 { 1.0 } else { -1.0 };
                sign * mant * 10f32.powi(exp as i32 - 30)
            })
            .collect()
    }

    /// Any split into parts, merged in any order, gives the same bits; and
    /// the norm agrees with an f64 sum to rounding.
    #[test]
    fn no_split_or_order_changes_the_sum() {
        let v = values(10_000, 7);
        let whole = ExactSquares::of(&v);
        for parts in [2usize, 3, 7, 64] {
            let mut pieces: Vec<ExactSquares> = v.chunks(v.len().div_ceil(parts)).map(ExactSquares::of).collect();
            pieces.reverse();
            let mut merged = ExactSquares::default();
            pieces.iter().for_each(|p| merged.merge(p));
            assert_eq!(merged, whole, "{parts} parts");
            assert_eq!(merged.norm().to_bits(), whole.norm().to_bits());
        }
        let mut reversed = v.clone();
        reversed.reverse();
        assert_eq!(ExactSquares::of(&reversed), whole);
        let f64_sum: f64 = v.iter().map(|&x| x as f64 * x as f64).sum();
        assert!((whole.norm() / f64_sum.sqrt() - 1.0).abs() < 1e-12, "{} vs {}", whole.norm(), f64_sum.sqrt());
    }

    /// Small cases worked by hand: 3² + 4² = 5², and the wire form round-trips.
    #[test]
    fn worked_by_hand_and_over_the_wire() {
        let s = ExactSquares::of(&[3.0, -4.0]);
        assert_eq!(s.norm(), 5.0);
        assert_eq!(ExactSquares::from_words(&s.to_words()), s);
        assert_eq!(ExactSquares::of(&[]).norm(), 0.0);
        let small = ExactSquares::of(&[1e-20, -1e-20]);
        assert!((small.norm() / (2f64.sqrt() * 1e-20f32 as f64) - 1.0).abs() < 1e-12);
        // below the last bit (|g| < 2⁻⁹⁶ ≈ 1.3e-29): dropped, on every rank alike
        assert_eq!(ExactSquares::of(&[1e-30, -1e-30]).norm(), 0.0);
    }

    /// Carries between limbs and out of the top one.
    #[test]
    fn carries_and_overflow_across_limbs() {
        let p = |e: i32| 2f32.powi(e);
        // four squares of 2⁻⁶⁵ (2⁻¹³⁰, bit 62 of limb 0) carry into limb 1: one square of 2⁻⁶⁴
        assert_eq!(ExactSquares::of(&[p(-65); 4]), ExactSquares::of(&[p(-64)]));
        assert_eq!(ExactSquares::of(&[p(95); 3]).norm(), 3f64.sqrt() * p(95) as f64);
        assert_eq!(ExactSquares::of(&[p(95); 4]).norm(), f64::INFINITY, "2¹⁹² does not fit");
        let mut s = ExactSquares::of(&[p(95), p(95)]);
        s.merge(&ExactSquares::of(&[p(95), p(95)]));
        assert_eq!(s.norm(), f64::INFINITY, "a merge carries out too");
    }

    /// A NaN or ∞ makes the norm NaN (a broken step must not look healthy);
    /// a sum beyond 2¹⁹² reads infinite.
    #[test]
    fn nan_and_overflow_are_not_hidden() {
        assert!(ExactSquares::of(&[1.0, f32::NAN]).norm().is_nan());
        assert!(ExactSquares::of(&[f32::INFINITY]).norm().is_nan());
        assert_eq!(ExactSquares::of(&[f32::MAX, f32::MAX]).norm(), f64::INFINITY);
        let mut s = ExactSquares::of(&[1.0]);
        s.merge(&ExactSquares::of(&[f32::NAN]));
        assert!(s.norm().is_nan());
    }
}
