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
//! `0..=i`. Each row's sums run over `k = 0, 1, …, i` in order (its max,
//! exact, in any order)
//! (in f32 four rows' sums step side by side, each still its own chain); the
//! `exp` is glibc's `expf`, four lanes at a time where glibc takes its fast
//! path ([`super::expf`], the bits of Debian 12's glibc), so the bits are
//! those of every x86-64 CPU with AVX2 and FMA under Debian 12's glibc (see
//! the introduction). bf16 rows are widened to f32, computed in f32
//! and rounded once; f32 and f64 compute in their own precision.
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor, bail};

use super::common::{from_bf16, push_rounded, zip_update};

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
// f64 runs these row by row; f32 runs the same chains through the row blocks below.
row_kernels!(forward_f64, backward_f64, f64);

/// How many rows' sums step together in the f32 kernels, as LayerNorm's
/// rows do (eight there; four here, where rows are short and ragged).
pub(super) const ROWS: usize = 4;

/// The blocks of `ROWS` rows (the last may have fewer) of `len` elements of
/// `t`-long rows, the first row of query position `i0`: each block's range,
/// and how many keys each of its rows sees (`i + 1`; 0 past the last row).
fn blocks(len: usize, t: usize, i0: usize) -> impl Iterator<Item = (std::ops::Range<usize>, [usize; ROWS])> {
    (0..len).step_by(ROWS * t).map(move |at| {
        let (range, first) = (at..len.min(at + ROWS * t), i0 + at / t);
        let rows = range.len() / t;
        (range, std::array::from_fn(|r| if r < rows { (first + r) % t + 1 } else { 0 }))
    })
}

/// For each row `r`, `term(r, 0) + term(r, 1) + …` over its `len[r]` terms,
/// added in that order from 0 — the rows' chains side by side while every
/// row has terms left, then each row's rest: the bits of summing each row
/// alone, with the additions of different rows overlapping.
#[inline(always)]
fn sums(len: [usize; ROWS], term: impl Fn(usize, usize) -> f32) -> [f32; ROWS] {
    let mut sum = [0f32; ROWS];
    let common = len.into_iter().min().unwrap_or(0);
    for k in 0..common {
        for (r, s) in sum.iter_mut().enumerate() {
            *s += term(r, k);
        }
    }
    for (r, s) in sum.iter_mut().enumerate() {
        for k in common..len[r] {
            *s += term(r, k);
        }
    }
    sum
}

/// The largest of `scale · x[k]`: eight running maxima, then the largest of
/// them. A max is exact, so any order gives the same value, but for the sign
/// of a ±0 tie, which the exp of `v · scale − max` cannot tell apart
/// (e^±0 = 1); `f32::max` skips NaN in every order.
#[inline(always)]
fn row_max(x: &[f32], scale: f32) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        lanes.iter_mut().zip(c).for_each(|(m, &v)| *m = m.max(v * scale));
    }
    let max = lanes.into_iter().fold(f32::NEG_INFINITY, f32::max);
    chunks.remainder().iter().fold(max, |m, &v| m.max(v * scale))
}

/// The f32 forward on whole rows (`x`, `y`: rows of length `t`, the first
/// of query position `i0`): per row `exp(s·x − max)` over the visible keys,
/// then [`ROWS`] rows' sums side by side, then the divides. Each row's exps,
/// sum and quotients are the one-row kernel's (`row_kernels!`) chain in f32,
/// its max the same value (the tests hold the bits to the one-row kernel);
/// only independent rows overlap. `exp` is glibc's `expf`, in
/// [`super::expf`]'s lanes on CPUs with AVX2 and FMA.
pub(super) fn forward_rows_f32(x: &[f32], y: &mut [f32], t: usize, i0: usize, scale: f32) {
    #[inline(always)]
    fn each(x: &[f32], y: &mut [f32], t: usize, i0: usize, scale: f32, exp: impl Fn(&mut [f32])) {
        for (range, vis) in blocks(x.len(), t, i0) {
            let (x, y) = (&x[range.clone()], &mut y[range]);
            for ((x, y), &n) in x.chunks_exact(t).zip(y.chunks_exact_mut(t)).zip(&vis) {
                let max = row_max(&x[..n], scale);
                y[..n].iter_mut().zip(&x[..n]).for_each(|(y, &v)| *y = v * scale - max);
                exp(&mut y[..n]);
                y[n..].fill(0.0);
            }
            let sum = sums(vis, |r, k| y[r * t + k]);
            for ((y, &n), sum) in y.chunks_exact_mut(t).zip(&vis).zip(sum) {
                y[..n].iter_mut().for_each(|y| *y /= sum);
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    if super::common::avx2_fma() {
        #[target_feature(enable = "avx2,fma")]
        fn on_fma(x: &[f32], y: &mut [f32], t: usize, i0: usize, scale: f32) {
            each(x, y, t, i0, scale, |v| super::expf::exp_in_place_fma(v))
        }
        // SAFETY: the CPU has AVX2 and FMA (detected).
        return unsafe { on_fma(x, y, t, i0, scale) };
    }
    each(x, y, t, i0, scale, super::expf::exp_in_place)
}

/// The f32 backward on whole rows, as [`forward_rows_f32`]: each row's
/// `Σ g·y` (the one-row kernel's chain) side by side with its block's
/// other rows', then `dx = s · y · (g − dot)`.
pub(super) fn backward_rows_f32(y: &[f32], g: &[f32], dx: &mut [f32], t: usize, i0: usize, scale: f32) {
    #[inline(always)]
    fn each(y: &[f32], g: &[f32], dx: &mut [f32], t: usize, i0: usize, scale: f32) {
        for (range, vis) in blocks(y.len(), t, i0) {
            let (y, g, dx) = (&y[range.clone()], &g[range.clone()], &mut dx[range]);
            let dot = sums(vis, |r, k| g[r * t + k] * y[r * t + k]);
            let rows = dx.chunks_exact_mut(t).zip(y.chunks_exact(t)).zip(g.chunks_exact(t));
            for ((((dx, y), g), &n), dot) in rows.zip(&vis).zip(dot) {
                dx[..n].iter_mut().zip(&y[..n]).zip(&g[..n]).for_each(|((dx, &y), &g)| *dx = scale * y * (g - dot));
                dx[n..].fill(0.0);
            }
        }
    }
    match super::common::avx2() {
        #[cfg(target_arch = "x86_64")]
        true => {
            #[target_feature(enable = "avx2")]
            fn on_avx2(y: &[f32], g: &[f32], dx: &mut [f32], t: usize, i0: usize, scale: f32) {
                each(y, g, dx, t, i0, scale)
            }
            // SAFETY: the CPU has AVX2 (detected).
            unsafe { on_avx2(y, g, dx, t, i0, scale) }
        }
        _ => each(y, g, dx, t, i0, scale),
    }
}

/// The f64 forward on whole rows, as [`forward_rows_f32`] takes them: one row at a time.
pub(super) fn forward_rows_f64(x: &[f64], y: &mut [f64], t: usize, i0: usize, scale: f64) {
    for (r, (x, y)) in x.chunks_exact(t).zip(y.chunks_exact_mut(t)).enumerate() {
        forward_f64(x, y, (i0 + r) % t, scale)
    }
}

/// The f64 backward on whole rows, one row at a time.
pub(super) fn backward_rows_f64(y: &[f64], g: &[f64], dx: &mut [f64], t: usize, i0: usize, scale: f64) {
    for (r, ((y, g), dx)) in y.chunks_exact(t).zip(g.chunks_exact(t)).zip(dx.chunks_exact_mut(t)).enumerate() {
        backward_f64(y, g, dx, (i0 + r) % t, scale)
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
                let mut y = vec![0f32; n];
                forward_rows_f32(&x[range], &mut y, t, 0, self.scale as f32);
                CpuStorage::F32(y)
            }
            CpuStorage::F64(x) => {
                let mut y = vec![0f64; n];
                forward_rows_f64(&x[range], &mut y, t, 0, self.scale);
                CpuStorage::F64(y)
            }
            CpuStorage::BF16(x) => {
                // ROWS rows at a time, widened and computed in f32, rounded once.
                let (mut y, mut wide, mut out) = (Vec::with_capacity(n), vec![0f32; ROWS * t], vec![0f32; ROWS * t]);
                for (c, x) in x[range].chunks(ROWS * t).enumerate() {
                    let (wide, out) = (&mut wide[..x.len()], &mut out[..x.len()]);
                    zip_update(wide, x, |w, v| *w = from_bf16(v));
                    forward_rows_f32(wide, out, t, c * ROWS % t, self.scale as f32);
                    push_rounded(&mut y, out);
                }
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
                let mut dx = vec![0f32; n];
                backward_rows_f32(&y[ry], &g[rg], &mut dx, t, 0, self.scale as f32);
                CpuStorage::F32(dx)
            }
            (CpuStorage::F64(y), CpuStorage::F64(g)) => {
                let mut dx = vec![0f64; n];
                backward_rows_f64(&y[ry], &g[rg], &mut dx, t, 0, self.scale);
                CpuStorage::F64(dx)
            }
            (CpuStorage::BF16(y), CpuStorage::BF16(g)) => {
                // ROWS rows at a time, as the forward.
                let (mut dx, block) = (Vec::with_capacity(n), ROWS * t);
                let (mut wy, mut wg, mut out) = (vec![0f32; block], vec![0f32; block], vec![0f32; block]);
                for (c, (y, g)) in y[ry].chunks(block).zip(g[rg].chunks(block)).enumerate() {
                    let (wy, wg, out) = (&mut wy[..y.len()], &mut wg[..y.len()], &mut out[..y.len()]);
                    zip_update(wy, y, |w, v| *w = from_bf16(v));
                    zip_update(wg, g, |w, v| *w = from_bf16(v));
                    backward_rows_f32(wy, wg, out, t, c * ROWS % t, self.scale as f32);
                    push_rounded(&mut dx, out);
                }
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
    use half::bf16;

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

    // The definition the f32 row blocks keep: one row at a time, glibc's `expf` per element.
    row_kernels!(one_row_f32, one_row_backward_f32, f32);

    /// Row blocks against one row at a time, bit for bit, forward and
    /// backward: T not a multiple of the block (blocks span two matrices),
    /// starts inside a matrix, a last block of one row, T = 1, rows longer
    /// than the exp's lanes. The first row that sees all T keys has a −∞
    /// score (e⁰ nowhere else) and a huge one (the exp's slow path: all the
    /// others' exps underflow to 0); the second such row a NaN; the first
    /// row of 21 keys has a −0 and a +0 in different lanes of the max and
    /// every other score negative (its max a ±0 tie).
    #[test]
    fn row_blocks_give_the_bits_of_one_row_at_a_time() {
        for (t, i0, mats) in [(64, 0, 3), (7, 0, 4), (7, 4, 3), (13, 5, 2), (1, 0, 3), (130, 0, 2)] {
            let n = t * t * mats - i0 * t;
            let mut x: Vec<f32> = (0..n).map(|k| ((k * 7919 % 1009) as f32 / 1009.0 - 0.5) * 9.0).collect();
            let g: Vec<f32> = (0..n).map(|k| ((k * 104729 % 997) as f32 / 997.0 - 0.5) * 2.0).collect();
            let query = |r: usize| (i0 + r) % t;
            let mut full = (0..n / t).filter(|&r| t > 3 && query(r) == t - 1).map(|r| r * t);
            if let Some(at) = full.next() {
                (x[at + 1], x[at + t / 2]) = (f32::NEG_INFINITY, 1e30);
            }
            if let Some(at) = full.next() {
                x[at + t / 3] = f32::NAN;
            }
            if let Some(r) = (0..n / t).find(|&r| query(r) == 20) {
                x[r * t..r * t + 21].iter_mut().for_each(|v| *v = -v.abs() - 0.5);
                (x[r * t + 1], x[r * t + 10]) = (-0.0, 0.0);
            }
            let (mut rows, mut one) = (vec![9f32; n], vec![9f32; n]);
            forward_rows_f32(&x, &mut rows, t, i0, 0.3);
            for (r, (x, y)) in x.chunks_exact(t).zip(one.chunks_exact_mut(t)).enumerate() {
                one_row_f32(x, y, (i0 + r) % t, 0.3);
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&rows), bits(&one), "forward, T = {t}, from row {i0}");
            let (mut drows, mut done) = (vec![9f32; n], vec![9f32; n]);
            backward_rows_f32(&one, &g, &mut drows, t, i0, 0.3);
            for (r, ((y, g), dx)) in
                one.chunks_exact(t).zip(g.chunks_exact(t)).zip(done.chunks_exact_mut(t)).enumerate()
            {
                one_row_backward_f32(y, g, dx, (i0 + r) % t, 0.3);
            }
            assert_eq!(bits(&drows), bits(&done), "backward, T = {t}, from row {i0}");
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
