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

/// fp32 → bf16 bits, rounded to nearest, ties to even (what candle's
/// `to_dtype(BF16)` does): the compute copy of a master shard, ready for
/// an all-gather of 2-byte elements.
pub fn bf16_bits(values: &[f32]) -> Vec<u16> {
    values.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect()
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

    #[test]
    fn parses_and_prints() {
        assert_eq!("bf16".parse::<Precision>(), Ok(Precision::Bf16));
        assert_eq!(Precision::Fp32.to_string(), "fp32");
        assert_eq!(Precision::Bf16.bytes(), 2);
        assert!("fp16".parse::<Precision>().unwrap_err().contains("choose fp32 or bf16"));
    }
}
