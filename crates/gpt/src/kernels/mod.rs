//! Kernels of our own, as candle custom ops with a backward.
//!
//! Why not candle's: its CPU matmul (the `gemm` crate) picks its blocking
//! from the cache sizes it reads off the machine and its micro-kernel from
//! the instruction set, and a contraction longer than one block is summed
//! block by block. So the same binary, on the same inputs, rounds
//! differently on another CPU. The kernels here fix every sum's order by
//! construction, so that the project's weights are the same bits on every
//! x86-64 machine with AVX2 and FMA (see the introduction for what is promised).
//!
//! | kernel | what it computes | its one order |
//! |---|---|---|
//! | [`matmul`] | `a @ b`, batched, any strides; f32, bf16 (widened), f64; blocked by the cache sizes ([`Blocks`]), tiled per instruction set ([`Isa`]) | each output element is one chain of fused multiply-adds over `k = 0, 1, …, K−1`, starting from 0, each k-block continuing it |
//! | [`layer_norm`] | LayerNorm over the last dimension, forward and backward one pass each | each row's sums over `c = 0, 1, …, C−1`; `dw`, `db` over the rows in order |
//! | [`linear`] | `x · wᵀ + b`, one op | [`matmul`]'s chains, [`bias_add`]'s row sums: their bits |
//! | [`linear_gelu`], [`linear_attention`] | a linear layer and the GELU or the attention after it, one op (the model's `c_fc` and `c_attn`): the layer's output gradient (dh) goes straight to the layer's backward, not through candle's zeroed sum | the two ops': their bits |
//! | [`bias_add`] | a linear layer's `x + b`; its backward sums the gradient over the rows | `db` over the rows in order |
//! | [`add`] | `a + b`, the residual adds (bf16 rounded once, the same bits on every CPU, where candle's bf16 add flushes denormal sums on a CPU with AVX512_BF16) | element-wise |
//! | [`gelu`] | erf GELU, its backward in one pass | element-wise; its own `erf` and `exp` in plain f32 operations |
//! | [`attention`] | causal self-attention from `c_attn`'s output to the merged heads, one op; its probabilities kept for the backward or recomputed there ([`attention_with`], [`Probs`]) | [`matmul`]'s chains and [`causal_softmax`]'s rows, rounded where they round: their bits |
//! | [`tape`] | the fused ops above run outside candle's graph, each kept with what its backward needs: a block's backward the project runs itself, each gradient handed straight on | theirs: the same bits as through candle's GradStore |
//! | [`causal_softmax`] | `softmax(scale · att + causal mask)` in one pass, and its backward in one | each row's sums over the visible keys `k = 0, 1, …, i`, in order (its max, exact, in any order; glibc's `expf`, four lanes at a time, to its bits) |
mod attention;
mod common;
mod expf;
mod layer_norm;
mod linear;
mod matmul;
mod pointwise;
mod softmax;
pub mod tape;

pub use attention::{Probs, attention, attention_with};
pub(crate) use common::map;
pub use common::{elementwise, zip_update};
pub use layer_norm::layer_norm;
pub use linear::{linear, linear_attention, linear_gelu};
pub use matmul::{
    Bf16Dot, Bf16Route, Blocks, Isa, bf16_self_test, check_env as check_matmul_env, matmul, matmul_bf16_on, matmul_on,
};
pub use pointwise::{add, bias_add, gelu};
pub use softmax::causal_softmax;
