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
//! | [`matmul`] | `a @ b`, batched, any strides; f32, bf16 (widened), f64 | each output element is one chain of fused multiply-adds over `k = 0, 1, …, K−1`, starting from 0 |
mod matmul;

pub use matmul::matmul;
