//! Causal softmax, fused: `softmax(scale · att + causal mask)` over the
//! last dimension, in one pass, with a backward in one more.
//!
//! nanoGPT writes it as three ops (scale, `masked_fill` with −∞, softmax);
//! composed from candle's ops that is eight passes over (B, nh, T, T) —
//! scale, mask add, max, subtract, exp, sum, divide — each into a fresh
//! tensor the graph keeps, and a backward through each of them, including
//! a gradient for the mask, a constant. Here the graph keeps the op's input
//! and output, nothing between, and the backward is one pass:
//!
//! ```text
//! forward   y[j] = exp(s·x[j] − m) / Σₖ exp(s·x[k] − m)    over the visible keys k ≤ i; 0 beyond
//! backward  dx[j] = s · y[j] · (g[j] − Σₖ g[k]·y[k])
//! ```
//!
//! Row `i` of each (T, T) matrix is query position `i`, which sees keys
//! `0..=i`. Each row's max and sums run over `k = 0, 1, …, i` in order; the
//! `exp` is glibc's `expf`, so the bits are those of every x86-64 CPU with
//! AVX2 and FMA under Debian 12's glibc (see the introduction). bf16 rows are widened to
//! f32, computed in f32 and rounded once; f32 and f64 compute in their own
//! precision.
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor, bail};
use half::bf16;

/// `softmax(scale · att + causal mask)` over the last dimension; `att` is
/// (…, T, T). Differentiable.
pub fn causal_softmax(att: &Tensor, scale: f64) -> Result<Tensor> {
    att.apply_op1(CausalSoftmax { scale })
}

struct CausalSoftmax {
    scale: f64,
}

/// The backward as an op of its own: (y, g) → dx, one pass.
struct CausalSoftmaxBackward {
    scale: f64,
}

/// The rows of a contiguous (…, T, T) tensor: (T, its values from the start offset).
fn rows(l: &Layout) -> Result<(usize, std::ops::Range<usize>)> {
    let d = l.dims();
    super::common::nonempty(d, "causal_softmax")?;
    if d.len() < 2 || d[d.len() - 1] != d[d.len() - 2] {
        bail!("causal_softmax needs (…, T, T) scores, got {d:?}");
    }
    let Some((start, end)) = l.contiguous_offsets() else { bail!("causal_softmax needs contiguous scores") };
    Ok((d[d.len() - 1], start..end))
}

macro_rules! row_kernels {
    ($fwd:ident, $bwd:ident, $t:ty) => {
        /// One row of query position `i`: `y` from the scores `x`.
        pub(super) fn $fwd(x: &[$t], y: &mut [$t], i: usize, scale: $t) {
            let mut max = <$t>::NEG_INFINITY;
            for &v in &x[..=i] {
                max = max.max(v * scale);
            }
            let mut sum: $t = 0.0;
            for (y, &v) in y[..=i].iter_mut().zip(&x[..=i]) {
                *y = (v * scale - max).exp();
                sum += *y;
            }
            for y in &mut y[..=i] {
                *y /= sum;
            }
            y[i + 1..].fill(0.0);
        }

        /// One row: `dx` from the output `y` and its gradient `g`.
        pub(super) fn $bwd(y: &[$t], g: &[$t], dx: &mut [$t], i: usize, scale: $t) {
            let mut dot: $t = 0.0;
            for (&y, &g) in y[..=i].iter().zip(&g[..=i]) {
                dot += g * y;
            }
            for ((dx, &y), &g) in dx[..=i].iter_mut().zip(&y[..=i]).zip(&g[..=i]) {
                *dx = scale * y * (g - dot);
            }
            dx[i + 1..].fill(0.0);
        }
    };
}
row_kernels!(forward_f32, backward_f32, f32);
row_kernels!(forward_f64, backward_f64, f64);

/// Every row of `t`-long rows, by query position.
fn each_row(len: usize, t: usize, mut f: impl FnMut(std::ops::Range<usize>, usize)) {
    for (r, start) in (0..len).step_by(t).enumerate() {
        f(start..start + t, r % t);
    }
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "causal-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (t, range) = rows(l)?;
        let n = range.len();
        let out = match s {
            CpuStorage::F32(x) => {
                let (x, mut y) = (&x[range], vec![0f32; n]);
                each_row(n, t, |r, i| forward_f32(&x[r.clone()], &mut y[r], i, self.scale as f32));
                CpuStorage::F32(y)
            }
            CpuStorage::F64(x) => {
                let (x, mut y) = (&x[range], vec![0f64; n]);
                each_row(n, t, |r, i| forward_f64(&x[r.clone()], &mut y[r], i, self.scale));
                CpuStorage::F64(y)
            }
            CpuStorage::BF16(x) => {
                let (x, mut y) = (&x[range], vec![bf16::ZERO; n]);
                let (mut wide, mut out) = (vec![0f32; t], vec![0f32; t]); // one row at a time
                each_row(n, t, |r, i| {
                    wide.iter_mut().zip(&x[r.clone()]).for_each(|(w, &v)| *w = v.to_f32());
                    forward_f32(&wide, &mut out, i, self.scale as f32);
                    y[r].iter_mut().zip(&out).for_each(|(y, &v)| *y = bf16::from_f32(v));
                });
                CpuStorage::BF16(y)
            }
            _ => bail!("causal_softmax supports f32, bf16 and f64, got {:?}", s.dtype()),
        };
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        // `res` is the softmax's output y: all the backward needs.
        Ok(Some(res.apply_op2_no_bwd(&grad.contiguous()?, &CausalSoftmaxBackward { scale: self.scale })?))
    }
}

impl CustomOp2 for CausalSoftmaxBackward {
    fn name(&self) -> &'static str {
        "causal-softmax-backward"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let ((t, ry), (_, rg)) = (rows(l1)?, rows(l2)?);
        if l1.dims() != l2.dims() {
            bail!("causal_softmax backward: y {:?} and its gradient {:?} differ", l1.dims(), l2.dims());
        }
        let n = ry.len();
        let out = match (s1, s2) {
            (CpuStorage::F32(y), CpuStorage::F32(g)) => {
                let (y, g, mut dx) = (&y[ry], &g[rg], vec![0f32; n]);
                each_row(n, t, |r, i| backward_f32(&y[r.clone()], &g[r.clone()], &mut dx[r], i, self.scale as f32));
                CpuStorage::F32(dx)
            }
            (CpuStorage::F64(y), CpuStorage::F64(g)) => {
                let (y, g, mut dx) = (&y[ry], &g[rg], vec![0f64; n]);
                each_row(n, t, |r, i| backward_f64(&y[r.clone()], &g[r.clone()], &mut dx[r], i, self.scale));
                CpuStorage::F64(dx)
            }
            (CpuStorage::BF16(y), CpuStorage::BF16(g)) => {
                let (y, g, mut dx) = (&y[ry], &g[rg], vec![bf16::ZERO; n]);
                let (mut wy, mut wg, mut out) = (vec![0f32; t], vec![0f32; t], vec![0f32; t]);
                each_row(n, t, |r, i| {
                    wy.iter_mut().zip(&y[r.clone()]).for_each(|(w, &v)| *w = v.to_f32());
                    wg.iter_mut().zip(&g[r.clone()]).for_each(|(w, &v)| *w = v.to_f32());
                    backward_f32(&wy, &wg, &mut out, i, self.scale as f32);
                    dx[r].iter_mut().zip(&out).for_each(|(d, &v)| *d = bf16::from_f32(v));
                });
                CpuStorage::BF16(dx)
            }
            _ => bail!("causal_softmax backward: unsupported dtypes {:?}, {:?}", s1.dtype(), s2.dtype()),
        };
        Ok((out, l1.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::super::common::testing::{max_diff, random};
    use super::*;
    use candle_core::{D, DType, Device, Var};

    /// nanoGPT's three ops, composed from candle's: scale, mask with −∞, softmax.
    fn composite(att: &Tensor, scale: f64) -> Tensor {
        let t = att.dim(D::Minus1).unwrap();
        let mask: Vec<f64> = (0..t * t).map(|k| if k % t <= k / t { 0.0 } else { f64::NEG_INFINITY }).collect();
        let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu).unwrap().to_dtype(att.dtype()).unwrap();
        let att = (att * scale).unwrap().broadcast_add(&mask).unwrap();
        candle_nn::ops::softmax(&att, D::Minus1).unwrap()
    }

    /// The fused op computes what the composite computes, and so does its
    /// gradient: in f64 to 1e-12, in f32 to 1e-6; masked entries exactly 0.
    #[test]
    fn agrees_with_the_composite_ops_forward_and_backward() {
        let (x, g) = (random(&[2, 3, 7, 7], 1), random(&[2, 3, 7, 7], 2));
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-6)] {
            let (vf, vc) = (
                Var::from_tensor(&x.to_dtype(dtype).unwrap()).unwrap(),
                Var::from_tensor(&x.to_dtype(dtype).unwrap()).unwrap(),
            );
            let g = g.to_dtype(dtype).unwrap();
            let (yf, yc) = (causal_softmax(vf.as_tensor(), 0.37).unwrap(), composite(vc.as_tensor(), 0.37));
            assert!(max_diff(&yf, &yc) < tol, "{dtype:?} forward: {}", max_diff(&yf, &yc));
            let gf = (&yf * &g).unwrap().sum_all().unwrap().backward().unwrap();
            let gc = (&yc * &g).unwrap().sum_all().unwrap().backward().unwrap();
            let (gf, gc) = (gf.get(vf.as_tensor()).unwrap(), gc.get(vc.as_tensor()).unwrap());
            assert!(max_diff(gf, gc) < tol, "{dtype:?} backward: {}", max_diff(gf, gc));
            let y: Vec<f64> = yf.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            let masked = y.iter().enumerate().filter(|(k, _)| k % 7 > (k / 7) % 7);
            assert!(masked.clone().count() > 0 && masked.clone().all(|(_, &v)| v == 0.0));
        }
    }

    /// The backward against central finite differences of `sum(y · g)`, in f64.
    #[test]
    fn backward_matches_finite_differences() {
        let (x, g) = (random(&[1, 2, 5, 5], 3), random(&[1, 2, 5, 5], 4));
        let f =
            |x: &Tensor| (causal_softmax(x, 0.8).unwrap() * &g).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
        let v = Var::from_tensor(&x).unwrap();
        let store = (causal_softmax(v.as_tensor(), 0.8).unwrap() * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let analytic: Vec<f64> = store.get(v.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let flat: Vec<f64> = x.flatten_all().unwrap().to_vec1().unwrap();
        let h = 1e-6;
        for (k, &a) in analytic.iter().enumerate() {
            let at = |d: f64| {
                let mut p = flat.clone();
                p[k] += d;
                f(&Tensor::from_vec(p, x.shape(), &Device::Cpu).unwrap())
            };
            let numeric = (at(h) - at(-h)) / (2.0 * h);
            assert!((a - numeric).abs() < 1e-7, "element {k}: analytic {a}, numeric {numeric}");
        }
    }

    /// bf16 is widened, computed in f32 and rounded once: the f32 result, rounded.
    #[test]
    fn bf16_is_the_f32_result_rounded_once() {
        let x = random(&[2, 2, 9, 9], 5).to_dtype(DType::BF16).unwrap();
        let wide = causal_softmax(&x.to_dtype(DType::F32).unwrap(), 0.5).unwrap().to_dtype(DType::BF16).unwrap();
        let out = causal_softmax(&x, 0.5).unwrap();
        assert_eq!(out.dtype(), DType::BF16);
        let bits = |t: &Tensor| {
            t.flatten_all().unwrap().to_vec1::<bf16>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        assert_eq!(bits(&out), bits(&wide));
        // The backward too, from the same (y, g): the f32 one, rounded once.
        let g = random(&[2, 2, 9, 9], 6).to_dtype(DType::BF16).unwrap();
        let back = |y: &Tensor, g: &Tensor| y.apply_op2_no_bwd(g, &CausalSoftmaxBackward { scale: 0.5 }).unwrap();
        let wide = back(&out.to_dtype(DType::F32).unwrap(), &g.to_dtype(DType::F32).unwrap());
        assert_eq!(bits(&back(&out, &g)), bits(&wide.to_dtype(DType::BF16).unwrap()));
    }
}
