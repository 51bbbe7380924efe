//! A linear layer, `x · wᵀ + b`, as one op.
//!
//! Composed, it is four nodes of candle's graph — a reshape to rows, the
//! matmul, the bias add, a reshape back — and in the backward each adds
//! its gradient into a fresh zeroed sum: six extra passes over the
//! activations per layer. Here it is one node, computed by [`super::matmul`]'s
//! chains and [`super::bias_add`]'s row sums, rounded where they round, so
//! it gives those ops' bits:
//!
//! ```text
//! forward   y = x·wᵀ + b
//! backward  dx = g·w,   dw = gᵀ·x,   db = Σ_rows g
//! ```
//!
//! [`linear_gelu`] and [`linear_attention`] are the layer and the op after
//! it as one node: `c_fc` with its GELU, `c_attn` with the attention. The
//! layer's output h — (B, T, 4C) and (B, T, 3C), among a block's widest
//! activations — stays in memory as before, kept by the op rather than by
//! the graph; what changes is its gradient. candle adds every gradient it
//! passes on into a sum that starts as a fresh zeroed tensor (`zeros_like`,
//! then `add`): for h, a memset and an add over 4C (3C) values per token,
//! gone once dh goes from the GELU's (the attention's) backward straight
//! to the layer's. The bits are the same: each part runs its own op's code,
//! and `0 + dh` differs from `dh` only where dh is −0, which the layer's
//! backward turns into +0 either way (its chains and `db`'s row sums start
//! from +0).
use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp3, DType, Device, Layout, Result, Shape, Tensor, bail};
use half::bf16;

use super::Probs;
use super::attention::Attention;
use super::common::{Calc, cpu, from_bf16, map_rows, narrow, nonempty, row_sum, tensor_from, to_bf16, values, widen};
use super::matmul::{Operand, products_bf16};
use super::pointwise::Gelu;

/// `x · wᵀ + b` for `x` (…, in), `w` (out, in) (torch's layout), `b` (out).
/// Differentiable in all three.
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    x.apply_op3(w, b, Linear)
}

/// `gelu(x · wᵀ + b)`, the MLP's `c_fc` and its GELU, as one op. Differentiable in all three.
pub fn linear_gelu(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    x.apply_op3(w, b, LinearThen::new(Gelu))
}

/// [`super::attention_with`] of `x · wᵀ + b`, `c_attn` and the attention
/// after it, as one op: (B, T, C) → (B, T, C). Differentiable in all three.
pub fn linear_attention(x: &Tensor, w: &Tensor, b: &Tensor, n_head: usize, policy: Probs) -> Result<Tensor> {
    x.apply_op3(w, b, LinearThen::new(Attention::new(n_head, policy)))
}

pub(super) struct Linear;

/// [`Linear`], then `then` on its output, which the op keeps for the backward.
pub(super) struct LinearThen<F> {
    then: F,
    h: Mutex<Option<Tensor>>,
}

impl<F> LinearThen<F> {
    pub(super) fn new(then: F) -> Self {
        Self { then, h: Mutex::new(None) }
    }
}

impl<F: CustomOp1> CustomOp3 for LinearThen<F> {
    fn name(&self) -> &'static str {
        "linear-then"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (h, shape) = Linear.cpu_fwd(s1, l1, s2, l2, s3, l3)?;
        let out = self.then.cpu_fwd(&h, &Layout::contiguous(shape.clone()))?;
        *self.h.lock().expect("not poisoned") = Some(tensor_from(h, shape)?);
        Ok(out)
    }

    /// `then`'s backward gives dh, which goes to the layer's backward as it is.
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let Some(h) = self.h.lock().expect("not poisoned").clone() else {
            bail!("linear then {}: backward before its forward", self.then.name())
        };
        let Some(dh) = self.then.bwd(&h, res, grad)? else { bail!("{}: no gradient for its input", self.then.name()) };
        let (dx, dw, db) = grads(x, w, b, dh)?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

/// A row-major (rows, cols) matrix at `offset`, or its transpose.
fn matrix(offset: usize, rows: usize, cols: usize, transposed: bool) -> Operand {
    match transposed {
        false => Operand { batch_offsets: vec![offset], rows, cols, row_stride: cols, col_stride: 1 },
        true => Operand { batch_offsets: vec![offset], rows: cols, cols: rows, row_stride: 1, col_stride: cols },
    }
}

/// y (rows, out) = x·wᵀ + b, in f32 or f64.
fn forward<T: Calc>(x: &[T], w: &[T], b: &[T], (rows, n_in, n_out): (usize, usize, usize)) -> Vec<T> {
    let mut y = T::mm(&matrix(0, rows, n_in, false), x, &matrix(0, n_out, n_in, true), w);
    for row in y.chunks_exact_mut(n_out) {
        row.iter_mut().zip(b).for_each(|(y, &b)| *y += b);
    }
    y
}

/// (dx, dw, db) in f32 or f64.
fn backward<T: Calc>(
    x: &[T],
    w: &[T],
    g: &[T],
    (rows, n_in, n_out): (usize, usize, usize),
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let dx = T::mm(&matrix(0, rows, n_out, false), g, &matrix(0, n_out, n_in, false), w); // g·w
    let dw = T::mm(&matrix(0, rows, n_out, true), g, &matrix(0, rows, n_in, false), x); // gᵀ·x
    (dx, dw, row_sum(g, n_out, |g| g))
}

/// The bf16 forward: `round(round(x·wᵀ) + b)` ([`forward`]'s roundings),
/// the products' chains read from the bf16 operands themselves (widened as
/// the matmul packs them) and each output element rounded in one pass.
fn forward_bf16(x: &[bf16], w: &[bf16], b: &[bf16], (rows, n_in, n_out): (usize, usize, usize)) -> Vec<bf16> {
    let y = products_bf16(&matrix(0, rows, n_in, false), x, &matrix(0, n_out, n_in, true), w);
    map_rows(&y, &widen(b), |y, b| to_bf16(from_bf16(to_bf16(y)) + b))
}

/// The bf16 backward (`dx = g·w`, `dw = gᵀ·x`, `db = Σ_rows g`, each rounded
/// once), read from the bf16 tensors themselves, one gradient at a time.
fn backward_bf16(
    x: &[bf16],
    w: &[bf16],
    g: &[bf16],
    (rows, n_in, n_out): (usize, usize, usize),
) -> (Vec<bf16>, Vec<bf16>, Vec<bf16>) {
    let dx = narrow(products_bf16(&matrix(0, rows, n_out, false), g, &matrix(0, n_out, n_in, false), w)); // g·w
    let dw = narrow(products_bf16(&matrix(0, rows, n_out, true), g, &matrix(0, rows, n_in, false), x)); // gᵀ·x
    let db = narrow(row_sum(g, n_out, from_bf16));
    (dx, dw, db)
}

/// The three gradients as tensors: dx like x, dw (out, in), db (out).
fn tensors<T: candle_core::WithDType>(
    (dx, dw, db): (Vec<T>, Vec<T>, Vec<T>),
    x_shape: Shape,
    (_, n_in, n_out): (usize, usize, usize),
) -> Result<(Tensor, Tensor, Tensor)> {
    let dev = Device::Cpu;
    Ok((
        Tensor::from_vec(dx, x_shape, &dev)?,
        Tensor::from_vec(dw, (n_out, n_in), &dev)?,
        Tensor::from_vec(db, n_out, &dev)?,
    ))
}

/// (rows, in, out) from the shapes, checked.
fn dims(x: &[usize], w: &[usize], b: &[usize]) -> Result<(usize, usize, usize)> {
    nonempty(x, "linear")?;
    nonempty(w, "linear")?;
    let (&n_in, lead) = x.split_last().expect("nonempty: x has a last dimension");
    match (w, b) {
        (&[n_out, wi], &[bo]) if wi == n_in && bo == n_out => Ok((lead.iter().product(), n_in, n_out)),
        _ => bail!("linear: x {x:?} needs w of (out, {n_in}) and b of (out), got {w:?} and {b:?}"),
    }
}

impl CustomOp3 for Linear {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let d = dims(l1.dims(), l2.dims(), l3.dims())?;
        let out = match (s1, s2, s3) {
            (CpuStorage::F32(_), CpuStorage::F32(_), CpuStorage::F32(_)) => CpuStorage::F32(forward(
                values(s1, l1, "linear")?,
                values(s2, l2, "linear")?,
                values(s3, l3, "linear")?,
                d,
            )),
            (CpuStorage::F64(_), CpuStorage::F64(_), CpuStorage::F64(_)) => CpuStorage::F64(forward(
                values(s1, l1, "linear")?,
                values(s2, l2, "linear")?,
                values(s3, l3, "linear")?,
                d,
            )),
            (CpuStorage::BF16(_), CpuStorage::BF16(_), CpuStorage::BF16(_)) => CpuStorage::BF16(forward_bf16(
                values(s1, l1, "linear")?,
                values(s2, l2, "linear")?,
                values(s3, l3, "linear")?,
                d,
            )),
            _ => bail!(
                "linear: operands of one dtype, f32, bf16 or f64, got {:?}, {:?}, {:?}",
                s1.dtype(),
                s2.dtype(),
                s3.dtype()
            ),
        };
        let mut shape = l1.dims().to_vec();
        *shape.last_mut().expect("x has a last dimension") = d.2;
        Ok((out, Shape::from(shape)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = grads(x, w, b, grad.clone())?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

/// The layer's (dx, dw, db) for `grad`, which it takes: a gradient nothing
/// else holds (a [`LinearThen`]'s dh) is freed once the three are made.
fn grads(x: &Tensor, w: &Tensor, b: &Tensor, grad: Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let d = dims(x.dims(), w.dims(), b.dims())?;
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    // The argument moved into the block and gone at its end (`let grad = grad.contiguous()?` would
    // keep a second handle to the end of the function): for a LinearThen's dh this is then the
    // only one, and dropping it frees the buffer.
    let grad = {
        let g = grad;
        if g.is_contiguous() { g } else { g.contiguous()? }
    };
    let (sx, lx) = x.storage_and_layout();
    let (sw, lw) = w.storage_and_layout();
    let (sx, sw) = (cpu(&sx, "linear")?, cpu(&sw, "linear")?);
    let shape = lx.shape().clone();
    if x.dtype() == DType::BF16 {
        let (sg, lg) = grad.storage_and_layout();
        let g = values(cpu(&sg, "linear")?, lg, "linear")?;
        let grads = backward_bf16(values(sx, lx, "linear")?, values(sw, lw, "linear")?, g, d);
        return tensors(grads, shape, d);
    }
    let (sg, lg) = grad.storage_and_layout();
    let sg = cpu(&sg, "linear")?;
    // f32 and f64: in their own precision, nothing rounded
    macro_rules! in_own {
        ($t:ty) => {
            tensors(
                backward::<$t>(values(sx, lx, "linear")?, values(sw, lw, "linear")?, values(sg, lg, "linear")?, d),
                shape,
                d,
            )
        };
    }
    match x.dtype() {
        DType::F32 => in_own!(f32),
        DType::F64 => in_own!(f64),
        dt => bail!("linear supports f32, bf16 and f64, got {dt:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::super::common::testing::{bits, random};
    use super::*;
    use crate::kernels::{bias_add, matmul};
    use candle_core::Var;

    /// The same layer from the separate ops: reshape, matmul, bias add, reshape.
    fn composed(x: &Tensor, w: &Tensor, b: &Tensor) -> Tensor {
        let (bs, t, cin) = x.dims3().unwrap();
        let y = bias_add(&matmul(&x.reshape((bs * t, cin)).unwrap(), &w.t().unwrap()).unwrap(), b).unwrap();
        y.reshape((bs, t, w.dims()[0])).unwrap()
    }

    /// The fused layer and the composed ops give the same bits, forward and
    /// backward (all three gradients), in f32, bf16 and f64.
    #[test]
    fn equals_the_composed_ops_bit_for_bit() {
        let (x, w, b, g) = (random(&[2, 7, 19], 1), random(&[23, 19], 2), random(&[23], 3), random(&[2, 7, 23], 4));
        for dtype in [DType::F32, DType::BF16, DType::F64] {
            let vars = || -> Vec<Var> {
                [&x, &w, &b].iter().map(|t| Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap()).collect()
            };
            let (f, c) = (vars(), vars());
            let g = g.to_dtype(dtype).unwrap();
            let yf = linear(f[0].as_tensor(), f[1].as_tensor(), f[2].as_tensor()).unwrap();
            let yc = composed(c[0].as_tensor(), c[1].as_tensor(), c[2].as_tensor());
            assert_eq!(bits(&yf), bits(&yc), "{dtype:?} forward");
            let gf = (&yf * &g).unwrap().sum_all().unwrap().backward().unwrap();
            let gc = (&yc * &g).unwrap().sum_all().unwrap().backward().unwrap();
            for (k, name) in ["x", "w", "b"].iter().enumerate() {
                let (a, e) = (gf.get(f[k].as_tensor()).unwrap(), gc.get(c[k].as_tensor()).unwrap());
                assert_eq!(bits(a), bits(e), "{dtype:?} d{name}");
            }
        }
    }

    /// `linear_gelu` and `linear_attention` (both policies) give the bits of
    /// the layer and the op after it as two nodes, forward and backward (x,
    /// w, b), in f32, bf16 and f64 — including where dh is −0, which
    /// candle's sum makes +0: every third column of g is 0, and +0 · gelu′(h)
    /// is −0 wherever gelu′ is negative (h below about −0.75); a bias of −20
    /// puts all of those columns' h there, so their db is a sum of −0s alone,
    /// +0 only because the row sums start from +0.
    #[test]
    fn a_layer_and_the_op_after_it_equal_the_two_ops_bit_for_bit() {
        use crate::kernels::{attention_with, gelu};
        type Op = fn(&Tensor, &Tensor, &Tensor) -> Tensor;
        let fused_gelu: Op = |x, w, b| linear_gelu(x, w, b).unwrap();
        let gelu_after: Op = |x, w, b| gelu(&linear(x, w, b).unwrap()).unwrap();
        let fused_keep: Op = |x, w, b| linear_attention(x, w, b, 3, Probs::Keep).unwrap();
        let keep_after: Op = |x, w, b| attention_with(&linear(x, w, b).unwrap(), 3, Probs::Keep).unwrap();
        let fused_again: Op = |x, w, b| linear_attention(x, w, b, 3, Probs::Recompute).unwrap();
        let again_after: Op = |x, w, b| attention_with(&linear(x, w, b).unwrap(), 3, Probs::Recompute).unwrap();
        // (name, width in, width out, the fused op, the two ops)
        let cases = [
            ("gelu", 24, 36, fused_gelu, gelu_after),
            ("attention, P kept", 12, 36, fused_keep, keep_after),
            ("attention, P recomputed", 12, 36, fused_again, again_after),
        ];
        for (name, n_in, n_out, fused, composed) in cases {
            let (x, w) = (random(&[2, 9, n_in], 11), random(&[n_out, n_in], 12));
            let low: Vec<f64> = (0..n_out).map(|o| if o % 3 == 0 { -20.0 } else { 0.0 }).collect();
            let b = (random(&[n_out], 13) + Tensor::from_vec(low, n_out, &Device::Cpu).unwrap()).unwrap();
            for dtype in [DType::F32, DType::BF16, DType::F64] {
                let vars = || -> Vec<Var> {
                    [&x, &w, &b].iter().map(|t| Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap()).collect()
                };
                let (f, c) = (vars(), vars());
                let yf = fused(f[0].as_tensor(), f[1].as_tensor(), f[2].as_tensor());
                let yc = composed(c[0].as_tensor(), c[1].as_tensor(), c[2].as_tensor());
                assert_eq!(bits(&yf), bits(&yc), "{name}, {dtype:?}: forward");
                let g = random(yf.dims(), 14).flatten_all().unwrap().to_vec1::<f64>().unwrap();
                let g: Vec<f64> = g.iter().enumerate().map(|(i, &v)| if i % 3 == 0 { 0.0 } else { v }).collect();
                let g = Tensor::from_vec(g, yf.dims(), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
                let gf = (&yf * &g).unwrap().sum_all().unwrap().backward().unwrap();
                let gc = (&yc * &g).unwrap().sum_all().unwrap().backward().unwrap();
                for (k, arg) in ["x", "w", "b"].iter().enumerate() {
                    let (a, e) = (gf.get(f[k].as_tensor()).unwrap(), gc.get(c[k].as_tensor()).unwrap());
                    assert_eq!(bits(a), bits(e), "{name}, {dtype:?}: d{arg}");
                }
                if name == "gelu" && dtype == DType::F32 {
                    // the case is there: dh = g · gelu′(h) has −0s, which candle's sum turns into +0
                    let h = linear(f[0].as_tensor(), f[1].as_tensor(), f[2].as_tensor()).unwrap();
                    let dh = h.apply_op2_no_bwd(&g, &super::super::pointwise::GeluBackward).unwrap();
                    let dh: Vec<f32> = dh.flatten_all().unwrap().to_vec1().unwrap();
                    assert!(dh.iter().any(|v| v.to_bits() == 0x8000_0000), "no −0 in dh: the test misses its case");
                }
            }
        }
    }

    /// Every gradient against central finite differences of `sum(y · g)`, in f64.
    #[test]
    fn backward_matches_finite_differences() {
        let (x, w, b, g) = (random(&[2, 3, 4], 5), random(&[5, 4], 6), random(&[5], 7), random(&[2, 3, 5], 8));
        let f = |a: &[Tensor]| {
            (linear(&a[0], &a[1], &a[2]).unwrap() * &g).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap()
        };
        let v: Vec<Var> = [&x, &w, &b].iter().map(|t| Var::from_tensor(t).unwrap()).collect();
        let store = (linear(v[0].as_tensor(), v[1].as_tensor(), v[2].as_tensor()).unwrap() * &g)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let base = vec![x.clone(), w.clone(), b.clone()];
        for k in 0..3 {
            let analytic: Vec<f64> = store.get(v[k].as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            for (e, &a) in analytic.iter().enumerate() {
                let at = |d: f64| {
                    let mut args = base.clone();
                    let mut p: Vec<f64> = args[k].flatten_all().unwrap().to_vec1().unwrap();
                    p[e] += d;
                    args[k] = Tensor::from_vec(p, base[k].shape(), &Device::Cpu).unwrap();
                    f(&args)
                };
                let numeric = (at(1e-6) - at(-1e-6)) / 2e-6;
                assert!((a - numeric).abs() < 1e-7, "arg {k} element {e}: analytic {a}, numeric {numeric}");
            }
        }
    }
}
