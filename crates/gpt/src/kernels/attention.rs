//! Causal self-attention's core, fused: from the `c_attn` output
//! (B, T, 3C) to the heads' outputs merged back to (B, T, C).
//!
//! In candle's ops that is twenty tensors per block: q, k and v narrowed,
//! reshaped, transposed and copied; the scores; the probabilities; their
//! product, transposed and copied back — each a node whose backward adds a
//! gradient (narrow's builds a zero-padded copy of the whole (B, T, 3C)).
//! Here it is one op that reads q, k and v in place (strided views of its
//! input) and keeps one tensor besides its output, the probabilities P:
//!
//! ```text
//! forward   S = q·kᵀ,  P = causal_softmax(S / √hs),  y = P·v            per batch item and head
//! backward  dP = dy·vᵀ,  dS = softmax′(P, dP),  dq = dS·k,  dk = dSᵀ·q,  dv = Pᵀ·dy
//! ```
//!
//! Every product is [`super::matmul`]'s chain and every softmax row
//! [`super::causal_softmax`]'s, rounded where those ops round (bf16 after
//! each), so it computes the same bits as those ops composed — the tests
//! hold it to that — in one node instead of twenty.
use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Result, Shape, Tensor, bail};
use half::bf16;

use super::matmul::{Operand, products_f32, products_f64};
use super::softmax::{backward_f32, backward_f64, forward_f32, forward_f64};

/// `softmax(q·kᵀ/√hs + causal mask)·v` for each of `n_head` heads, from
/// `qkv` (B, T, 3C) (q, k, v side by side, heads side by side in each) to
/// (B, T, C). Differentiable.
pub fn attention(qkv: &Tensor, n_head: usize) -> Result<Tensor> {
    qkv.apply_op1(Attention { n_head, probs: Mutex::new(None) })
}

struct Attention {
    n_head: usize,
    /// The forward's probabilities (B, nh, T, T), kept for the backward.
    probs: Mutex<Option<Tensor>>,
}

/// Shapes and the views the products read.
#[derive(Clone, Copy)]
struct Dims {
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
    hs: usize,
}

impl Dims {
    fn new(d: &[usize], nh: usize) -> Result<Self> {
        let &[b, t, c3] = d else { bail!("attention needs qkv of (B, T, 3C), got {d:?}") };
        let c = c3 / 3;
        if c3 % 3 != 0 || nh == 0 || c % nh != 0 {
            bail!("attention: qkv {d:?} does not split into q, k, v of {nh} heads");
        }
        Ok(Self { b, t, c, nh, hs: c / nh })
    }

    fn items(&self) -> usize {
        self.b * self.nh
    }

    /// Head h of batch b of the part at `base` (0 q, C k, 2C v) in a
    /// (B, T, `width`) buffer: (T, hs), or (hs, T) transposed.
    fn heads(&self, width: usize, base: usize, transposed: bool) -> Operand {
        let batch_offsets = (0..self.b)
            .flat_map(|b| (0..self.nh).map(move |h| (b, h)))
            .map(|(b, h)| b * self.t * width + base + h * self.hs)
            .collect();
        match transposed {
            false => Operand { batch_offsets, rows: self.t, cols: self.hs, row_stride: width, col_stride: 1 },
            true => Operand { batch_offsets, rows: self.hs, cols: self.t, row_stride: 1, col_stride: width },
        }
    }

    /// The items' (T, T) matrices, back to back; or each transposed.
    fn squares(&self, transposed: bool) -> Operand {
        let (t, batch_offsets) = (self.t, (0..self.items()).map(|i| i * self.t * self.t).collect());
        match transposed {
            false => Operand { batch_offsets, rows: t, cols: t, row_stride: t, col_stride: 1 },
            true => Operand { batch_offsets, rows: t, cols: t, row_stride: 1, col_stride: t },
        }
    }
}

/// The arithmetic in one precision: f32 (also bf16's, rounding after each
/// op) or f64 (the finite-difference tests).
trait Calc: Copy + Default + Send + Sync + 'static {
    fn mm(a: &Operand, x: &[Self], b: &Operand, y: &[Self]) -> Vec<Self>;
    fn softmax_row(x: &[Self], y: &mut [Self], i: usize, scale: f64);
    fn softmax_backward_row(y: &[Self], g: &[Self], dx: &mut [Self], i: usize, scale: f64);
}

impl Calc for f32 {
    fn mm(a: &Operand, x: &[f32], b: &Operand, y: &[f32]) -> Vec<f32> {
        products_f32(a, x, b, y)
    }
    fn softmax_row(x: &[f32], y: &mut [f32], i: usize, scale: f64) {
        forward_f32(x, y, i, scale as f32)
    }
    fn softmax_backward_row(y: &[f32], g: &[f32], dx: &mut [f32], i: usize, scale: f64) {
        backward_f32(y, g, dx, i, scale as f32)
    }
}

impl Calc for f64 {
    fn mm(a: &Operand, x: &[f64], b: &Operand, y: &[f64]) -> Vec<f64> {
        products_f64(a, x, b, y)
    }
    fn softmax_row(x: &[f64], y: &mut [f64], i: usize, scale: f64) {
        forward_f64(x, y, i, scale)
    }
    fn softmax_backward_row(y: &[f64], g: &[f64], dx: &mut [f64], i: usize, scale: f64) {
        backward_f64(y, g, dx, i, scale)
    }
}

/// (B·nh, T, hs) per head → columns `base + h·hs ..` of a (B, T, `width`) buffer.
fn merge<T: Copy>(d: Dims, from: &[T], into: &mut [T], width: usize, base: usize) {
    for (item, head) in from.chunks_exact(d.t * d.hs).enumerate() {
        let (b, h) = (item / d.nh, item % d.nh);
        for (t, row) in head.chunks_exact(d.hs).enumerate() {
            let at = b * d.t * width + t * width + base + h * d.hs;
            into[at..at + d.hs].copy_from_slice(row);
        }
    }
}

/// The forward: (y (B, T, C), P (B, nh, T, T)). `round` is applied where
/// the composed ops would round their outputs (bf16), else nothing.
fn forward<T: Calc>(d: Dims, qkv: &[T], round: impl Fn(&mut [T])) -> (Vec<T>, Vec<T>) {
    let (t, c3) = (d.t, 3 * d.c);
    let mut s = T::mm(&d.heads(c3, 0, false), qkv, &d.heads(c3, d.c, true), qkv); // q·kᵀ
    round(&mut s);
    let scale = 1.0 / (d.hs as f64).sqrt();
    let mut p = vec![T::default(); s.len()];
    for (r, (x, y)) in s.chunks_exact(t).zip(p.chunks_exact_mut(t)).enumerate() {
        T::softmax_row(x, y, r % t, scale);
    }
    drop(s);
    round(&mut p);
    let mut yh = T::mm(&d.squares(false), &p, &d.heads(c3, 2 * d.c, false), qkv); // P·v
    round(&mut yh);
    let mut y = vec![T::default(); d.b * t * d.c];
    merge(d, &yh, &mut y, d.c, 0);
    (y, p)
}

/// The backward: dqkv (B, T, 3C) from P and dy (B, T, C).
fn backward<T: Calc>(d: Dims, qkv: &[T], p: &[T], dy: &[T], round: impl Fn(&mut [T])) -> Vec<T> {
    let (t, c3) = (d.t, 3 * d.c);
    let dyh = d.heads(d.c, 0, false); // dy's heads, read in place
    let mut ds = T::mm(&dyh, dy, &d.heads(c3, 2 * d.c, true), qkv); // dP = dy·vᵀ
    round(&mut ds);
    let scale = 1.0 / (d.hs as f64).sqrt();
    let mut g = vec![T::default(); t];
    for (r, (y, dx)) in p.chunks_exact(t).zip(ds.chunks_exact_mut(t)).enumerate() {
        g.copy_from_slice(dx);
        T::softmax_backward_row(y, &g, dx, r % t, scale); // dS, in place
    }
    round(&mut ds);
    let mut dq = T::mm(&d.squares(false), &ds, &d.heads(c3, d.c, false), qkv); // dS·k
    round(&mut dq);
    let mut dk = T::mm(&d.squares(true), &ds, &d.heads(c3, 0, false), qkv); // dSᵀ·q
    round(&mut dk);
    drop(ds);
    let mut dv = T::mm(&d.squares(true), p, &dyh, dy); // Pᵀ·dy
    round(&mut dv);
    let mut dqkv = vec![T::default(); d.b * t * c3];
    for (part, base) in [(&dq, 0), (&dk, d.c), (&dv, 2 * d.c)] {
        merge(d, part, &mut dqkv, c3, base);
    }
    dqkv
}

fn to_bf16(v: &mut [f32]) {
    v.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32());
}

fn slice<'a, T: candle_core::WithDType>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [T]> {
    let Some((a, b)) = l.contiguous_offsets() else { bail!("attention needs contiguous operands") };
    Ok(&s.as_slice::<T>()?[a..b])
}

fn widen(x: &[bf16]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

fn narrow(x: Vec<f32>) -> Vec<bf16> {
    x.into_iter().map(bf16::from_f32).collect()
}

impl CustomOp1 for Attention {
    fn name(&self) -> &'static str {
        "causal-attention"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let d = Dims::new(l.dims(), self.n_head)?;
        let probs = (d.b, d.nh, d.t, d.t);
        let (y, p) = match s.dtype() {
            DType::F32 => {
                let (y, p) = forward(d, slice::<f32>(s, l)?, |_| {});
                (CpuStorage::F32(y), Tensor::from_vec(p, probs, &Device::Cpu)?)
            }
            DType::F64 => {
                let (y, p) = forward(d, slice::<f64>(s, l)?, |_| {});
                (CpuStorage::F64(y), Tensor::from_vec(p, probs, &Device::Cpu)?)
            }
            DType::BF16 => {
                let (y, p) = forward(d, &widen(slice::<bf16>(s, l)?), to_bf16);
                (CpuStorage::BF16(narrow(y)), Tensor::from_vec(narrow(p), probs, &Device::Cpu)?)
            }
            dt => bail!("attention supports f32, bf16 and f64, got {dt:?}"),
        };
        *self.probs.lock().expect("not poisoned") = Some(p);
        Ok((y, Shape::from((d.b, d.t, d.c))))
    }

    fn bwd(&self, qkv: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let p = self.probs.lock().expect("not poisoned").clone();
        let Some(p) = p else { bail!("attention backward before its forward") };
        let d = Dims::new(qkv.dims(), self.n_head)?;
        let (qkv, grad) = (qkv.contiguous()?, grad.contiguous()?);
        let (sq, lq) = qkv.storage_and_layout();
        let (sp, lp) = p.storage_and_layout();
        let (sg, lg) = grad.storage_and_layout();
        let (candle_core::Storage::Cpu(sq), candle_core::Storage::Cpu(sp), candle_core::Storage::Cpu(sg)) =
            (&*sq, &*sp, &*sg)
        else {
            bail!("attention runs on the CPU")
        };
        let shape = (d.b, d.t, 3 * d.c);
        let dqkv = match qkv.dtype() {
            DType::F32 => {
                let v = backward(d, slice::<f32>(sq, lq)?, slice(sp, lp)?, slice(sg, lg)?, |_| {});
                Tensor::from_vec(v, shape, &Device::Cpu)?
            }
            DType::F64 => {
                let v = backward(d, slice::<f64>(sq, lq)?, slice(sp, lp)?, slice(sg, lg)?, |_| {});
                Tensor::from_vec(v, shape, &Device::Cpu)?
            }
            DType::BF16 => {
                let (q, p, g) = (widen(slice(sq, lq)?), widen(slice(sp, lp)?), widen(slice(sg, lg)?));
                Tensor::from_vec(narrow(backward(d, &q, &p, &g, to_bf16)), shape, &Device::Cpu)?
            }
            dt => bail!("attention supports f32, bf16 and f64, got {dt:?}"),
        };
        Ok(Some(dqkv))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{causal_softmax, matmul};
    use candle_core::Var;

    fn random(shape: &[usize], seed: u64) -> Tensor {
        let mut rng = crate::rng::SplitMix64::new(seed);
        let n = shape.iter().product();
        Tensor::from_vec((0..n).map(|_| rng.normal()).collect::<Vec<f64>>(), shape, &Device::Cpu).unwrap()
    }

    /// The same attention from the separate ops: split, matmul, causal softmax, matmul, merge.
    fn composed(qkv: &Tensor, nh: usize) -> Tensor {
        let (b, t, c3) = qkv.dims3().unwrap();
        let (c, hs) = (c3 / 3, c3 / 3 / nh);
        let heads = |i: usize| {
            qkv.narrow(2, i * c, c)
                .unwrap()
                .reshape((b, t, nh, hs))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .contiguous()
                .unwrap()
        };
        let (q, k, v) = (heads(0), heads(1), heads(2));
        let att = causal_softmax(&matmul(&q, &k.t().unwrap()).unwrap(), 1.0 / (hs as f64).sqrt()).unwrap();
        matmul(&att, &v).unwrap().transpose(1, 2).unwrap().reshape((b, t, c)).unwrap()
    }

    fn bits(t: &Tensor) -> Vec<u64> {
        t.to_dtype(DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    }

    /// The fused op and the composed ops give the same bits, forward and
    /// backward, in f32, bf16 and f64.
    #[test]
    fn equals_the_composed_ops_bit_for_bit() {
        let (x, g) = (random(&[2, 9, 3 * 12], 1), random(&[2, 9, 12], 2));
        for dtype in [DType::F32, DType::BF16, DType::F64] {
            let (vf, vc) = (
                Var::from_tensor(&x.to_dtype(dtype).unwrap()).unwrap(),
                Var::from_tensor(&x.to_dtype(dtype).unwrap()).unwrap(),
            );
            let g = g.to_dtype(dtype).unwrap();
            let (yf, yc) = (attention(vf.as_tensor(), 3).unwrap(), composed(vc.as_tensor(), 3));
            assert_eq!(bits(&yf), bits(&yc), "{dtype:?} forward");
            let gf = (&yf * &g).unwrap().sum_all().unwrap().backward().unwrap();
            let gc = (&yc * &g).unwrap().sum_all().unwrap().backward().unwrap();
            assert_eq!(
                bits(gf.get(vf.as_tensor()).unwrap()),
                bits(gc.get(vc.as_tensor()).unwrap()),
                "{dtype:?} backward"
            );
        }
    }

    /// The backward against central finite differences of `sum(y · g)`, in f64.
    #[test]
    fn backward_matches_finite_differences() {
        let (x, g) = (random(&[1, 4, 3 * 4], 3), random(&[1, 4, 4], 4));
        let f = |x: &Tensor| (attention(x, 2).unwrap() * &g).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
        let v = Var::from_tensor(&x).unwrap();
        let store = (attention(v.as_tensor(), 2).unwrap() * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let analytic: Vec<f64> = store.get(v.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let flat: Vec<f64> = x.flatten_all().unwrap().to_vec1().unwrap();
        let h = 1e-6;
        for (e, &a) in analytic.iter().enumerate() {
            let at = |dx: f64| {
                let mut p = flat.clone();
                p[e] += dx;
                f(&Tensor::from_vec(p, x.shape(), &Device::Cpu).unwrap())
            };
            let numeric = (at(h) - at(-h)) / (2.0 * h);
            assert!((a - numeric).abs() < 1e-7, "element {e}: analytic {a}, numeric {numeric}");
        }
    }
}
