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
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Tensor, bail};

use super::common::{Calc, cpu, narrow, nonempty, round_to_bf16, row_sum, values, widen};
use super::matmul::Operand;

/// `x · wᵀ + b` for `x` (…, in), `w` (out, in) (torch's layout), `b` (out).
/// Differentiable in all three.
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    x.apply_op3(w, b, Linear)
}

struct Linear;

/// A row-major (rows, cols) matrix at `offset`, or its transpose.
fn matrix(offset: usize, rows: usize, cols: usize, transposed: bool) -> Operand {
    match transposed {
        false => Operand { batch_offsets: vec![offset], rows, cols, row_stride: cols, col_stride: 1 },
        true => Operand { batch_offsets: vec![offset], rows: cols, cols: rows, row_stride: 1, col_stride: cols },
    }
}

/// y (rows, out) = round(x·wᵀ) + b, rounded.
fn forward<T: Calc>(
    x: &[T],
    w: &[T],
    b: &[T],
    (rows, n_in, n_out): (usize, usize, usize),
    round: impl Fn(&mut [T]),
) -> Vec<T> {
    let mut y = T::mm(&matrix(0, rows, n_in, false), x, &matrix(0, n_out, n_in, true), w);
    round(&mut y);
    for row in y.chunks_exact_mut(n_out) {
        row.iter_mut().zip(b).for_each(|(y, &b)| *y += b);
    }
    round(&mut y);
    y
}

/// (dx, dw, db), each rounded as the composed ops round theirs.
fn backward<T: Calc>(
    x: &[T],
    w: &[T],
    g: &[T],
    (rows, n_in, n_out): (usize, usize, usize),
    round: impl Fn(&mut [T]),
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let mut dx = T::mm(&matrix(0, rows, n_out, false), g, &matrix(0, n_out, n_in, false), w); // g·w
    round(&mut dx);
    let mut dw = T::mm(&matrix(0, rows, n_out, true), g, &matrix(0, rows, n_in, false), x); // gᵀ·x
    round(&mut dw);
    let mut db = row_sum(g, n_out, |g| g);
    round(&mut db);
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
                |_| {},
            )),
            (CpuStorage::F64(_), CpuStorage::F64(_), CpuStorage::F64(_)) => CpuStorage::F64(forward(
                values(s1, l1, "linear")?,
                values(s2, l2, "linear")?,
                values(s3, l3, "linear")?,
                d,
                |_| {},
            )),
            (CpuStorage::BF16(_), CpuStorage::BF16(_), CpuStorage::BF16(_)) => {
                let (x, w, b) = (
                    widen(values(s1, l1, "linear")?),
                    widen(values(s2, l2, "linear")?),
                    widen(values(s3, l3, "linear")?),
                );
                CpuStorage::BF16(narrow(forward(&x, &w, &b, d, round_to_bf16)))
            }
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
        let d = dims(x.dims(), w.dims(), b.dims())?;
        let (x, w, grad) = (x.contiguous()?, w.contiguous()?, grad.contiguous()?);
        let (sx, lx) = x.storage_and_layout();
        let (sw, lw) = w.storage_and_layout();
        let (sg, lg) = grad.storage_and_layout();
        let (sx, sw, sg) = (cpu(&sx, "linear")?, cpu(&sw, "linear")?, cpu(&sg, "linear")?);
        let shape = lx.shape().clone();
        let (dx, dw, db) = match x.dtype() {
            DType::F32 => tensors(
                backward::<f32>(
                    values(sx, lx, "linear")?,
                    values(sw, lw, "linear")?,
                    values(sg, lg, "linear")?,
                    d,
                    |_| {},
                ),
                shape,
                d,
            )?,
            DType::F64 => tensors(
                backward::<f64>(
                    values(sx, lx, "linear")?,
                    values(sw, lw, "linear")?,
                    values(sg, lg, "linear")?,
                    d,
                    |_| {},
                ),
                shape,
                d,
            )?,
            DType::BF16 => {
                let (x, w, g) = (
                    widen(values(sx, lx, "linear")?),
                    widen(values(sw, lw, "linear")?),
                    widen(values(sg, lg, "linear")?),
                );
                let (dx, dw, db) = backward(&x, &w, &g, d, round_to_bf16);
                tensors((narrow(dx), narrow(dw), narrow(db)), shape, d)?
            }
            dt => bail!("linear supports f32, bf16 and f64, got {dt:?}"),
        };
        Ok((Some(dx), Some(dw), Some(db)))
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
