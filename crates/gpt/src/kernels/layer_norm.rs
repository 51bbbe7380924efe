//! LayerNorm over the last dimension, fused: one pass forward, one back.
//!
//! Composed from candle's ops, a LayerNorm is ten tensors the graph keeps
//! (mean, centred, squared, variance, std, normalised, scaled, shifted …)
//! and a backward through each, whose gradients for `w` and `b` are sums
//! over every row done by candle's generic strided reduction. Here the
//! graph keeps the op's inputs and output, nothing between, and the
//! backward recomputes each row's mean and 1/σ from x:
//!
//! ```text
//! forward   x̂ = (x − μ) / √(σ² + ε),   y = x̂ · w + b            per row of C
//! backward  db = Σ_rows g,   dw = Σ_rows g · x̂,
//!           dx = (ĝ − mean(ĝ) − x̂ · mean(ĝ · x̂)) / √(σ² + ε)      with ĝ = g · w
//! ```
//!
//! Each row's sums run over `c = 0, 1, …, C−1` in order, and `dw`, `db`
//! add the rows in order: the same bits on every machine. bf16 rows are
//! widened to f32 and each result rounded once; f32 and f64 compute in
//! their own precision.
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, bail};
use half::bf16;

use super::common::{avx2, cpu, from_bf16, narrow, nonempty, to_bf16, values, widen};

/// `(x − mean) / √(var + eps) · w + b` over the last dimension of `x`
/// (…, C), with `w` and `b` of shape (C). Differentiable in all three.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    x.apply_op3(w, b, LayerNorm { eps })
}

pub(super) struct LayerNorm {
    pub(super) eps: f64,
}

macro_rules! kernels {
    ($fwd:ident, $bwd:ident, $finish:ident, $t:ty) => {
        /// One row: x̂ into `xhat`, returns 1/σ.
        fn $fwd(x: &[$t], xhat: &mut [$t], eps: $t) -> $t {
            let n = x.len() as $t;
            let mut sum: $t = 0.0;
            for &v in x {
                sum += v;
            }
            let mean = sum / n;
            let mut sq: $t = 0.0;
            for &v in x {
                sq += (v - mean) * (v - mean);
            }
            let rstd = 1.0 / (sq / n + eps).sqrt();
            for (h, &v) in xhat.iter_mut().zip(x) {
                *h = (v - mean) * rstd;
            }
            rstd
        }

        /// One row's input gradient into `dx`, its share of `dw` and `db`
        /// added on; `xhat` is the row's x̂.
        fn $bwd(xhat: &[$t], rstd: $t, g: &[$t], w: &[$t], dx: &mut [$t], dw: &mut [$t], db: &mut [$t]) {
            let (mut sum_g, mut sum_gx): ($t, $t) = (0.0, 0.0);
            for ((&h, &g), &w) in xhat.iter().zip(g).zip(w) {
                sum_g += g * w;
                sum_gx += g * w * h;
            }
            $finish(xhat, rstd, g, w, (sum_g, sum_gx), dx, dw, db);
        }

        /// The rest of a row's backward, from its two sums.
        #[inline(always)]
        #[allow(clippy::too_many_arguments)]
        fn $finish(
            xhat: &[$t],
            rstd: $t,
            g: &[$t],
            w: &[$t],
            (sum_g, sum_gx): ($t, $t),
            dx: &mut [$t],
            dw: &mut [$t],
            db: &mut [$t],
        ) {
            let n = xhat.len() as $t;
            let (mean_g, mean_gx) = (sum_g / n, sum_gx / n);
            for c in 0..xhat.len() {
                // + 0: −0 written as +0, as candle's GradStore would (0 + −0), so that a
                // backward that skips the store (kernels::tape) gets the same bits
                dx[c] = (g[c] * w[c] - mean_g - xhat[c] * mean_gx) * rstd + 0.0;
                dw[c] += g[c] * xhat[c];
                db[c] += g[c];
            }
        }
    };
}
kernels!(row_f32, row_backward_f32, finish_row_f32, f32);
kernels!(row_f64, row_backward_f64, finish_row_f64, f64);

/// Rows whose sums run side by side in f32 (see [`rows_f32`]).
const ROWS: usize = 8;

/// [`row_f32`] on `ROWS` rows at once (`x`, `xhat`: ROWS × c). Each row's
/// sums are the chains `row_f32` forms, over c in order, so the bits are
/// its bits; but the rows' chains step together, so their additions
/// overlap instead of each waiting for the one before it (a row alone is
/// one long chain of dependent adds). Returns each row's 1/σ.
#[inline(always)]
fn rows_f32(x: &[f32], xhat: &mut [f32], c: usize, eps: f32) -> [f32; ROWS] {
    let rows: [&[f32]; ROWS] = std::array::from_fn(|r| &x[r * c..][..c]);
    let mean = row_sums(&rows, 0, [0.0; ROWS]).map(|s| s / c as f32);
    let sq = row_squares(&rows, &mean, 0, [0.0; ROWS]);
    normalize(&rows, &mean, sq, eps, xhat)
}

/// Each row's sum continued over its steps `from..`, in order: `sum[r] += rows[r][k]`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // k walks every row's elements at once: rows[r][k]
fn row_sums(rows: &[&[f32]; ROWS], from: usize, mut sum: [f32; ROWS]) -> [f32; ROWS] {
    for k in from..rows[0].len() {
        for r in 0..ROWS {
            sum[r] += rows[r][k];
        }
    }
    sum
}

/// Each row's squared deviations from its mean, continued likewise.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn row_squares(rows: &[&[f32]; ROWS], mean: &[f32; ROWS], from: usize, mut sq: [f32; ROWS]) -> [f32; ROWS] {
    for k in from..rows[0].len() {
        for r in 0..ROWS {
            sq[r] += (rows[r][k] - mean[r]) * (rows[r][k] - mean[r]);
        }
    }
    sq
}

/// Each row's x̂ into `xhat` from its mean and squared deviations; returns each 1/σ.
#[inline(always)]
fn normalize(rows: &[&[f32]; ROWS], mean: &[f32; ROWS], sq: [f32; ROWS], eps: f32, xhat: &mut [f32]) -> [f32; ROWS] {
    let n = rows[0].len() as f32;
    let rstd = sq.map(|s| 1.0 / (s / n + eps).sqrt());
    for (r, h) in xhat.chunks_exact_mut(rows[0].len()).enumerate() {
        for (h, &v) in h.iter_mut().zip(rows[r]) {
            *h = (v - mean[r]) * rstd[r];
        }
    }
    rstd
}

/// The backward's two sums of each row continued over steps `from..` of c,
/// in order: `Σ g·w` and `Σ g·w·x̂`, each product rounded as written.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn grad_sums(
    gs: &[&[f32]; ROWS],
    hs: &[&[f32]; ROWS],
    w: &[f32],
    from: usize,
    (mut sum_g, mut sum_gx): ([f32; ROWS], [f32; ROWS]),
) -> ([f32; ROWS], [f32; ROWS]) {
    for k in from..w.len() {
        for r in 0..ROWS {
            sum_g[r] += gs[r][k] * w[k];
            sum_gx[r] += gs[r][k] * w[k] * hs[r][k];
        }
    }
    (sum_g, sum_gx)
}

// The AVX2 rows below take one row per lane of an eight-lane register.
#[cfg(target_arch = "x86_64")]
const _: () = assert!(ROWS == 8, "one row per AVX2 lane");

/// The eight rows' values at steps `kk .. kk + 8` of c, one vector per step
/// (lane r: row r's value): eight loads and a transpose in registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn columns8(rows: &[&[f32]; ROWS], kk: usize) -> [std::arch::x86_64::__m256; 8] {
    super::common::transpose8(std::array::from_fn(|r| {
        let eight = &rows[r][kk..kk + 8]; // checked: a short row panics, never reads past its end
        // SAFETY: `eight` holds eight f32s; an unaligned load.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(eight.as_ptr()) }
    }))
}

/// [`rows_f32`] with the rows in the lanes of AVX2 registers: the same
/// chains — each row's sum and squared deviations over c in order, each term
/// rounded as there — eight steps of c transposed into place at a time, the
/// last `c % 8` steps one by one.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn rows_f32_avx2(x: &[f32], xhat: &mut [f32], c: usize, eps: f32) -> [f32; ROWS] {
    use std::arch::x86_64::*;
    let rows: [&[f32]; ROWS] = std::array::from_fn(|r| &x[r * c..][..c]);
    let c8 = c / 8 * 8;
    let lanes = |v: __m256| -> [f32; ROWS] {
        let mut a = [0f32; ROWS];
        // SAFETY: a holds eight f32s.
        unsafe { _mm256_storeu_ps(a.as_mut_ptr(), v) };
        a
    };
    let mut acc = _mm256_setzero_ps();
    for kk in (0..c8).step_by(8) {
        for t in columns8(&rows, kk) {
            acc = _mm256_add_ps(acc, t);
        }
    }
    let mean = row_sums(&rows, c8, lanes(acc)).map(|s| s / c as f32); // the last c % 8 steps one by one
    // SAFETY: mean holds eight f32s.
    let mv = unsafe { _mm256_loadu_ps(mean.as_ptr()) };
    let mut acc = _mm256_setzero_ps();
    for kk in (0..c8).step_by(8) {
        for t in columns8(&rows, kk) {
            let d = _mm256_sub_ps(t, mv);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(d, d)); // a product, then a sum: as rows_f32, no FMA
        }
    }
    let sq = row_squares(&rows, &mean, c8, lanes(acc));
    normalize(&rows, &mean, sq, eps, xhat)
}

/// The backward's two sums of `ROWS` rows side by side, `Σ g·w` and
/// `Σ g·w·x̂` over c in order (each product rounded as written), on AVX2:
/// eight steps of c transposed into place at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn backward_sums_avx2(gs: &[&[f32]; ROWS], hs: &[&[f32]; ROWS], w: &[f32]) -> ([f32; ROWS], [f32; ROWS]) {
    use std::arch::x86_64::*;
    let c = w.len();
    let c8 = c / 8 * 8;
    let (mut sg, mut sgx) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for kk in (0..c8).step_by(8) {
        let (tg, th) = (columns8(gs, kk), columns8(hs, kk));
        for j in 0..8 {
            let gw = _mm256_mul_ps(tg[j], _mm256_set1_ps(w[kk + j]));
            sg = _mm256_add_ps(sg, gw);
            sgx = _mm256_add_ps(sgx, _mm256_mul_ps(gw, th[j]));
        }
    }
    let (mut sum_g, mut sum_gx) = ([0f32; ROWS], [0f32; ROWS]);
    // SAFETY: each array holds eight f32s.
    unsafe { (_mm256_storeu_ps(sum_g.as_mut_ptr(), sg), _mm256_storeu_ps(sum_gx.as_mut_ptr(), sgx)) };
    grad_sums(gs, hs, w, c8, (sum_g, sum_gx)) // the last c % 8 steps one by one
}

/// The f32 forward: `ROWS` rows at a time through [`rows_f32`] (with AVX2,
/// [`rows_f32_avx2`]: the same chains), the rest one by one; compiled for
/// AVX2 where the CPU has it (wider element-wise loops, the same roundings).
fn forward_f32(x: &[f32], w: &[f32], b: &[f32], c: usize, eps: f32) -> Vec<f32> {
    #[inline(always)]
    fn each<const AVX2: bool>(x: &[f32], w: &[f32], b: &[f32], c: usize, eps: f32, y: &mut [f32]) {
        /// x̂ · w + b, on rows whose x̂ was just written (still in L1).
        #[inline(always)]
        fn scale_shift(y: &mut [f32], w: &[f32], b: &[f32], c: usize) {
            for y in y.chunks_exact_mut(c) {
                for ((y, &w), &b) in y.iter_mut().zip(w).zip(b) {
                    *y = *y * w + b;
                }
            }
        }
        let whole = x.len() / (ROWS * c) * (ROWS * c);
        let (y_whole, y_rest) = y.split_at_mut(whole);
        for (x, y) in x[..whole].chunks_exact(ROWS * c).zip(y_whole.chunks_exact_mut(ROWS * c)) {
            rows(AVX2, x, y, c, eps);
            scale_shift(y, w, b, c);
        }
        for (x, y) in x[whole..].chunks_exact(c).zip(y_rest.chunks_exact_mut(c)) {
            row_f32(x, y, eps);
            scale_shift(y, w, b, c);
        }
    }
    let mut y = vec![0f32; x.len()];
    match avx2() {
        #[cfg(target_arch = "x86_64")]
        true => {
            #[target_feature(enable = "avx2")]
            fn on_avx2(x: &[f32], w: &[f32], b: &[f32], c: usize, eps: f32, y: &mut [f32]) {
                each::<true>(x, w, b, c, eps, y)
            }
            // SAFETY: the CPU has AVX2 (detected).
            unsafe { on_avx2(x, w, b, c, eps, &mut y) }
        }
        _ => each::<false>(x, w, b, c, eps, &mut y),
    }
    y
}

/// `ROWS` rows' x̂ and 1/σ: [`rows_f32_avx2`] where `avx2` (the caller
/// checked the CPU), else [`rows_f32`]. The same bits either way.
#[inline(always)]
fn rows(avx2: bool, x: &[f32], xhat: &mut [f32], c: usize, eps: f32) -> [f32; ROWS] {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // SAFETY: only the AVX2 paths pass true, on a CPU with AVX2.
        return unsafe { rows_f32_avx2(x, xhat, c, eps) };
    }
    let _ = avx2;
    rows_f32(x, xhat, c, eps)
}

/// The f32 backward, `ROWS` rows at a time as [`forward_f32`]: each row's
/// two sums side by side with the other rows', then the rows finished in
/// order (`dw` and `db` add the rows in that order).
fn backward_f32(x: &[f32], w: &[f32], g: &[f32], c: usize, eps: f32) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    #[inline(always)]
    fn each<const AVX2: bool>(
        x: &[f32],
        w: &[f32],
        g: &[f32],
        c: usize,
        eps: f32,
        out: (&mut [f32], &mut [f32], &mut [f32]),
    ) {
        let (dx, dw, db) = out;
        let mut h = vec![0f32; ROWS * c];
        let whole = x.len() / (ROWS * c) * (ROWS * c);
        let blocks = x[..whole].chunks_exact(ROWS * c).zip(g.chunks_exact(ROWS * c)).zip(dx.chunks_exact_mut(ROWS * c));
        for ((x, g), dx) in blocks {
            let rstd = rows(AVX2, x, &mut h, c, eps);
            let (gs, hs): ([&[f32]; ROWS], [&[f32]; ROWS]) =
                (std::array::from_fn(|r| &g[r * c..][..c]), std::array::from_fn(|r| &h[r * c..][..c]));
            let (sum_g, sum_gx) = sums(AVX2, &gs, &hs, w);
            for (r, dx) in dx.chunks_exact_mut(c).enumerate() {
                finish_row_f32(hs[r], rstd[r], gs[r], w, (sum_g[r], sum_gx[r]), dx, dw, db);
            }
        }
        let rest = x[whole..].chunks_exact(c).zip(g[whole..].chunks_exact(c)).zip(dx[whole..].chunks_exact_mut(c));
        for ((x, g), dx) in rest {
            let rstd = row_f32(x, &mut h[..c], eps);
            row_backward_f32(&h[..c], rstd, g, w, dx, dw, db);
        }
    }
    let (mut dx, mut dw, mut db) = (vec![0f32; x.len()], vec![0f32; c], vec![0f32; c]);
    match avx2() {
        #[cfg(target_arch = "x86_64")]
        true => {
            #[target_feature(enable = "avx2")]
            fn on_avx2(x: &[f32], w: &[f32], g: &[f32], c: usize, eps: f32, out: (&mut [f32], &mut [f32], &mut [f32])) {
                each::<true>(x, w, g, c, eps, out)
            }
            // SAFETY: the CPU has AVX2 (detected).
            unsafe { on_avx2(x, w, g, c, eps, (&mut dx, &mut dw, &mut db)) }
        }
        _ => each::<false>(x, w, g, c, eps, (&mut dx, &mut dw, &mut db)),
    }
    (dx, dw, db)
}

/// The bf16 forward, as [`forward_f32`] computes it: `ROWS` rows at a time
/// widened into a scratch block (in L1) and normalized by the same rows,
/// each output `x̂ · w + b` rounded once (a row left over, by [`row_f32`]).
fn forward_bf16(x: &[bf16], w: &[f32], b: &[f32], c: usize, eps: f32) -> Vec<bf16> {
    #[inline(always)]
    fn each<const AVX2: bool>(x: &[bf16], w: &[f32], b: &[f32], c: usize, eps: f32, y: &mut [bf16]) {
        let (mut wide, mut h) = (vec![0f32; ROWS * c], vec![0f32; ROWS * c]);
        for (x, y) in x.chunks(ROWS * c).zip(y.chunks_mut(ROWS * c)) {
            let (wide, h) = (&mut wide[..x.len()], &mut h[..x.len()]);
            for (o, &v) in wide.iter_mut().zip(x) {
                *o = from_bf16(v);
            }
            match x.len() == ROWS * c {
                true => _ = rows(AVX2, wide, h, c, eps),
                false => wide.chunks_exact(c).zip(h.chunks_exact_mut(c)).for_each(|(x, h)| _ = row_f32(x, h, eps)),
            }
            for (y, h) in y.chunks_exact_mut(c).zip(h.chunks_exact(c)) {
                for (((y, &h), &w), &b) in y.iter_mut().zip(h).zip(w).zip(b) {
                    *y = to_bf16(h * w + b);
                }
            }
        }
    }
    let mut y = vec![bf16::ZERO; x.len()];
    match avx2() {
        #[cfg(target_arch = "x86_64")]
        true => {
            #[target_feature(enable = "avx2")]
            fn on_avx2(x: &[bf16], w: &[f32], b: &[f32], c: usize, eps: f32, y: &mut [bf16]) {
                each::<true>(x, w, b, c, eps, y)
            }
            // SAFETY: the CPU has AVX2 (detected).
            unsafe { on_avx2(x, w, b, c, eps, &mut y) }
        }
        _ => each::<false>(x, w, b, c, eps, &mut y),
    }
    y
}

/// The bf16 backward, as [`backward_f32`] computes it: `ROWS` rows of x and
/// g at a time widened into scratch blocks, dx rounded once per element;
/// `dw` and `db` summed in f32 over the rows in order (rounded by the caller).
fn backward_bf16(x: &[bf16], w: &[f32], g: &[bf16], c: usize, eps: f32) -> (Vec<bf16>, Vec<f32>, Vec<f32>) {
    #[inline(always)]
    fn each<const AVX2: bool>(
        x: &[bf16],
        w: &[f32],
        g: &[bf16],
        c: usize,
        eps: f32,
        out: (&mut [bf16], &mut [f32], &mut [f32]),
    ) {
        let (dx, dw, db) = out;
        let (mut wx, mut wg) = (vec![0f32; ROWS * c], vec![0f32; ROWS * c]);
        let (mut h, mut d) = (vec![0f32; ROWS * c], vec![0f32; ROWS * c]);
        for ((x, g), dx) in x.chunks(ROWS * c).zip(g.chunks(ROWS * c)).zip(dx.chunks_mut(ROWS * c)) {
            let n = x.len();
            let (wx, wg, h, d) = (&mut wx[..n], &mut wg[..n], &mut h[..n], &mut d[..n]);
            for ((o, &v), (p, &u)) in wx.iter_mut().zip(x).zip(wg.iter_mut().zip(g)) {
                (*o, *p) = (from_bf16(v), from_bf16(u));
            }
            if n == ROWS * c {
                let rstd = rows(AVX2, wx, h, c, eps);
                let (gs, hs): ([&[f32]; ROWS], [&[f32]; ROWS]) =
                    (std::array::from_fn(|r| &wg[r * c..][..c]), std::array::from_fn(|r| &h[r * c..][..c]));
                let (sum_g, sum_gx) = sums(AVX2, &gs, &hs, w);
                for (r, d) in d.chunks_exact_mut(c).enumerate() {
                    finish_row_f32(hs[r], rstd[r], gs[r], w, (sum_g[r], sum_gx[r]), d, dw, db);
                }
            } else {
                for ((x, g), (h, d)) in
                    wx.chunks_exact(c).zip(wg.chunks_exact(c)).zip(h.chunks_exact_mut(c).zip(d.chunks_exact_mut(c)))
                {
                    let rstd = row_f32(x, h, eps);
                    row_backward_f32(h, rstd, g, w, d, dw, db);
                }
            }
            for (o, &v) in dx.iter_mut().zip(d.iter()) {
                *o = to_bf16(v);
            }
        }
    }
    let (mut dx, mut dw, mut db) = (vec![bf16::ZERO; x.len()], vec![0f32; c], vec![0f32; c]);
    match avx2() {
        #[cfg(target_arch = "x86_64")]
        true => {
            #[target_feature(enable = "avx2")]
            fn on_avx2(
                x: &[bf16],
                w: &[f32],
                g: &[bf16],
                c: usize,
                eps: f32,
                out: (&mut [bf16], &mut [f32], &mut [f32]),
            ) {
                each::<true>(x, w, g, c, eps, out)
            }
            // SAFETY: the CPU has AVX2 (detected).
            unsafe { on_avx2(x, w, g, c, eps, (&mut dx, &mut dw, &mut db)) }
        }
        _ => each::<false>(x, w, g, c, eps, (&mut dx, &mut dw, &mut db)),
    }
    (dx, dw, db)
}

/// The backward's two sums of `ROWS` rows: [`backward_sums_avx2`] where
/// `avx2`, else the same chains one value at a time.
#[inline(always)]
fn sums(avx2: bool, gs: &[&[f32]; ROWS], hs: &[&[f32]; ROWS], w: &[f32]) -> ([f32; ROWS], [f32; ROWS]) {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // SAFETY: only the AVX2 paths pass true, on a CPU with AVX2.
        return unsafe { backward_sums_avx2(gs, hs, w) };
    }
    let _ = avx2;
    grad_sums(gs, hs, w, 0, ([0.0; ROWS], [0.0; ROWS]))
}

/// The shared forward: per row, x̂ (scaled and shifted into `y`), in f32 or f64.
macro_rules! forward {
    ($x:expr, $w:expr, $b:expr, $c:expr, $eps:expr, $row:ident, $t:ty) => {{
        let mut y = vec![0 as $t; $x.len()];
        for (x, y) in $x.chunks_exact($c).zip(y.chunks_exact_mut($c)) {
            $row(x, y, $eps);
            for ((y, &w), &b) in y.iter_mut().zip($w).zip($b) {
                *y = *y * w + b;
            }
        }
        y
    }};
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "layer-norm"
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
        nonempty(l1.dims(), "layer_norm")?;
        let c = *l1.dims().last().unwrap_or(&0);
        if l2.dims() != [c] || l3.dims() != [c] {
            bail!("layer_norm: x {:?} needs w and b of ({c}), got {:?} and {:?}", l1.dims(), l2.dims(), l3.dims());
        }
        let out = match s1.dtype() {
            DType::F32 => {
                let (x, w, b) = (
                    values::<f32>(s1, l1, "layer_norm")?,
                    values::<f32>(s2, l2, "layer_norm")?,
                    values::<f32>(s3, l3, "layer_norm")?,
                );
                CpuStorage::F32(forward_f32(x, w, b, c, self.eps as f32))
            }
            DType::F64 => {
                let (x, w, b) = (
                    values::<f64>(s1, l1, "layer_norm")?,
                    values::<f64>(s2, l2, "layer_norm")?,
                    values::<f64>(s3, l3, "layer_norm")?,
                );
                CpuStorage::F64(forward!(x, w, b, c, self.eps, row_f64, f64))
            }
            DType::BF16 => {
                let (x, w, b) = (
                    values::<bf16>(s1, l1, "layer_norm")?,
                    values::<bf16>(s2, l2, "layer_norm")?,
                    values::<bf16>(s3, l3, "layer_norm")?,
                );
                CpuStorage::BF16(forward_bf16(x, &widen(w), &widen(b), c, self.eps as f32))
            }
            d => bail!("layer_norm supports f32, bf16 and f64, got {d:?}"),
        };
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (x, grad) = (x.contiguous()?, grad.contiguous()?);
        let (sx, lx) = x.storage_and_layout();
        let (sw, lw) = w.storage_and_layout();
        let (sg, lg) = grad.storage_and_layout();
        let (sx, sw, sg) = (cpu(&sx, "layer_norm")?, cpu(&sw, "layer_norm")?, cpu(&sg, "layer_norm")?);
        let c = *x.dims().last().unwrap_or(&0);
        let dev = x.device();
        let (dx, dw, db) = match x.dtype() {
            DType::F32 => {
                let (x, w, g) = (
                    values::<f32>(sx, lx, "layer_norm")?,
                    values::<f32>(sw, lw, "layer_norm")?,
                    values::<f32>(sg, lg, "layer_norm")?,
                );
                let (dx, dw, db) = backward_f32(x, w, g, c, self.eps as f32);
                (
                    Tensor::from_vec(dx, lx.shape().clone(), dev)?,
                    Tensor::from_vec(dw, c, dev)?,
                    Tensor::from_vec(db, c, dev)?,
                )
            }
            DType::F64 => {
                let (x, w, g) = (
                    values::<f64>(sx, lx, "layer_norm")?,
                    values::<f64>(sw, lw, "layer_norm")?,
                    values::<f64>(sg, lg, "layer_norm")?,
                );
                let (dx, dw, db) = backward_rows(x, w, g, c, self.eps, row_f64, row_backward_f64);
                (
                    Tensor::from_vec(dx, lx.shape().clone(), dev)?,
                    Tensor::from_vec(dw, c, dev)?,
                    Tensor::from_vec(db, c, dev)?,
                )
            }
            DType::BF16 => {
                let (x, w, g) = (
                    values::<bf16>(sx, lx, "layer_norm")?,
                    values::<bf16>(sw, lw, "layer_norm")?,
                    values::<bf16>(sg, lg, "layer_norm")?,
                );
                let (dx, dw, db) = backward_bf16(x, &widen(w), g, c, self.eps as f32);
                (
                    Tensor::from_vec(dx, lx.shape().clone(), dev)?,
                    Tensor::from_vec(narrow(dw), c, dev)?,
                    Tensor::from_vec(narrow(db), c, dev)?,
                )
            }
            d => bail!("layer_norm supports f32, bf16 and f64, got {d:?}"),
        };
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

/// Every row's backward, in row order; `dw` and `db` sum the rows in that order.
#[allow(clippy::type_complexity)]
fn backward_rows<T: Copy + Default>(
    x: &[T],
    w: &[T],
    g: &[T],
    c: usize,
    eps: T,
    row: fn(&[T], &mut [T], T) -> T,
    row_backward: fn(&[T], T, &[T], &[T], &mut [T], &mut [T], &mut [T]),
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let (mut dx, mut dw, mut db) = (vec![T::default(); x.len()], vec![T::default(); c], vec![T::default(); c]);
    let mut h = vec![T::default(); c];
    for ((x, g), dx) in x.chunks_exact(c).zip(g.chunks_exact(c)).zip(dx.chunks_exact_mut(c)) {
        let rstd = row(x, &mut h, eps);
        row_backward(&h, rstd, g, w, dx, &mut dw, &mut db);
    }
    (dx, dw, db)
}

#[cfg(test)]
mod tests {
    use super::super::common::testing::{max_diff, random};
    use super::*;
    use candle_core::{D, Device, Var};

    /// LayerNorm composed from candle's ops, as the model had it.
    fn composite(x: &Tensor, w: &Tensor, b: &Tensor) -> Tensor {
        let mean = x.mean_keepdim(D::Minus1).unwrap();
        let xc = x.broadcast_sub(&mean).unwrap();
        let var = xc.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
        let xn = xc.broadcast_div(&(var + 1e-5).unwrap().sqrt().unwrap()).unwrap();
        xn.broadcast_mul(w).unwrap().broadcast_add(b).unwrap()
    }

    /// The fused op computes what the composite computes, and so do all
    /// three gradients: in f64 to 1e-12, in f32 to 1e-5.
    #[test]
    fn agrees_with_the_composite_ops_forward_and_backward() {
        let (x, w, b, g) = (random(&[3, 5, 16], 1), random(&[16], 2), random(&[16], 3), random(&[3, 5, 16], 4));
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
            let vars = |_: ()| -> Vec<Var> {
                [&x, &w, &b].iter().map(|t| Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap()).collect()
            };
            let (f, c) = (vars(()), vars(()));
            let g = g.to_dtype(dtype).unwrap();
            let yf = layer_norm(f[0].as_tensor(), f[1].as_tensor(), f[2].as_tensor(), 1e-5).unwrap();
            let yc = composite(c[0].as_tensor(), c[1].as_tensor(), c[2].as_tensor());
            assert!(max_diff(&yf, &yc) < tol, "{dtype:?} forward: {}", max_diff(&yf, &yc));
            let gf = (&yf * &g).unwrap().sum_all().unwrap().backward().unwrap();
            let gc = (&yc * &g).unwrap().sum_all().unwrap().backward().unwrap();
            for (k, name) in ["x", "w", "b"].iter().enumerate() {
                let (a, e) = (gf.get(f[k].as_tensor()).unwrap(), gc.get(c[k].as_tensor()).unwrap());
                assert!(max_diff(a, e) < tol, "{dtype:?} d{name}: {}", max_diff(a, e));
            }
        }
    }

    /// Every gradient against central finite differences of `sum(y · g)`, in f64.
    #[test]
    fn backward_matches_finite_differences() {
        let (x, w, b, g) = (random(&[2, 3, 6], 5), random(&[6], 6), random(&[6], 7), random(&[2, 3, 6], 8));
        let f = |x: &Tensor, w: &Tensor, b: &Tensor| {
            (layer_norm(x, w, b, 1e-5).unwrap() * &g).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap()
        };
        let v: Vec<Var> = [&x, &w, &b].iter().map(|t| Var::from_tensor(t).unwrap()).collect();
        let y = layer_norm(v[0].as_tensor(), v[1].as_tensor(), v[2].as_tensor(), 1e-5).unwrap();
        let store = (y * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let h = 1e-6;
        for k in 0..3 {
            let analytic: Vec<f64> = store.get(v[k].as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            let base: Vec<Tensor> = vec![x.clone(), w.clone(), b.clone()];
            for (e, &a) in analytic.iter().enumerate() {
                let at = |d: f64| {
                    let mut args = base.clone();
                    let mut p: Vec<f64> = args[k].flatten_all().unwrap().to_vec1().unwrap();
                    p[e] += d;
                    args[k] = Tensor::from_vec(p, base[k].shape(), &Device::Cpu).unwrap();
                    f(&args[0], &args[1], &args[2])
                };
                let numeric = (at(h) - at(-h)) / (2.0 * h);
                assert!((a - numeric).abs() < 1e-6, "arg {k} element {e}: analytic {a}, numeric {numeric}");
            }
        }
    }

    /// The f32 rows taken eight at a time give the bits of one row at a
    /// time (compiled for the baseline), forward and backward: 8-row blocks
    /// and a remainder, C not a multiple of the vector width.
    #[test]
    fn eight_rows_at_once_give_the_bits_of_one_at_a_time() {
        let (rows, c) = (8 * 4 + 5, 45);
        let vals = |seed| random(&[rows * c], seed).to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
        let (x, g) = (vals(21), vals(22));
        let (w, b) = (vals(23)[..c].to_vec(), vals(24)[..c].to_vec());
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let one_by_one = forward!(&x, &w, &b, c, 1e-5f32, row_f32, f32);
        assert_eq!(bits(&forward_f32(&x, &w, &b, c, 1e-5)), bits(&one_by_one));
        let (dx, dw, db) = backward_rows(&x, &w, &g, c, 1e-5f32, row_f32, row_backward_f32);
        let (sdx, sdw, sdb) = backward_f32(&x, &w, &g, c, 1e-5);
        assert_eq!([bits(&sdx), bits(&sdw), bits(&sdb)], [bits(&dx), bits(&dw), bits(&db)]);
    }

    /// Both ways of taking eight rows at once — AVX2's lanes where the CPU
    /// has them, and the baseline's loop — give each row's chains of one row
    /// at a time, forward (x̂ and 1/σ) and backward (its two sums), with a
    /// remainder of C past the lanes; and a row whose gradient is all zeros
    /// gets +0 input gradients, not −0, even where w < 0 (as candle's
    /// GradStore, which adds every gradient to +0, would hand them on).
    #[test]
    fn both_row_paths_give_one_rows_chains_and_a_zero_gradient_is_plus_zero() {
        let c = 45;
        let vals = |n, seed| random(&[n], seed).to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
        let (x, g, w) = (vals(ROWS * c, 31), vals(ROWS * c, 32), vals(c, 33));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for lanes in [false, avx2()] {
            let mut xhat = vec![0f32; ROWS * c];
            let rstd = rows(lanes, &x, &mut xhat, c, 1e-5);
            let gs: [&[f32]; ROWS] = std::array::from_fn(|r| &g[r * c..][..c]);
            let hs: [&[f32]; ROWS] = std::array::from_fn(|r| &xhat[r * c..][..c]);
            let (sum_g, sum_gx) = sums(lanes, &gs, &hs, &w);
            for r in 0..ROWS {
                let mut h = vec![0f32; c];
                let one = row_f32(&x[r * c..][..c], &mut h, 1e-5);
                assert_eq!((bits(hs[r]), one.to_bits()), (bits(&h), rstd[r].to_bits()), "AVX2 {lanes}: row {r}");
                let (mut sg, mut sgx) = (0f32, 0f32);
                for k in 0..c {
                    sg += gs[r][k] * w[k];
                    sgx += gs[r][k] * w[k] * h[k];
                }
                assert_eq!(
                    [sum_g[r].to_bits(), sum_gx[r].to_bits()],
                    [sg.to_bits(), sgx.to_bits()],
                    "AVX2 {lanes}: row {r}"
                );
            }
        }
        let w: Vec<f32> = w.iter().map(|v| -v.abs()).collect(); // every weight negative: g·w = −0
        let (dx, _, _) = backward_f32(&x, &w, &vec![0f32; ROWS * c], c, 1e-5);
        assert!(dx.iter().all(|v| v.to_bits() == 0), "a zero gradient gives +0");
    }

    /// bf16 is widened, computed in f32 and rounded once.
    #[test]
    fn bf16_is_the_f32_result_rounded_once() {
        let (x, w, b) = (random(&[4, 32], 9), random(&[32], 10), random(&[32], 11));
        let to = |t: &Tensor, d| t.to_dtype(d).unwrap();
        let (x, w, b) = (to(&x, DType::BF16), to(&w, DType::BF16), to(&b, DType::BF16));
        let wide = layer_norm(&to(&x, DType::F32), &to(&w, DType::F32), &to(&b, DType::F32), 1e-5).unwrap();
        let out = layer_norm(&x, &w, &b, 1e-5).unwrap();
        let bits = |t: &Tensor| {
            t.flatten_all().unwrap().to_vec1::<bf16>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        assert_eq!(bits(&out), bits(&to(&wide, DType::BF16)));
        // The backward too: every gradient the f32 one, rounded once.
        let g = to(&random(&[4, 32], 12), DType::BF16);
        let grads = |x: &Tensor, w: &Tensor, b: &Tensor, g: &Tensor| {
            let (x, w, b) = (Var::from_tensor(x).unwrap(), Var::from_tensor(w).unwrap(), Var::from_tensor(b).unwrap());
            let y = layer_norm(x.as_tensor(), w.as_tensor(), b.as_tensor(), 1e-5).unwrap();
            let store = (y * g).unwrap().sum_all().unwrap().backward().unwrap();
            [&x, &w, &b].map(|v| store.get(v.as_tensor()).unwrap().clone())
        };
        let narrow = grads(&x, &w, &b, &g);
        let wide = grads(&to(&x, DType::F32), &to(&w, DType::F32), &to(&b, DType::F32), &to(&g, DType::F32));
        for (n, w) in narrow.iter().zip(&wide) {
            assert_eq!(bits(n), bits(&to(w, DType::BF16)));
        }
    }
}
