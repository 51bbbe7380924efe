//! The fused ops run outside candle's graph, each kept with what its
//! backward needs, for a backward the project runs itself
//! ([`crate::model::BlockTape`]).
//!
//! candle's `Tensor::backward` adds every gradient into its GradStore — the
//! first one of each tensor into a fresh tensor of zeros (`0 + g`: a zeroed
//! allocation, then a pass that reads both and writes a third) — and each
//! op's backward reads its gradient from there. On a tape, each op's
//! gradients go straight to the op before it; only a tensor that two ops
//! read (the residual stream) has its two gradients added. The same bits as
//! candle's: `0 + g` is `g` for every gradient these ops produce (none is
//! −0: the matmul's chains start from +0, and LayerNorm's input gradient is
//! written +0 where it would be −0), and `a + b` is `b + a`.
use candle_core::{CustomOp3, Result, Tensor, bail};

use super::Probs;
use super::attention::Attention;
use super::layer_norm::LayerNorm;
use super::linear::{Linear, LinearThen};
use super::pointwise::Gelu;

/// One fused op of a tape: its backward, from the gradient of its output to
/// those of its three inputs `(x, w, b)`.
pub struct Taped(Box<dyn Backward + Send + Sync>);

impl Taped {
    /// `[dx, dw, db]` for `grad`, the gradient of the op's output.
    pub fn backward(&self, grad: &Tensor) -> Result<[Tensor; 3]> {
        self.0.backward(grad)
    }
}

trait Backward {
    fn backward(&self, grad: &Tensor) -> Result<[Tensor; 3]>;
}

/// The op (which keeps what its forward saved), its inputs and its output.
struct Op<C> {
    op: C,
    inputs: [Tensor; 3],
    out: Tensor,
}

impl<C: CustomOp3> Backward for Op<C> {
    fn backward(&self, grad: &Tensor) -> Result<[Tensor; 3]> {
        let [x, w, b] = &self.inputs;
        match self.op.bwd(x, w, b, &self.out, grad)? {
            (Some(dx), Some(dw), Some(db)) => Ok([dx, dw, db]),
            _ => bail!("{}: a gradient missing", self.op.name()),
        }
    }
}

fn run<C: CustomOp3 + Send + Sync + 'static>(op: C, x: &Tensor, w: &Tensor, b: &Tensor) -> Result<(Tensor, Taped)> {
    if x.track_op() || w.track_op() || b.track_op() {
        bail!("{}: a taped op takes tensors without a graph (detach them)", op.name());
    }
    let out = x.apply_op3_no_bwd(w, b, &op)?;
    let inputs = [x.clone(), w.clone(), b.clone()];
    Ok((out.clone(), Taped(Box::new(Op { op, inputs, out }))))
}

/// [`super::layer_norm`] on a tape.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<(Tensor, Taped)> {
    run(LayerNorm { eps }, x, w, b)
}

/// [`super::linear`] on a tape.
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<(Tensor, Taped)> {
    run(Linear, x, w, b)
}

/// [`super::linear_gelu`] on a tape.
pub fn linear_gelu(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<(Tensor, Taped)> {
    run(LinearThen::new(Gelu), x, w, b)
}

/// [`super::linear_attention`] on a tape.
pub fn linear_attention(x: &Tensor, w: &Tensor, b: &Tensor, n_head: usize, policy: Probs) -> Result<(Tensor, Taped)> {
    run(LinearThen::new(Attention::new(n_head, policy)), x, w, b)
}
