//! What the fused kernels share: a contiguous operand's values, bf16 widened
//! to f32 and rounded back, and their arithmetic in one precision.
use candle_core::{CpuStorage, Layout, Result, Shape, Storage, bail};
use half::bf16;

pub(super) use crate::precision::{from_bf16, to_bf16};
use std::mem::MaybeUninit;

use super::matmul::{Operand, products_f32, products_f64};
use super::softmax::{backward_rows_f32, backward_rows_f64, forward_rows_f32, forward_rows_f64};

/// Whether the CPU has AVX2: LayerNorm's loops, and the element-wise loops
/// below (see [`lanes`]), may take its eight lanes (the build's baseline,
/// SSE2, has four). The bits cannot differ: without
/// fast-math the compiler vectorises only what is element-wise and keeps
/// every rounding (it fuses no multiply and add the code does not fuse).
#[inline(always)]
pub(super) fn avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::arch::is_x86_feature_detected!("avx2");
    #[allow(unreachable_code)]
    false
}

/// Whether the CPU has AVX2 and FMA: the matmul's AVX2 tiles, and glibc's
/// `expf` in lanes ([`super::expf`]; glibc's own choice of its FMA build asks for both too).
#[inline(always)]
pub(super) fn avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    return avx2() && std::arch::is_x86_feature_detected!("fma");
    #[allow(unreachable_code)]
    false
}

/// How many lanes the element-wise loops take: AVX-512's sixteen where the
/// matmul takes its AVX-512 path (so that `FSDP_MATMUL=avx2` runs them as a
/// CPU with AVX2 alone would), AVX2's eight where the CPU has it, else the
/// baseline's four. The bits are the same in each (see [`avx2`]). Like the
/// matmul, it ends the process (exit 2, one line) if `FSDP_MATMUL` names a
/// path this CPU lacks: the lessons check it first (`check_matmul_env`).
#[inline(always)]
pub(super) fn lanes() -> usize {
    use super::matmul::Isa;
    if Isa::in_use() == Isa::Avx512 {
        16
    } else if avx2() {
        8
    } else {
        4
    }
}

/// Runs `f`, a loop whose elements are computed each by itself, compiled
/// for the [`lanes`] the element-wise kernels take (AVX-512F's sixteen where
/// the matmul takes its AVX-512 path, else AVX2's eight where the CPU has
/// it): wider loads, stores and arithmetic, the same operations on each
/// element, so the same bits. For the optimizer's update, outside these kernels.
#[inline(always)]
pub fn elementwise<R>(f: impl FnOnce() -> R) -> R {
    match lanes() {
        #[cfg(target_arch = "x86_64")]
        16 => {
            #[target_feature(enable = "avx512f")]
            fn on_avx512<R>(f: impl FnOnce() -> R) -> R {
                f()
            }
            // SAFETY: lanes() is 16 only where the matmul's AVX-512 path runs, on a CPU with AVX-512F.
            unsafe { on_avx512(f) }
        }
        #[cfg(target_arch = "x86_64")]
        8 => {
            #[target_feature(enable = "avx2")]
            fn on_avx2<R>(f: impl FnOnce() -> R) -> R {
                f()
            }
            // SAFETY: lanes() is 8 only on a CPU with AVX2.
            unsafe { on_avx2(f) }
        }
        _ => f(),
    }
}

/// An 8 × 8 block of f32 transposed in AVX2 registers: `r[i]` holds line
/// i's values at steps 0..8, the result's `[j]` every line's value at step
/// j (lane i: line i's). Moves only: the values are the same bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn transpose8(r: [std::arch::x86_64::__m256; 8]) -> [std::arch::x86_64::__m256; 8] {
    use std::arch::x86_64::*;
    let (u0, u1) = (_mm256_unpacklo_ps(r[0], r[1]), _mm256_unpackhi_ps(r[0], r[1]));
    let (u2, u3) = (_mm256_unpacklo_ps(r[2], r[3]), _mm256_unpackhi_ps(r[2], r[3]));
    let (u4, u5) = (_mm256_unpacklo_ps(r[4], r[5]), _mm256_unpackhi_ps(r[4], r[5]));
    let (u6, u7) = (_mm256_unpacklo_ps(r[6], r[7]), _mm256_unpackhi_ps(r[6], r[7]));
    let s = [
        _mm256_shuffle_ps::<0x44>(u0, u2), // lines 0-3 at steps 0 | 4
        _mm256_shuffle_ps::<0xEE>(u0, u2), // 1 | 5
        _mm256_shuffle_ps::<0x44>(u1, u3), // 2 | 6
        _mm256_shuffle_ps::<0xEE>(u1, u3), // 3 | 7
        _mm256_shuffle_ps::<0x44>(u4, u6), // lines 4-7, likewise
        _mm256_shuffle_ps::<0xEE>(u4, u6),
        _mm256_shuffle_ps::<0x44>(u5, u7),
        _mm256_shuffle_ps::<0xEE>(u5, u7),
    ];
    let mut t = [_mm256_setzero_ps(); 8];
    for j in 0..4 {
        t[j] = _mm256_permute2f128_ps::<0x20>(s[j], s[j + 4]); // step j
        t[j + 4] = _mm256_permute2f128_ps::<0x31>(s[j], s[j + 4]); // step j + 4
    }
    t
}

/// Elements of `T` in a 64-byte cache line: the step between prefetches.
pub(super) const fn per_line<T>() -> usize {
    64 / size_of::<T>()
}

/// Asks for the cache line holding `p` to be brought into L1: a hint, which
/// changes no value and cannot fault, whatever the address (`p` may lie past
/// the end of a buffer: it is never read).
#[inline(always)]
pub(super) fn prefetch<T>(p: *const T) {
    prefetch_into::<true, T>(p)
}

/// [`prefetch`] into L2, not L1 (the T1 hint), for lines wanted some
/// microseconds from now: they do not push out what L1 holds for the work
/// at hand.
#[inline(always)]
pub(super) fn prefetch_l2<T>(p: *const T) {
    prefetch_into::<false, T>(p)
}

#[inline(always)]
fn prefetch_into<const L1: bool, T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing into the program and never faults.
    unsafe {
        use std::arch::x86_64::{_MM_HINT_T0, _MM_HINT_T1, _mm_prefetch};
        if L1 { _mm_prefetch::<_MM_HINT_T0>(p.cast()) } else { _mm_prefetch::<_MM_HINT_T1>(p.cast()) }
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// `f` on every element of `x`: SIMD-wide ([`lanes`]).
#[inline(always)]
pub(super) fn map_f32(x: &[f32], f: impl Fn(f32) -> f32 + Copy) -> Vec<f32> {
    map(x, f)
}

/// `f` on every pair of elements of `x` and `y`: SIMD-wide ([`lanes`]).
#[inline(always)]
pub(super) fn zip_map_f32(x: &[f32], y: &[f32], f: impl Fn(f32, f32) -> f32 + Copy) -> Vec<f32> {
    zip_map(x, y, f)
}

/// [`zip_map_f32`] compiled for `lanes` lanes (the tests hold each to the same bits).
#[cfg(test)]
pub(super) fn zip_map_f32_in(lanes: usize, x: &[f32], y: &[f32], f: impl Fn(f32, f32) -> f32 + Copy) -> Vec<f32> {
    zip_map_in(lanes, x, y, f)
}

/// `f` on every element of `x`, of any element types (bf16 widened or
/// rounded on its way, say): SIMD-wide ([`lanes`]).
#[inline(always)]
pub(crate) fn map<A: Copy, B>(x: &[A], f: impl Fn(A) -> B + Copy) -> Vec<B> {
    zip_map(x, x, move |v, _| f(v))
}

/// `f` on every pair of elements of `x` and `y`, of any element types: SIMD-wide ([`lanes`]).
#[inline(always)]
pub(super) fn zip_map<A: Copy, B: Copy, C>(x: &[A], y: &[B], f: impl Fn(A, B) -> C + Copy) -> Vec<C> {
    zip_map_in(lanes(), x, y, f)
}

/// [`zip_map`] compiled for `lanes` lanes: 16 (AVX-512F) and 8 (AVX2)
/// only where the CPU has them, anything else the baseline's 4. The loop
/// is a plain `for` in an always-inlined body, so that all of it — `f`
/// included — is compiled for those lanes (an iterator's `collect` or
/// `for_each` is a function of its own, which the compiler may leave
/// uninlined, compiled for the baseline).
#[inline(always)]
pub(super) fn zip_map_in<A: Copy, B: Copy, C>(lanes: usize, x: &[A], y: &[B], f: impl Fn(A, B) -> C + Copy) -> Vec<C> {
    #[inline(always)]
    fn each<A: Copy, B: Copy, C>(x: &[A], y: &[B], out: &mut [MaybeUninit<C>], f: impl Fn(A, B) -> C) {
        // 64 elements (four cache lines of each f32 input) at a time, asking for the lines 4 KiB
        // ahead first: an input that the graph kept since the forward, or that an op wrote a
        // while ago, comes from L3 or memory, and there the loads waited on it (GELU forward over
        // 32 tensors of 1 MiB cycled: 2.4 ns per element without, 0.67 with, on an Intel Xeon
        // with a 2 MiB L2; over one tensor, warm in the caches: 0.63-0.72 without).
        const CHUNK: usize = 64;
        const AHEAD: usize = 1024;
        let (n, same) = (out.len(), std::ptr::eq(x.as_ptr().cast::<u8>(), y.as_ptr().cast::<u8>())); // same: map's one input
        let chunks = out.chunks_mut(CHUNK).zip(x.chunks(CHUNK).zip(y.chunks(CHUNK)));
        for (i, (out, (xs, ys))) in chunks.enumerate() {
            let ahead = i * CHUNK + AHEAD;
            if ahead < n {
                for line in (0..CHUNK).step_by(per_line::<A>()) {
                    prefetch(x.as_ptr().wrapping_add(ahead + line));
                }
                for line in (0..CHUNK).step_by(per_line::<B>()).filter(|_| !same) {
                    prefetch(y.as_ptr().wrapping_add(ahead + line));
                }
            }
            for (o, (&a, &b)) in out.iter_mut().zip(xs.iter().zip(ys)) {
                o.write(f(a, b));
            }
        }
    }
    let len = x.len().min(y.len());
    let mut out = Vec::with_capacity(len); // not zeroed: every element is written below
    let dst = &mut out.spare_capacity_mut()[..len];
    match lanes {
        #[cfg(target_arch = "x86_64")]
        16 => {
            assert!(std::arch::is_x86_feature_detected!("avx512f"), "16 lanes need AVX-512F");
            #[target_feature(enable = "avx512f")]
            fn on_avx512<A: Copy, B: Copy, C>(x: &[A], y: &[B], out: &mut [MaybeUninit<C>], f: impl Fn(A, B) -> C) {
                each(x, y, out, f)
            }
            // SAFETY: the CPU has AVX-512F (asserted).
            unsafe { on_avx512(x, y, dst, f) }
        }
        #[cfg(target_arch = "x86_64")]
        8 => {
            assert!(avx2(), "8 lanes need AVX2");
            #[target_feature(enable = "avx2")]
            fn on_avx2<A: Copy, B: Copy, C>(x: &[A], y: &[B], out: &mut [MaybeUninit<C>], f: impl Fn(A, B) -> C) {
                each(x, y, out, f)
            }
            // SAFETY: the CPU has AVX2 (asserted).
            unsafe { on_avx2(x, y, dst, f) }
        }
        _ => each(x, y, dst, f),
    }
    // SAFETY: `each` wrote all `len` elements.
    unsafe { out.set_len(len) };
    out
}

/// `f(x[i][j], row[j])` for every row `x[i]` of `x` (rows of `row.len()`
/// elements): a linear layer's bias onto its products, say. SIMD-wide, as
/// [`zip_map_in`] compiles it.
#[inline(always)]
pub(super) fn map_rows<A: Copy, B: Copy, C>(x: &[A], row: &[B], f: impl Fn(A, B) -> C + Copy) -> Vec<C> {
    #[inline(always)]
    fn each<A: Copy, B: Copy, C>(x: &[A], row: &[B], out: &mut [MaybeUninit<C>], f: impl Fn(A, B) -> C) {
        for (out, x) in out.chunks_exact_mut(row.len()).zip(x.chunks_exact(row.len())) {
            for (o, (&a, &b)) in out.iter_mut().zip(x.iter().zip(row)) {
                o.write(f(a, b));
            }
        }
    }
    assert!(!row.is_empty() && x.len().is_multiple_of(row.len()), "whole rows of {}", row.len());
    let mut out = Vec::with_capacity(x.len()); // not zeroed: every element is written below
    let dst = &mut out.spare_capacity_mut()[..x.len()];
    match lanes() {
        #[cfg(target_arch = "x86_64")]
        16 => {
            #[target_feature(enable = "avx512f")]
            fn on_avx512<A: Copy, B: Copy, C>(x: &[A], row: &[B], out: &mut [MaybeUninit<C>], f: impl Fn(A, B) -> C) {
                each(x, row, out, f)
            }
            // SAFETY: lanes() is 16 only where the matmul's AVX-512 path runs, on a CPU with AVX-512F.
            unsafe { on_avx512(x, row, dst, f) }
        }
        #[cfg(target_arch = "x86_64")]
        8 => {
            #[target_feature(enable = "avx2")]
            fn on_avx2<A: Copy, B: Copy, C>(x: &[A], row: &[B], out: &mut [MaybeUninit<C>], f: impl Fn(A, B) -> C) {
                each(x, row, out, f)
            }
            // SAFETY: lanes() is 8 only on a CPU with AVX2.
            unsafe { on_avx2(x, row, dst, f) }
        }
        _ => each(x, row, dst, f),
    }
    // SAFETY: `each` wrote every element.
    unsafe { out.set_len(x.len()) };
    out
}

/// `f(&mut acc[i], x[i])` for every element, SIMD-wide ([`lanes`]) as
/// [`zip_map_in`] compiles it: `acc += g` with a bf16 `g` widened as it is read, say.
#[inline(always)]
pub fn zip_update<A, B: Copy>(acc: &mut [A], x: &[B], f: impl Fn(&mut A, B) + Copy) {
    #[inline(always)]
    fn each<A, B: Copy>(acc: &mut [A], x: &[B], f: impl Fn(&mut A, B)) {
        for (a, &b) in acc.iter_mut().zip(x) {
            f(a, b);
        }
    }
    match lanes() {
        #[cfg(target_arch = "x86_64")]
        16 => {
            #[target_feature(enable = "avx512f")]
            fn on_avx512<A, B: Copy>(acc: &mut [A], x: &[B], f: impl Fn(&mut A, B)) {
                each(acc, x, f)
            }
            // SAFETY: lanes() is 16 only where the matmul's AVX-512 path runs, on a CPU with AVX-512F.
            unsafe { on_avx512(acc, x, f) }
        }
        #[cfg(target_arch = "x86_64")]
        8 => {
            #[target_feature(enable = "avx2")]
            fn on_avx2<A, B: Copy>(acc: &mut [A], x: &[B], f: impl Fn(&mut A, B)) {
                each(acc, x, f)
            }
            // SAFETY: lanes() is 8 only on a CPU with AVX2.
            unsafe { on_avx2(acc, x, f) }
        }
        _ => each(acc, x, f),
    }
}

/// The values of a contiguous operand, from its start offset.
pub(super) fn values<'a, T: candle_core::WithDType>(s: &'a CpuStorage, l: &Layout, op: &str) -> Result<&'a [T]> {
    let Some((a, b)) = l.contiguous_offsets() else { bail!("{op} needs contiguous operands") };
    Ok(&s.as_slice::<T>()?[a..b])
}

/// A tensor's storage on the CPU, the only device the kernels run on.
pub(super) fn cpu<'a>(s: &'a Storage, op: &str) -> Result<&'a CpuStorage> {
    match s {
        Storage::Cpu(s) => Ok(s),
        #[allow(unreachable_patterns)]
        _ => bail!("{op} runs on the CPU"),
    }
}

/// An op's output storage (f32, bf16 or f64) as a tensor of `shape`, on the CPU, without copying.
pub(super) fn tensor_from(s: CpuStorage, shape: Shape) -> Result<candle_core::Tensor> {
    let dev = &candle_core::Device::Cpu;
    match s {
        CpuStorage::F32(v) => candle_core::Tensor::from_vec(v, shape, dev),
        CpuStorage::BF16(v) => candle_core::Tensor::from_vec(v, shape, dev),
        CpuStorage::F64(v) => candle_core::Tensor::from_vec(v, shape, dev),
        s => {
            bail!("an op's output of {:?}: f32, bf16 or f64 expected", candle_core::backend::BackendStorage::dtype(&s))
        }
    }
}

/// Appends `x`, each value rounded to bf16 ([`to_bf16`]), to `out`, at the
/// SIMD width: a block of an op's f32 results onto its bf16 output.
#[inline(always)]
pub(super) fn push_rounded(out: &mut Vec<bf16>, x: &[f32]) {
    out.reserve(x.len());
    let at = out.len();
    zip_update(&mut out.spare_capacity_mut()[..x.len()], x, |o, v| _ = o.write(to_bf16(v)));
    // SAFETY: the elements at..at + x.len() were all written above.
    unsafe { out.set_len(at + x.len()) };
}

/// bf16 → f32, exactly ([`from_bf16`]), at the SIMD width ([`map`]).
pub(super) fn widen(x: &[bf16]) -> Vec<f32> {
    map(x, from_bf16)
}

/// f32 → bf16, rounded to nearest-even ([`to_bf16`]), at the SIMD width.
pub(super) fn narrow(x: Vec<f32>) -> Vec<bf16> {
    map(&x, to_bf16)
}

/// The sum of the `n`-long rows of `g`, each widened, added in row order:
/// a bias's gradient (the bias add's and the linear layer's, the same bits).
pub(super) fn row_sum<T: Copy, A: Copy + Default + std::ops::AddAssign>(
    g: &[T],
    n: usize,
    widen: impl Fn(T) -> A,
) -> Vec<A> {
    let mut sum = vec![A::default(); n];
    elementwise(|| {
        // Across a row at the SIMD width; down each column one add at a time, in row order.
        for row in g.chunks_exact(n) {
            sum.iter_mut().zip(row).for_each(|(s, &g)| *s += widen(g));
        }
    });
    sum
}

/// Fails on a zero-sized dimension: the kernels walk rows by their length.
pub(super) fn nonempty(dims: &[usize], op: &str) -> Result<()> {
    if dims.is_empty() || dims.contains(&0) {
        bail!("{op}: a tensor of shape {dims:?} has nothing to compute");
    }
    Ok(())
}

/// The arithmetic in one precision: f32 (also bf16's, rounding where the
/// composed ops round) or f64 (the finite-difference tests).
pub(super) trait Calc:
    Copy + Default + std::ops::Add<Output = Self> + std::ops::AddAssign + Send + Sync + 'static
{
    fn mm(a: &Operand, x: &[Self], b: &Operand, y: &[Self]) -> Vec<Self>;
    /// The causal softmax of whole `t`-long rows, the first of query position `i0`.
    fn softmax_rows(x: &[Self], y: &mut [Self], t: usize, i0: usize, scale: f64);
    /// Its backward: `dx` from the output `y` and its gradient `g`, rows as above.
    fn softmax_backward_rows(y: &[Self], g: &[Self], dx: &mut [Self], t: usize, i0: usize, scale: f64);
}

impl Calc for f32 {
    fn mm(a: &Operand, x: &[f32], b: &Operand, y: &[f32]) -> Vec<f32> {
        products_f32(a, x, b, y)
    }
    fn softmax_rows(x: &[f32], y: &mut [f32], t: usize, i0: usize, scale: f64) {
        forward_rows_f32(x, y, t, i0, scale as f32)
    }
    fn softmax_backward_rows(y: &[f32], g: &[f32], dx: &mut [f32], t: usize, i0: usize, scale: f64) {
        backward_rows_f32(y, g, dx, t, i0, scale as f32)
    }
}

impl Calc for f64 {
    fn mm(a: &Operand, x: &[f64], b: &Operand, y: &[f64]) -> Vec<f64> {
        products_f64(a, x, b, y)
    }
    fn softmax_rows(x: &[f64], y: &mut [f64], t: usize, i0: usize, scale: f64) {
        forward_rows_f64(x, y, t, i0, scale)
    }
    fn softmax_backward_rows(y: &[f64], g: &[f64], dx: &mut [f64], t: usize, i0: usize, scale: f64) {
        backward_rows_f64(y, g, dx, t, i0, scale)
    }
}

/// Test helpers the kernels' tests share.
#[cfg(test)]
pub(super) mod testing {
    use candle_core::{DType, Device, Tensor};

    /// Standard normal values (f64) of `shape`, from `seed`.
    pub fn random(shape: &[usize], seed: u64) -> Tensor {
        let mut rng = crate::rng::SplitMix64::new(seed);
        let n = shape.iter().product();
        Tensor::from_vec((0..n).map(|_| rng.normal()).collect::<Vec<f64>>(), shape, &Device::Cpu).unwrap()
    }

    /// Every value's bits (as f64: exact for f32 and bf16).
    pub fn bits(t: &Tensor) -> Vec<u64> {
        let v: Vec<f64> = t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        v.iter().map(|v| v.to_bits()).collect()
    }

    /// max |a − b|, in f64.
    pub fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        let d = (a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap()).unwrap();
        d.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap()
    }
}
