//! Causal self-attention's core, fused: from the `c_attn` output
//! (B, T, 3C) to the heads' outputs merged back to (B, T, C).
//!
//! In candle's ops that is twenty tensors per block: q, k and v narrowed,
//! reshaped, transposed and copied; the scores; the probabilities; their
//! product, transposed and copied back — each a node whose backward adds a
//! gradient (narrow's builds a zero-padded copy of the whole (B, T, 3C)).
//! Here it is one op that reads q, k and v in place (strided views of its
//! input); the graph keeps its input and output, and the op keeps one
//! tensor more, the probabilities P:
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
//!
//! P is the one buffer of a block that grows with T²: B·nh·T·T elements
//! against the block's 18·B·T·C others ([`crate::memory::block_activations`]).
//! [`Probs::Recompute`] keeps no P: the backward computes it again from q and
//! k, the same bits, one more q·kᵀ and softmax — *selective* recompute, where
//! `--recompute` recomputes a whole block.
use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Result, Shape, Tensor, bail};
use half::bf16;

use super::common::{Calc, cpu, from_bf16, nonempty, push_rounded, to_bf16, values, zip_update};
use super::matmul::{Operand, products_bf16};
use super::softmax::{ROWS as SOFTMAX_ROWS, backward_rows_f32, forward_rows_f32};

/// `softmax(q·kᵀ/√hs + causal mask)·v` for each of `n_head` heads, from
/// `qkv` (B, T, 3C) (q, k, v side by side, heads side by side in each) to
/// (B, T, C). Differentiable.
pub fn attention(qkv: &Tensor, n_head: usize) -> Result<Tensor> {
    attention_with(qkv, n_head, Probs::Keep)
}

/// [`attention`], keeping its probabilities for the backward or not.
pub fn attention_with(qkv: &Tensor, n_head: usize, policy: Probs) -> Result<Tensor> {
    qkv.apply_op1(Attention::new(n_head, policy))
}

/// What the attention op keeps between its forward and its backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Probs {
    /// The probabilities P (B, nh, T, T), as the composed ops would.
    #[default]
    Keep,
    /// Nothing beyond its input: the backward recomputes P from q and k
    /// (selective recompute, Megatron-LM's `--recompute-granularity selective`).
    Recompute,
}

pub(super) struct Attention {
    n_head: usize,
    policy: Probs,
    /// The forward's probabilities (B, nh, T, T), kept for the backward
    /// under [`Probs::Keep`].
    probs: Mutex<Option<Tensor>>,
}

impl Attention {
    pub(super) fn new(n_head: usize, policy: Probs) -> Self {
        Self { n_head, policy, probs: Mutex::new(None) }
    }
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
        nonempty(d, "attention")?;
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

/// (B·nh, T, hs) per head → columns `base + h·hs ..` of a (B, T, `width`) buffer.
fn merge<T: Copy>(d: Dims, from: &[T], into: &mut [T], width: usize, base: usize) {
    merge_with(d, from, into, width, base, |v| v)
}

/// [`merge`], each value passed through `f` on its way (f32 → bf16).
/// A head's row at a time at the SIMD width ([`zip_update`]).
fn merge_with<A: Copy, B: Copy>(
    d: Dims,
    from: &[A],
    into: &mut [B],
    width: usize,
    base: usize,
    f: impl Fn(A) -> B + Copy,
) {
    for (item, head) in from.chunks_exact(d.t * d.hs).enumerate() {
        let (b, h) = (item / d.nh, item % d.nh);
        for (t, row) in head.chunks_exact(d.hs).enumerate() {
            let at = b * d.t * width + t * width + base + h * d.hs;
            zip_update(&mut into[at..at + d.hs], row, |o, v| *o = f(v));
        }
    }
}

/// The forward from `qkv`'s storage, in its dtype: y (B, T, C) when
/// `with_y`, and P (B, nh, T, T) as a tensor when `keep_p`. A recomputing
/// backward asks for P alone — the same code, so the same bits.
fn forward(
    d: Dims,
    s: &CpuStorage,
    l: &Layout,
    with_y: bool,
    keep_p: bool,
) -> Result<(Option<CpuStorage>, Option<Tensor>)> {
    let shape = (d.b, d.nh, d.t, d.t);
    Ok(match s.dtype() {
        DType::F32 => {
            let (y, p) = forward_as(d, values::<f32>(s, l, "attention")?, with_y);
            (y.map(CpuStorage::F32), keep_p.then(|| Tensor::from_vec(p, shape, &Device::Cpu)).transpose()?)
        }
        DType::F64 => {
            let (y, p) = forward_as(d, values::<f64>(s, l, "attention")?, with_y);
            (y.map(CpuStorage::F64), keep_p.then(|| Tensor::from_vec(p, shape, &Device::Cpu)).transpose()?)
        }
        DType::BF16 => {
            let (y, p) = forward_bf16(d, values::<bf16>(s, l, "attention")?, with_y);
            (y.map(CpuStorage::BF16), keep_p.then(|| Tensor::from_vec(p, shape, &Device::Cpu)).transpose()?)
        }
        dt => bail!("attention supports f32, bf16 and f64, got {dt:?}"),
    })
}

/// The forward in f32 or f64: P = causal_softmax(q·kᵀ / √hs) (B·nh, T, T),
/// then, `with_y`, y = P·v merged back to (B, T, C).
fn forward_as<T: Calc>(d: Dims, qkv: &[T], with_y: bool) -> (Option<Vec<T>>, Vec<T>) {
    let (t, c3) = (d.t, 3 * d.c);
    let s = T::mm(&d.heads(c3, 0, false), qkv, &d.heads(c3, d.c, true), qkv); // q·kᵀ
    let scale = 1.0 / (d.hs as f64).sqrt();
    let mut p = vec![T::default(); s.len()];
    T::softmax_rows(&s, &mut p, t, 0, scale);
    drop(s);
    if !with_y {
        return (None, p);
    }
    let yh = T::mm(&d.squares(false), &p, &d.heads(c3, 2 * d.c, false), qkv); // P·v
    let mut y = vec![T::default(); d.b * t * d.c];
    merge(d, &yh, &mut y, d.c, 0);
    (Some(y), p)
}

/// The bf16 forward, as [`forward_as`] computes it with bf16's roundings:
/// the products read q, k, v (and P) as they are, in bf16, widened as the
/// matmul packs them; S and P are made in f32 `SOFTMAX_ROWS` rows at a time,
/// S rounded into a scratch block, P rounded into its bf16 buffer.
fn forward_bf16(d: Dims, qkv: &[bf16], with_y: bool) -> (Option<Vec<bf16>>, Vec<bf16>) {
    let (t, c3) = (d.t, 3 * d.c);
    let s = products_bf16(&d.heads(c3, 0, false), qkv, &d.heads(c3, d.c, true), qkv); // q·kᵀ, before rounding
    let scale = (1.0 / (d.hs as f64).sqrt()) as f32;
    let block = SOFTMAX_ROWS * t;
    let (mut rows, mut out) = (vec![0f32; block], vec![0f32; block]);
    let mut p = Vec::with_capacity(s.len());
    for (c, s) in s.chunks(block).enumerate() {
        let (rows, out) = (&mut rows[..s.len()], &mut out[..s.len()]);
        zip_update(rows, s, |r, v| *r = from_bf16(to_bf16(v))); // S, rounded
        forward_rows_f32(rows, out, t, c * SOFTMAX_ROWS % t, scale);
        push_rounded(&mut p, out);
    }
    drop((s, rows, out));
    if !with_y {
        return (None, p);
    }
    let yh = products_bf16(&d.squares(false), &p, &d.heads(c3, 2 * d.c, false), qkv); // P·v
    let mut y = vec![bf16::ZERO; d.b * t * d.c];
    merge_with(d, &yh, &mut y, d.c, 0, to_bf16);
    (Some(y), p)
}

/// The bf16 backward, as [`backward`] computes it with bf16's roundings: the
/// products read their bf16 operands as they are; dP is made in f32, dS
/// `SOFTMAX_ROWS` rows at a time (P widened into a scratch block) and kept in
/// bf16; dq, dk and dv each rounded into dqkv as they are merged.
fn backward_bf16(d: Dims, qkv: &[bf16], p: &[bf16], dy: &[bf16]) -> Vec<bf16> {
    let (t, c3) = (d.t, 3 * d.c);
    let dyh = d.heads(d.c, 0, false); // dy's heads, read in place
    let dp = products_bf16(&dyh, dy, &d.heads(c3, 2 * d.c, true), qkv); // dP = dy·vᵀ, before rounding
    let scale = (1.0 / (d.hs as f64).sqrt()) as f32;
    let block = SOFTMAX_ROWS * t;
    let (mut y, mut g, mut dx) = (vec![0f32; block], vec![0f32; block], vec![0f32; block]);
    let mut ds = Vec::with_capacity(dp.len());
    for (c, (pb, dpb)) in p.chunks(block).zip(dp.chunks(block)).enumerate() {
        let n = pb.len();
        let (y, g, dx) = (&mut y[..n], &mut g[..n], &mut dx[..n]);
        zip_update(y, pb, |o, v| *o = from_bf16(v));
        zip_update(g, dpb, |o, v| *o = from_bf16(to_bf16(v))); // dP, rounded
        backward_rows_f32(y, g, dx, t, c * SOFTMAX_ROWS % t, scale);
        push_rounded(&mut ds, dx); // dS, rounded
    }
    drop((dp, y, g, dx));
    let mut dqkv = vec![bf16::ZERO; d.b * t * c3];
    let dq = products_bf16(&d.squares(false), &ds, &d.heads(c3, d.c, false), qkv); // dS·k
    merge_with(d, &dq, &mut dqkv, c3, 0, to_bf16);
    drop(dq);
    let dk = products_bf16(&d.squares(true), &ds, &d.heads(c3, 0, false), qkv); // dSᵀ·q
    merge_with(d, &dk, &mut dqkv, c3, d.c, to_bf16);
    drop((dk, ds));
    let dv = products_bf16(&d.squares(true), p, &dyh, dy); // Pᵀ·dy
    merge_with(d, &dv, &mut dqkv, c3, 2 * d.c, to_bf16);
    dqkv
}

/// The backward in f32 or f64: dqkv (B, T, 3C) from P and dy (B, T, C).
fn backward<T: Calc>(d: Dims, qkv: &[T], p: &[T], dy: &[T]) -> Vec<T> {
    let (t, c3) = (d.t, 3 * d.c);
    let dyh = d.heads(d.c, 0, false); // dy's heads, read in place
    let mut ds = T::mm(&dyh, dy, &d.heads(c3, 2 * d.c, true), qkv); // dP = dy·vᵀ
    let scale = 1.0 / (d.hs as f64).sqrt();
    let block = SOFTMAX_ROWS * t; // the elements of the rows the softmax's backward takes together
    let mut g = vec![T::default(); block];
    for (c, (y, dx)) in p.chunks(block).zip(ds.chunks_mut(block)).enumerate() {
        let g = &mut g[..dx.len()];
        g.copy_from_slice(dx);
        T::softmax_backward_rows(y, g, dx, t, c * SOFTMAX_ROWS % t, scale); // dS, in place
    }
    let dq = T::mm(&d.squares(false), &ds, &d.heads(c3, d.c, false), qkv); // dS·k
    let dk = T::mm(&d.squares(true), &ds, &d.heads(c3, 0, false), qkv); // dSᵀ·q
    drop(ds);
    let dv = T::mm(&d.squares(true), p, &dyh, dy); // Pᵀ·dy
    let mut dqkv = vec![T::default(); d.b * t * c3];
    for (part, base) in [(&dq, 0), (&dk, d.c), (&dv, 2 * d.c)] {
        merge(d, part, &mut dqkv, c3, base);
    }
    dqkv
}

impl CustomOp1 for Attention {
    fn name(&self) -> &'static str {
        "causal-attention"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let d = Dims::new(l.dims(), self.n_head)?;
        let (y, p) = forward(d, s, l, true, self.policy == Probs::Keep)?;
        *self.probs.lock().expect("not poisoned") = p; // None under Probs::Recompute
        Ok((y.expect("the forward asked for y"), Shape::from((d.b, d.t, d.c))))
    }

    fn bwd(&self, qkv: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let d = Dims::new(qkv.dims(), self.n_head)?;
        let (qkv, grad) = (qkv.contiguous()?, grad.contiguous()?);
        let kept = self.probs.lock().expect("not poisoned").clone();
        let p = match (kept, self.policy) {
            (Some(p), _) => p,
            (None, Probs::Recompute) => {
                let (s, l) = qkv.storage_and_layout();
                forward(d, cpu(&s, "attention")?, l, false, true)?.1.expect("P asked for")
            }
            (None, Probs::Keep) => bail!("attention backward before its forward"),
        };
        let (sq, lq) = qkv.storage_and_layout();
        let (sp, lp) = p.storage_and_layout();
        let (sg, lg) = grad.storage_and_layout();
        let (sq, sp, sg) = (cpu(&sq, "attention")?, cpu(&sp, "attention")?, cpu(&sg, "attention")?);
        let shape = (d.b, d.t, 3 * d.c);
        let dqkv = match qkv.dtype() {
            DType::F32 => {
                let v = backward(
                    d,
                    values::<f32>(sq, lq, "attention")?,
                    values(sp, lp, "attention")?,
                    values(sg, lg, "attention")?,
                );
                Tensor::from_vec(v, shape, &Device::Cpu)?
            }
            DType::F64 => {
                let v = backward(
                    d,
                    values::<f64>(sq, lq, "attention")?,
                    values(sp, lp, "attention")?,
                    values(sg, lg, "attention")?,
                );
                Tensor::from_vec(v, shape, &Device::Cpu)?
            }
            DType::BF16 => {
                let v = backward_bf16(
                    d,
                    values(sq, lq, "attention")?,
                    values(sp, lp, "attention")?,
                    values(sg, lg, "attention")?,
                );
                Tensor::from_vec(v, shape, &Device::Cpu)?
            }
            dt => bail!("attention supports f32, bf16 and f64, got {dt:?}"),
        };
        Ok(Some(dqkv))
    }
}

#[cfg(test)]
mod tests {
    use super::super::common::testing::{bits, random};
    use super::*;
    use crate::kernels::{causal_softmax, matmul};
    use candle_core::Var;

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

    /// Recomputing P in the backward gives the same bits as keeping it,
    /// forward and backward, in f32, bf16 and f64; and keeps no P.
    #[test]
    fn recomputing_the_probabilities_changes_no_bit() {
        let (x, g) = (random(&[2, 9, 3 * 12], 5), random(&[2, 9, 12], 6));
        for dtype in [DType::F32, DType::BF16, DType::F64] {
            let grad = |policy: Probs| {
                let v = Var::from_tensor(&x.to_dtype(dtype).unwrap()).unwrap();
                let y = attention_with(v.as_tensor(), 3, policy).unwrap();
                let store = (&y * &g.to_dtype(dtype).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
                (bits(&y), bits(store.get(v.as_tensor()).unwrap()))
            };
            assert_eq!(grad(Probs::Keep), grad(Probs::Recompute), "{dtype:?}");
        }
        let op = Attention { n_head: 3, policy: Probs::Recompute, probs: Mutex::new(None) };
        x.apply_op1_no_bwd(&op).unwrap();
        assert!(op.probs.lock().unwrap().is_none(), "P kept under Probs::Recompute");
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
