//! FSDP2's `MixedPrecisionPolicy`: the dtype a unit is all-gathered and
//! computed in (the sharded master stays fp32), and how the fp32 shard
//! becomes the bf16 bits it sends. The dtype gradients are reduced in
//! (`--reduce-dtype`, FSDP2's `reduce_dtype`) is the session's
//! (`Session::reduce_dtype`): it forms every gradient sum, lessons 01 and
//! 02's too; its flag and config row are here.
use candle_core::DType;
use fsdp_gpt::precision::bf16_bits;

/// The precision a unit is gathered and computed in.
#[derive(Debug, Clone, Copy)]
pub struct MixedPrecision {
    /// The dtype the parameters are all-gathered and computed in (the
    /// sharded master stays fp32): `F32` here, `BF16` under lesson 04's bf16.
    pub param_dtype: DType,
    /// Under a bf16 `param_dtype`: how a rank's fp32 shard becomes the bf16
    /// bits it sends (round to nearest even; lesson 04 passes its exercise 4.2).
    pub bf16_wire: fn(&[f32]) -> Vec<u16>,
}

impl Default for MixedPrecision {
    fn default() -> Self {
        Self { param_dtype: DType::F32, bf16_wire: bf16_bits }
    }
}

/// `--reduce-dtype` as a checkpoint records it: only bf16, which changes
/// the arithmetic (a run without the flag reduces in fp32, as before it existed).
pub fn reduce_flag(dtype: fsdp_comm::ReduceDtype) -> Vec<(&'static str, String)> {
    match dtype {
        fsdp_comm::ReduceDtype::F32 => vec![],
        fsdp_comm::ReduceDtype::Bf16 => vec![("--reduce-dtype", dtype.to_string())],
    }
}

/// The config table's row for `--reduce-dtype`.
pub fn describe_reduce(dtype: fsdp_comm::ReduceDtype) -> String {
    match dtype {
        fsdp_comm::ReduceDtype::F32 => "fp32, summed as a fixed pairwise tree".into(),
        fsdp_comm::ReduceDtype::Bf16 => {
            "bf16: every sum of the fixed pairwise tree rounded to bf16, 2 bytes per element reduce-scattered".into()
        }
    }
}
