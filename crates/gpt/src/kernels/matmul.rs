//! `a @ b` whose rounding no CPU property changes.
//!
//! Every output element is computed the same way on every machine: one
//! chain of fused multiply-adds over the contraction, in order,
//!
//! ```text
//! c[i][j] = fma(a[i][K−1], b[K−1][j], … fma(a[i][1], b[1][j], fma(a[i][0], b[0][j], 0)) …)
//! ```
//!
//! Vectorising across `j` (and tiling across `i`) never changes that chain,
//! since each SIMD lane holds its own output element, and nothing splits the
//! contraction into blocks. So the AVX-512 path, the AVX2 path and the
//! portable path (`f32::mul_add`, exact on every platform) give the same bits. Cache
//! sizes change nothing either: there is no blocking over `k` to tune.
//!
//! The speed comes from the classic register tile: operands packed into
//! panels of `MR` rows of `a` and `NR` columns of `b`, and a 6 × 16 tile of
//! accumulators (12 AVX registers) updated by 12 FMAs per step of `k`.
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor, bail};
use half::bf16;

/// Rows of `a` per register tile.
const MR: usize = 6;
/// Columns of `b` per register tile (two 8-lane AVX registers).
const NR: usize = 16;

/// `a @ b` for `a` (…, M, K) and `b` (…, K, N) with the same leading
/// (batch) dimensions; any strides (a transposed view costs no copy).
/// f32 and f64 compute in their own precision; bf16 operands are widened to
/// f32 (exactly), multiplied in f32 and the result rounded to bf16, as
/// candle's own bf16 matmul does. Differentiable: its backward is two more
/// of these products, `grad @ bᵀ` and `aᵀ @ grad`.
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    a.apply_op2(b, MatMul { path: Path::Fastest })
}

/// Which tiles to use: the widest the CPU runs, or (for the tests that hold
/// the paths against each other) a narrower one. All give the same bits.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Path {
    Fastest,
    #[cfg(test)]
    Avx2,
    #[cfg(test)]
    Portable,
}

struct MatMul {
    path: Path,
}

/// One operand's view: where each batch item starts, and its 2-D strides.
pub(super) struct Operand {
    pub(super) batch_offsets: Vec<usize>,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) row_stride: usize,
    pub(super) col_stride: usize,
}

/// Every batch item's `a @ b` in f32, by the same chains as [`matmul`]
/// (for the fused kernels, on views of their own buffers).
pub(super) fn products_f32(a: &Operand, x: &[f32], b: &Operand, y: &[f32]) -> Vec<f32> {
    products(a, x, b, y, |v| v, Path::Fastest)
}

impl Operand {
    fn new(l: &Layout) -> Result<Self> {
        let (dims, strides) = (l.dims(), l.stride());
        let r = dims.len();
        if r < 2 {
            bail!("matmul needs operands of rank 2 or more, got shape {dims:?}");
        }
        // Every batch index, in row-major order, as an offset into the storage.
        let mut batch_offsets = vec![l.start_offset()];
        for d in 0..r - 2 {
            batch_offsets = batch_offsets.iter().flat_map(|&o| (0..dims[d]).map(move |i| o + i * strides[d])).collect();
        }
        Ok(Self {
            batch_offsets,
            rows: dims[r - 2],
            cols: dims[r - 1],
            row_stride: strides[r - 2],
            col_stride: strides[r - 1],
        })
    }
}

impl CustomOp2 for MatMul {
    fn name(&self) -> &'static str {
        "fsdp-matmul"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (a, b) = (Operand::new(l1)?, Operand::new(l2)?);
        let (d1, d2) = (l1.dims(), l2.dims());
        if d1[..d1.len() - 2] != d2[..d2.len() - 2] || a.cols != b.rows {
            bail!("matmul shapes do not fit: {d1:?} @ {d2:?}");
        }
        let (m, n) = (a.rows, b.cols);
        let mut out_dims = d1[..d1.len() - 2].to_vec();
        out_dims.extend([m, n]);
        let shape = Shape::from(out_dims);
        let storage = match (s1, s2) {
            (CpuStorage::F32(x), CpuStorage::F32(y)) => CpuStorage::F32(products(&a, x, &b, y, |v| v, self.path)),
            (CpuStorage::BF16(x), CpuStorage::BF16(y)) => {
                let out = products(&a, x, &b, y, bf16::to_f32, self.path);
                CpuStorage::BF16(out.into_iter().map(bf16::from_f32).collect())
            }
            (CpuStorage::F64(x), CpuStorage::F64(y)) => CpuStorage::F64(products_f64(&a, x, &b, y)),
            _ => bail!(
                "matmul supports f32, bf16 and f64 operands of one dtype, got {:?} and {:?}",
                s1.dtype(),
                s2.dtype()
            ),
        };
        Ok((storage, shape))
    }

    fn bwd(&self, a: &Tensor, b: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // d(a @ b) = da @ b + a @ db: dL/da = grad @ bᵀ, dL/db = aᵀ @ grad.
        let ga = matmul(grad, &b.t()?)?;
        let gb = matmul(&a.t()?, grad)?;
        Ok((Some(ga), Some(gb)))
    }
}

/// Every batch item's product, in f32, back to back (row-major M × N each).
fn products<T: Copy>(
    a: &Operand,
    x: &[T],
    b: &Operand,
    y: &[T],
    widen: impl Fn(T) -> f32 + Copy,
    path: Path,
) -> Vec<f32> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    let mut out = vec![0f32; a.batch_offsets.len() * m * n];
    if m == 0 || n == 0 || k == 0 {
        return out; // an empty sum is 0
    }
    let (tile_fn, pair_fn) = match path {
        Path::Fastest => fastest_tiles(),
        #[cfg(test)]
        Path::Avx2 => (fastest_tiles().0, None),
        #[cfg(test)]
        Path::Portable => (tile_portable as TileFn, None),
    };
    let (mp, np) = (m.div_ceil(MR), n.div_ceil(NR));
    // Zeros beyond the edges stay zeros: only the valid entries are written, for every batch item.
    let (mut ap, mut bp) = (vec![0f32; mp * MR * k], vec![0f32; np * NR * k]);
    let (mut tile, mut tile2) = ([0f32; MR * NR], [0f32; MR * NR]);
    for ((&ao, &bo), out) in a.batch_offsets.iter().zip(&b.batch_offsets).zip(out.chunks_exact_mut(m * n)) {
        // Pack: panel p of a holds rows p·MR.. as [k][MR]; panel q of b
        // holds columns q·NR.. as [k][NR]. Each is read along whichever of
        // its dimensions is contiguous in memory (a transposed view too).
        for (p, panel) in ap.chunks_exact_mut(MR * k).enumerate() {
            let rows = MR.min(m - p * MR);
            let at = ao + p * MR * a.row_stride;
            if a.col_stride == 1 {
                for r in 0..rows {
                    let row = &x[at + r * a.row_stride..][..k];
                    for (kk, &v) in row.iter().enumerate() {
                        panel[kk * MR + r] = widen(v);
                    }
                }
            } else if a.row_stride == 1 {
                for (kk, dst) in panel.chunks_exact_mut(MR).enumerate() {
                    let src = &x[at + kk * a.col_stride..][..rows];
                    match rows {
                        MR => (0..MR).for_each(|r| dst[r] = widen(src[r])), // fixed length: no memcpy call
                        _ => dst[..rows].iter_mut().zip(src).for_each(|(d, &v)| *d = widen(v)),
                    }
                }
            } else {
                for kk in 0..k {
                    for r in 0..rows {
                        panel[kk * MR + r] = widen(x[at + r * a.row_stride + kk * a.col_stride]);
                    }
                }
            }
        }
        for (q, panel) in bp.chunks_exact_mut(NR * k).enumerate() {
            let cols = NR.min(n - q * NR);
            let at = bo + q * NR * b.col_stride;
            if b.col_stride == 1 {
                for (kk, dst) in panel.chunks_exact_mut(NR).enumerate() {
                    let src = &y[at + kk * b.row_stride..][..cols];
                    match cols {
                        NR => (0..NR).for_each(|c| dst[c] = widen(src[c])), // fixed length: no memcpy call
                        _ => dst[..cols].iter_mut().zip(src).for_each(|(d, &v)| *d = widen(v)),
                    }
                }
            } else if b.row_stride != 1 {
                for kk in 0..k {
                    for c in 0..cols {
                        panel[kk * NR + c] = widen(y[at + kk * b.row_stride + c * b.col_stride]);
                    }
                }
            } else {
                for c in 0..cols {
                    let col = &y[at + c * b.col_stride..][..k];
                    for (kk, &v) in col.iter().enumerate() {
                        panel[kk * NR + c] = widen(v);
                    }
                }
            }
        }
        let apanels: Vec<&[f32]> = ap.chunks_exact(MR * k).collect();
        for (q, bpanel) in bp.chunks_exact(NR * k).enumerate() {
            let cols = NR.min(n - q * NR);
            let mut write = |p: usize, tile: &[f32; MR * NR]| {
                for r in 0..MR.min(m - p * MR) {
                    let row = (p * MR + r) * n + q * NR;
                    let src = &tile[r * NR..r * NR + NR];
                    match cols {
                        // a full tile row: a fixed-size copy the compiler keeps in registers
                        NR => copy_n::<NR>(&mut out[row..row + NR], src),
                        _ => out[row..row + cols].copy_from_slice(&src[..cols]),
                    }
                }
            };
            let mut p = 0;
            while p < mp {
                // Two panels at once where the CPU has AVX-512: the same
                // chains, twice the accumulators in flight.
                if let (Some(pair), true) = (pair_fn, p + 1 < mp) {
                    pair(k, apanels[p], apanels[p + 1], bpanel, &mut tile, &mut tile2);
                    write(p, &tile);
                    write(p + 1, &tile2);
                    p += 2;
                } else {
                    tile_fn(k, apanels[p], bpanel, &mut tile);
                    write(p, &tile);
                    p += 1;
                }
            }
        }
    }
    out
}

/// `dst = src` for exactly `N` elements: a copy of known length.
#[inline(always)]
fn copy_n<const N: usize>(dst: &mut [f32], src: &[f32]) {
    let (dst, src): (&mut [f32; N], &[f32; N]) =
        (dst.try_into().expect("N elements"), src.try_into().expect("N elements"));
    *dst = *src;
}

type TileFn = fn(usize, &[f32], &[f32], &mut [f32; MR * NR]);
/// Two row panels against one column panel, into two tiles.
type PairFn = fn(usize, &[f32], &[f32], &[f32], &mut [f32; MR * NR], &mut [f32; MR * NR]);

/// The widest tiles the CPU runs (AVX-512, AVX2 + FMA), else the portable
/// one: the same bits from each, only faster.
fn fastest_tiles() -> (TileFn, Option<PairFn>) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<(bool, bool)> = OnceLock::new();
        let (avx2, avx512) = *HAS.get_or_init(|| {
            let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
            (avx2, avx2 && is_x86_feature_detected!("avx512f"))
        });
        if avx2 {
            return (tile_avx2, avx512.then_some(pair_avx512 as PairFn));
        }
    }
    (tile_portable, None)
}

// ANCHOR: tile
/// The register tile, portably: `acc = fma(a, b, acc)` for k in order.
fn tile_portable(k: usize, ap: &[f32], bp: &[f32], tile: &mut [f32; MR * NR]) {
    let mut acc = [0f32; MR * NR];
    for (a, b) in ap.chunks_exact(MR).zip(bp.chunks_exact(NR)).take(k) {
        for r in 0..MR {
            for c in 0..NR {
                acc[r * NR + c] = a[r].mul_add(b[c], acc[r * NR + c]);
            }
        }
    }
    *tile = acc;
}
// ANCHOR_END: tile

#[cfg(target_arch = "x86_64")]
fn tile_avx2(k: usize, ap: &[f32], bp: &[f32], tile: &mut [f32; MR * NR]) {
    assert!(ap.len() >= k * MR && bp.len() >= k * NR);
    // SAFETY: chosen only where the CPU has AVX2 and FMA; the loads stay
    // within the panels (checked above) and the stores within `tile`.
    unsafe { tile_avx2_inner(k, ap.as_ptr(), bp.as_ptr(), tile.as_mut_ptr()) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2_inner(k: usize, ap: *const f32, bp: *const f32, tile: *mut f32) {
    use std::arch::x86_64::*;
    unsafe {
        let mut c = [[_mm256_setzero_ps(); 2]; MR];
        for p in 0..k {
            let b0 = _mm256_loadu_ps(bp.add(p * NR));
            let b1 = _mm256_loadu_ps(bp.add(p * NR + 8));
            for (r, acc) in c.iter_mut().enumerate() {
                let a = _mm256_broadcast_ss(&*ap.add(p * MR + r));
                acc[0] = _mm256_fmadd_ps(a, b0, acc[0]);
                acc[1] = _mm256_fmadd_ps(a, b1, acc[1]);
            }
        }
        for (r, acc) in c.iter().enumerate() {
            _mm256_storeu_ps(tile.add(r * NR), acc[0]);
            _mm256_storeu_ps(tile.add(r * NR + 8), acc[1]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn pair_avx512(k: usize, ap0: &[f32], ap1: &[f32], bp: &[f32], t0: &mut [f32; MR * NR], t1: &mut [f32; MR * NR]) {
    assert!(ap0.len() >= k * MR && ap1.len() >= k * MR && bp.len() >= k * NR);
    // SAFETY: chosen only where the CPU has AVX-512F; loads stay within the
    // panels (checked above), stores within the tiles.
    unsafe { pair_avx512_inner(k, ap0.as_ptr(), ap1.as_ptr(), bp.as_ptr(), t0.as_mut_ptr(), t1.as_mut_ptr()) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pair_avx512_inner(k: usize, ap0: *const f32, ap1: *const f32, bp: *const f32, t0: *mut f32, t1: *mut f32) {
    use std::arch::x86_64::*;
    unsafe {
        // 12 rows × 16 columns: one 16-lane register per row.
        let mut c = [_mm512_setzero_ps(); 2 * MR];
        for p in 0..k {
            let b = _mm512_loadu_ps(bp.add(p * NR));
            for r in 0..MR {
                c[r] = _mm512_fmadd_ps(_mm512_set1_ps(*ap0.add(p * MR + r)), b, c[r]);
                c[MR + r] = _mm512_fmadd_ps(_mm512_set1_ps(*ap1.add(p * MR + r)), b, c[MR + r]);
            }
        }
        for r in 0..MR {
            _mm512_storeu_ps(t0.add(r * NR), c[r]);
            _mm512_storeu_ps(t1.add(r * NR), c[MR + r]);
        }
    }
}

/// f64 (the finite-difference tests): the same chain, without tiling.
pub(super) fn products_f64(a: &Operand, x: &[f64], b: &Operand, y: &[f64]) -> Vec<f64> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    let mut out = Vec::with_capacity(a.batch_offsets.len() * m * n);
    for (&ao, &bo) in a.batch_offsets.iter().zip(&b.batch_offsets) {
        for i in 0..m {
            for j in 0..n {
                out.push((0..k).fold(0f64, |acc, kk| {
                    x[ao + i * a.row_stride + kk * a.col_stride]
                        .mul_add(y[bo + kk * b.row_stride + j * b.col_stride], acc)
                }));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};

    use super::*;

    fn random(shape: &[usize], seed: u64) -> Tensor {
        let mut rng = crate::rng::SplitMix64::new(seed);
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .into_iter()
            .map(f32::to_bits)
            .collect()
    }

    /// The definition, written out: one fma chain per element, k in order.
    fn reference(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        (0..m * n).map(|e| (0..k).fold(0f32, |acc, kk| a[(e / n) * k + kk].mul_add(b[kk * n + e % n], acc))).collect()
    }

    #[test]
    fn every_element_is_one_fma_chain_in_order() {
        // Edges in every direction: M, N not multiples of the tile, K long
        // enough that any blocking over k would show.
        for &(m, k, n) in &[(1, 1, 1), (7, 3, 17), (13, 1536, 33), (64, 128, 65), (6, 0, 16)] {
            let (a, b) = (random(&[m, k], 1), random(&[k, n], 2));
            let want = reference(
                &a.flatten_all().unwrap().to_vec1().unwrap(),
                &b.flatten_all().unwrap().to_vec1().unwrap(),
                m,
                k,
                n,
            );
            let want: Vec<u32> = want.into_iter().map(f32::to_bits).collect();
            for path in [Path::Fastest, Path::Avx2, Path::Portable] {
                assert_eq!(bits(&a.apply_op2_no_bwd(&b, &MatMul { path }).unwrap()), want, "{path:?}, {m}×{k}×{n}");
            }
        }
    }

    #[test]
    fn agrees_with_candles_matmul_to_rounding_and_takes_any_strides() {
        // (B, H, T, hs) @ (B, H, hs, T) through a transposed view, as attention does.
        let q = random(&[2, 3, 20, 8], 3);
        let k = random(&[2, 3, 20, 8], 4);
        let ours = matmul(&q, &k.t().unwrap()).unwrap();
        let theirs = q.matmul(&k.t().unwrap()).unwrap();
        assert_eq!(ours.dims(), theirs.dims());
        let diff = (ours - &theirs).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 1e-5, "max difference {diff}");
        // The transposed view and a contiguous copy of it give the same bits.
        let kt = k.t().unwrap().contiguous().unwrap();
        assert_eq!(bits(&matmul(&q, &k.t().unwrap()).unwrap()), bits(&matmul(&q, &kt).unwrap()));
    }

    #[test]
    fn bf16_is_widened_multiplied_in_f32_and_rounded_once() {
        let (a, b) =
            (random(&[9, 40], 5).to_dtype(DType::BF16).unwrap(), random(&[40, 18], 6).to_dtype(DType::BF16).unwrap());
        let wide = matmul(&a.to_dtype(DType::F32).unwrap(), &b.to_dtype(DType::F32).unwrap()).unwrap();
        let out = matmul(&a, &b).unwrap();
        assert_eq!(out.dtype(), DType::BF16);
        assert_eq!(bits(&out), bits(&wide.to_dtype(DType::BF16).unwrap()));
    }

    #[test]
    fn backward_matches_finite_differences() {
        // f64, so the differences are exact enough: L = sum((a @ b) ⊙ w).
        let to64 = |t: Tensor| t.to_dtype(DType::F64).unwrap();
        let (a0, b0, w) = (to64(random(&[5, 7], 7)), to64(random(&[7, 4], 8)), to64(random(&[5, 4], 9)));
        let (a, b) = (Var::from_tensor(&a0).unwrap(), Var::from_tensor(&b0).unwrap());
        let loss = |a: &Tensor, b: &Tensor| (matmul(a, b).unwrap() * &w).unwrap().sum_all().unwrap();
        let grads = loss(a.as_tensor(), b.as_tensor()).backward().unwrap();
        for (v, other, is_a) in [(&a0, &b0, true), (&b0, &a0, false)] {
            let g = grads
                .get(if is_a { a.as_tensor() } else { b.as_tensor() })
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap();
            let flat = v.flatten_all().unwrap().to_vec1::<f64>().unwrap();
            for e in [0, flat.len() / 2, flat.len() - 1] {
                let at = |h: f64| {
                    let mut f = flat.clone();
                    f[e] += h;
                    let t = Tensor::from_vec(f, v.dims(), &Device::Cpu).unwrap();
                    let l = if is_a { loss(&t, other) } else { loss(other, &t) };
                    l.to_scalar::<f64>().unwrap()
                };
                let numeric = (at(1e-6) - at(-1e-6)) / 2e-6;
                assert!(
                    (numeric - g[e]).abs() < 1e-6 * (1.0 + numeric.abs()),
                    "{} [{e}]: analytic {} numeric {numeric}",
                    if is_a { "a" } else { "b" },
                    g[e]
                );
            }
        }
    }
}
