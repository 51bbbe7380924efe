//! # Lesson 03 — the answers to `src/exercises.rs`
//!
//! The lesson runs these unless `--mine K` switches exercise 3.K to yours.
use anyhow::Context;
use candle_core::{Tensor, Var};
use fsdp_comm::{Comm, ExactSquares, MicroBatchSum};
use fsdp_gpt::model::add_grads;
use fsdp_harness::Session;

use crate::layerwise_shard::run_blocks;
use crate::units::FsdpUnit;

/// 3.1: the gradient of sum(out · g) with g held constant is g pulled back
/// through the unit (PyTorch: `torch.autograd.backward(out, grad_tensors=g)`),
/// so one backward of that scalar gives the weights' and the input's
/// gradients, the same bits as one backward through the whole graph (and lesson 01's).
pub fn backward_entry(
    s: &Session,
    unit: &FsdpUnit,
    p: &[Var],
    inputs: &[Tensor],
    upstream: &mut [Tensor],
) -> anyhow::Result<MicroBatchSum> {
    let tracked: Vec<Tensor> = p.iter().map(|v| v.as_tensor().clone()).collect(); // a graph to the Vars
    let mut sum = s.grad_sum(unit.layout().padded);
    for (x, g) in inputs.iter().zip(upstream.iter_mut()) {
        let x = Var::from_tensor(x)?; // a leaf, so backward reaches the input
        let out = run_blocks(s, unit, &tracked, x.as_tensor())?; // recompute, with a graph
        let grads = (out * &*g)?.sum_all()?.backward()?;
        sum.add(|buf| add_grads(&grads, p, buf))?;
        *g = grads.get(&x).context("unit input grad")?.detach();
    }
    Ok(sum)
}

/// 3.2: each element squared exactly and added into one fixed-point
/// integer, then every rank's integer added (exact: any order, the same
/// bits); only the square root rounds.
pub fn global_norm(group: &Comm, shards: &[&[f32]]) -> f64 {
    let mut mine = ExactSquares::default();
    for g in shards {
        mine.merge(&ExactSquares::of(g));
    }
    group.exact_sum(&mine).norm()
}
