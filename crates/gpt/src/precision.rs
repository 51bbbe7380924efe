//! The precision policy: which dtype the model computes in.
//!
//! The master weights, the gradient sums and AdamW's `m` and `v` are always
//! fp32. Under `bf16` the *compute copy* of the weights is bf16 (rounded to
//! nearest, ties to even, from the fp32 master), so candle's forward and
//! backward run in bf16 and produce bf16 gradients; each micro-batch's
//! gradient is widened to fp32 before it is summed and reduced. The logits
//! are widened to fp32 before the loss.
use std::fmt;
use std::str::FromStr;

use candle_core::DType;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// Everything fp32.
    #[default]
    Fp32,
    /// bf16 compute copy and gradients; fp32 master, sums and AdamW state.
    Bf16,
}

impl Precision {
    /// The dtype of the compute copy and of candle's gradients.
    pub fn dtype(self) -> DType {
        match self {
            Precision::Fp32 => DType::F32,
            Precision::Bf16 => DType::BF16,
        }
    }

    /// Bytes per element of the compute copy and of candle's gradients.
    pub fn bytes(self) -> usize {
        self.dtype().size_in_bytes()
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
        })
    }
}

impl FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fp32" | "f32" => Ok(Precision::Fp32),
            "bf16" => Ok(Precision::Bf16),
            _ => Err(format!("`{s}` is not a precision: choose fp32 or bf16")),
        }
    }
}

// ANCHOR: to_bf16
/// f32 → bf16, rounded to nearest, ties to even: the bits of
/// `half::bf16::from_f32` (and of candle's `to_dtype(BF16)`) — a NaN stays
/// a NaN, made quiet — without its branches, so that a loop of them
/// vectorises. Adding 0x7FFF, plus the lowest bit kept, carries into the
/// kept bits exactly when the dropped half is above a tie, or a tie beside
/// an odd kept value; an overflow rounds to infinity, as it must.
#[inline(always)]
pub fn to_bf16(x: f32) -> half::bf16 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16;
    let nan = (b & 0x7FFF_FFFF) > 0x7F80_0000;
    half::bf16::from_bits(if nan { (b >> 16) | 0x0040 } else { rounded } as u16)
}
// ANCHOR_END: to_bf16

/// bf16 → f32, exactly: the bf16 is the f32's high half (a NaN made quiet,
/// as `half::bf16::to_f32` makes it), without a branch.
#[inline(always)]
pub fn from_bf16(x: half::bf16) -> f32 {
    let b = x.to_bits() as u32;
    let nan = (b & 0x7FFF) > 0x7F80;
    f32::from_bits(if nan { b | 0x0040 } else { b } << 16)
}

/// fp32 → bf16 bits, rounded to nearest, ties to even ([`to_bf16`]): the
/// compute copy of a master shard, ready for an all-gather of 2-byte elements.
pub fn bf16_bits(values: &[f32]) -> Vec<u16> {
    crate::kernels::map(values, |x| to_bf16(x).to_bits())
}

/// bf16 bits → a 1-D bf16 tensor (no arithmetic: the bits are kept).
pub fn bf16_tensor(bits: Vec<u16>) -> candle_core::Result<candle_core::Tensor> {
    let n = bits.len();
    let values: Vec<half::bf16> = bits.into_iter().map(half::bf16::from_bits).collect();
    candle_core::Tensor::from_vec(values, n, &candle_core::Device::Cpu)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    #[test]
    fn bf16_bits_round_like_candle() {
        let xs = [1.0f32, 1.003_906_3, 1.011_718_8, -3.3e-5, 65504.0, 1e-40, f32::MAX, -0.0];
        let ours = bf16_bits(&xs);
        let candle: Vec<u16> = Tensor::from_slice(&xs, xs.len(), &Device::Cpu)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap()
            .to_vec1::<half::bf16>()
            .unwrap()
            .into_iter()
            .map(|b| b.to_bits())
            .collect();
        assert_eq!(ours, candle);
        // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: it rounds to the even one, 1.
        assert_eq!(ours[1], 0x3F80);
        let t = bf16_tensor(ours.clone()).unwrap();
        assert_eq!(t.dtype(), DType::BF16);
        assert_eq!(t.to_vec1::<half::bf16>().unwrap().iter().map(|b| b.to_bits()).collect::<Vec<_>>(), ours);
    }

    /// Every rounding case of every exponent and sign — each high half with
    /// dropped halves below, at, just above and far above a tie, even and odd
    /// kept values, the extremes — and every NaN payload's high half: the
    /// bits `half` gives.
    #[test]
    fn to_bf16_and_from_bf16_give_halfs_bits() {
        let lows = [0u32, 1, 0x3FFF, 0x7FFE, 0x7FFF, 0x8000, 0x8001, 0xC000, 0xFFFE, 0xFFFF];
        for high in 0..=0xFFFFu32 {
            for low in lows {
                let x = f32::from_bits(high << 16 | low);
                assert_eq!(to_bf16(x).to_bits(), half::bf16::from_f32(x).to_bits(), "{:#010x}", x.to_bits());
            }
        }
        for b in 0..=0xFFFFu16 {
            let x = half::bf16::from_bits(b);
            assert_eq!(from_bf16(x).to_bits(), x.to_f32().to_bits(), "{b:#06x}");
        }
        let xs: Vec<f32> = (0..100_000u32).map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761))).collect();
        let want: Vec<u16> = xs.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect();
        assert_eq!(bf16_bits(&xs), want, "the vectorised loop");
    }

    #[test]
    fn parses_and_prints() {
        assert_eq!("bf16".parse::<Precision>(), Ok(Precision::Bf16));
        assert_eq!(Precision::Fp32.to_string(), "fp32");
        assert_eq!(Precision::Bf16.bytes(), 2);
        assert!("fp16".parse::<Precision>().unwrap_err().contains("choose fp32 or bf16"));
    }
}
