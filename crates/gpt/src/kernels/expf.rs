//! Debian 12's glibc `expf`, four lanes at a time, bit for bit.
//!
//! The softmax's `exp` is glibc's `expf` (what `f32::exp` calls); called once
//! per element it took 4–5 ns each, most of the causal softmax's time. glibc's
//! algorithm (sysdeps/ieee754/flt-32/e_expf.c, from Arm's optimized
//! routines) is a handful of f64 operations on a 32-entry table, so it runs
//! as well in four f64 lanes — and, done in the same operations, rounds the
//! same. On a CPU with AVX2 and FMA glibc 2.36 runs its `-mfma` build, where
//! the compiler fused five multiply-adds: `kd = InvLn2N·x + SHIFT`,
//! `r = InvLn2N·x − kd` (z never rounded on its own) and three in the cubic;
//! the lanes below fuse exactly those. Where glibc leaves that fast path
//! (|x| ≥ 88, NaN), and for a tail shorter than four, the lanes call
//! `f32::exp` itself. A test runs every f32 through the lanes and through the
//! machine's `f32::exp` and compares the bits (all equal under Debian 12's
//! glibc); without AVX2 and FMA each element goes to `f32::exp`.
//!
//! ```text
//! z  = x · 32/ln 2           k = round(z) (ties to even, by adding 1.5·2⁵²)
//! r  = z − k  ∈ [−½, ½]      s = 2^(k/32) = table[k mod 32] with ⌊k/32⌋ added to its exponent
//! eˣ ≈ s · (1 + C₂r + C₁r² + C₀r³), rounded once to f32
//! ```

/// `2^(i/32)` as f64 bits, less `i << 47` so that adding `k << 47` both
/// restores the entry and puts `k / 32` into its exponent (glibc's table).
#[cfg(target_arch = "x86_64")]
#[rustfmt::skip]
const TABLE: [u64; 32] = [
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51,
    0x3fef72b83c7d517b, 0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715, 0x3feef1a7373aa9cb, 0x3feedea64c123422, 0x3feece086061892d,
    0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429, 0x3feea47eb03a5585,
    0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d,
    0x3feee89f995ad3ad, 0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069,
    0x3fef5818dcfba487, 0x3fef7c97337b9b5f, 0x3fefa4afa2a490da, 0x3fefd0765b6e4540,
];

/// 32 / ln 2 (glibc's `0x1.71547652b82fep+0 · N`).
#[cfg(target_arch = "x86_64")]
const INV_LN2_N: f64 = f64::from_bits(0x3ff71547652b82fe) * 32.0;
/// 1.5 · 2⁵²: adding it rounds an f64 below 2⁵¹ to an integer, ties to even.
#[cfg(target_arch = "x86_64")]
const SHIFT: f64 = f64::from_bits(0x4338000000000000);
/// The cubic's coefficients, scaled by 32⁻³, 32⁻², 32⁻¹ (exact: powers of two)
/// from glibc's 0x1.c6af84b912394p-5, 0x1.ebfce50fac4f3p-3, 0x1.62e42ff0c52d6p-1.
#[cfg(target_arch = "x86_64")]
const C: [f64; 3] = [
    f64::from_bits(0x3fac6af84b912394) / 32768.0,
    f64::from_bits(0x3fcebfce50fac4f3) / 1024.0,
    f64::from_bits(0x3fe62e42ff0c52d6) / 32.0,
];

/// `v[j] = f32::exp(v[j])` for every element, one at a time: where the CPU
/// lacks AVX2 or FMA (glibc's own choice there is its build without FMA).
pub(super) fn exp_in_place(v: &mut [f32]) {
    v.iter_mut().for_each(|x| *x = x.exp());
}

/// [`exp_in_place`] in four f64 lanes. Inputs of magnitude 88 or more (and
/// NaN), where glibc leaves its fast path, go to `f32::exp` four at a time;
/// the tail shorter than four too.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(super) fn exp_in_place_fma(v: &mut [f32]) {
    use std::arch::x86_64::*;
    let mut quads = v.chunks_exact_mut(4);
    for q in &mut quads {
        // SAFETY: `q` holds four f32.
        let x = unsafe { _mm_loadu_ps(q.as_ptr()) };
        // glibc's test: the top 12 bits of |x| at or above 88.0's (0x42b).
        let big = _mm_cmpgt_epi32(
            _mm_and_si128(_mm_castps_si128(x), _mm_set1_epi32(0x7fff_ffff)),
            _mm_set1_epi32(0x42af_ffff),
        );
        if _mm_movemask_epi8(big) != 0 {
            q.iter_mut().for_each(|x| *x = x.exp());
            continue;
        }
        // SAFETY: `q` holds four f32.
        unsafe { _mm_storeu_ps(q.as_mut_ptr(), fast_quad(x)) };
    }
    quads.into_remainder().iter_mut().for_each(|x| *x = x.exp());
}

/// glibc's fast path on four f32, each of magnitude below 88 (not NaN).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn fast_quad(x: std::arch::x86_64::__m128) -> std::arch::x86_64::__m128 {
    use std::arch::x86_64::*;
    let xd = _mm256_cvtps_pd(x); // exact
    let inv = _mm256_set1_pd(INV_LN2_N);
    let shift = _mm256_set1_pd(SHIFT);
    let kd = _mm256_fmadd_pd(inv, xd, shift); // round(z) + SHIFT, z = x·32/ln 2
    let ki = _mm256_castpd_si256(kd); // its low bits: k
    let kd = _mm256_sub_pd(kd, shift);
    let r = _mm256_fmsub_pd(inv, xd, kd); // z − k, z not rounded first (glibc's fused build)
    let i = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
    // SAFETY: every index is below 32, TABLE's length.
    let t = unsafe { _mm256_i64gather_epi64::<8>(TABLE.as_ptr().cast(), i) };
    let s = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64::<47>(ki))); // 2^(k/32)
    let z = _mm256_fmadd_pd(_mm256_set1_pd(C[0]), r, _mm256_set1_pd(C[1]));
    let r2 = _mm256_mul_pd(r, r);
    let y = _mm256_fmadd_pd(_mm256_set1_pd(C[2]), r, _mm256_set1_pd(1.0));
    let y = _mm256_mul_pd(_mm256_fmadd_pd(z, r2, y), s);
    _mm256_cvtpd_ps(y) // rounded once, to nearest
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::super::common::avx2_fma;
    use super::*;
    use std::arch::x86_64::{_mm_loadu_ps, _mm_storeu_ps};

    /// Every one of the 2³² f32 bit patterns, through the lanes and through
    /// `f32::exp` (glibc's `expf`): the same bits, NaNs included. Two threads,
    /// each half of the patterns (about 20 s of CPU in all).
    #[test]
    fn every_f32_gives_glibcs_bits() {
        assert!(avx2_fma(), "the lanes need AVX2 and FMA, which every CPU the project's bits are promised on has");
        let half = |top: u32| {
            let (mut differ, mut first) = (0u64, None);
            let mut v = vec![0f32; 1 << 16];
            for hi in (top << 15)..((top + 1) << 15) {
                v.iter_mut().enumerate().for_each(|(lo, x)| *x = f32::from_bits(hi << 16 | lo as u32));
                // SAFETY: the CPU has AVX2 and FMA (asserted above).
                unsafe { exp_in_place_fma(&mut v) };
                for (lo, &got) in v.iter().enumerate() {
                    let x = f32::from_bits(hi << 16 | lo as u32);
                    if got.to_bits() != x.exp().to_bits() {
                        differ += 1;
                        first.get_or_insert((x, x.exp(), got));
                    }
                }
            }
            (differ, first)
        };
        let (a, b) = std::thread::scope(|s| {
            let low = s.spawn(|| half(0));
            (half(1), low.join().expect("the other half ran"))
        });
        assert_eq!(a.0 + b.0, 0, "first (x, glibc, lanes): {:?}", a.1.or(b.1));
    }

    /// The fast path's edges, four at a time so that the lanes compute them
    /// (a quad holding |x| ≥ 88 goes to `f32::exp` whole): just inside ±88,
    /// subnormal results (x below −87.34), ±0 and tiny x; then a quad with
    /// −88 in it, and a tail of three.
    #[test]
    #[rustfmt::skip]
    fn edges_and_tails() {
        let mut v = vec![
            -87.99999f32, 87.99999, 0.0, -0.0, // the lanes
            -87.5, -87.4, 1e-30, -1e-30, // the lanes: two subnormal results
            -88.0, -100.0, f32::NEG_INFINITY, 1.0, // f32::exp, all four
            -3.0, 2.0, 0.5, // the tail
        ];
        let want: Vec<u32> = v.iter().map(|x| x.exp().to_bits()).collect();
        assert!(avx2_fma(), "the lanes need AVX2 and FMA");
        // The first two quads through the lanes alone (no way out to f32::exp) …
        for (q, want) in v[..8].chunks_exact(4).zip(want.chunks_exact(4)) {
            let mut got = [0f32; 4];
            // SAFETY: the CPU has AVX2 and FMA (asserted above); `q` and `got` hold four f32.
            unsafe { _mm_storeu_ps(got.as_mut_ptr(), fast_quad(_mm_loadu_ps(q.as_ptr()))) };
            assert_eq!(got.map(f32::to_bits), want, "the lanes on {q:?}");
        }
        // … and all of them through the dispatch.
        // SAFETY: the CPU has AVX2 and FMA (asserted above).
        unsafe { exp_in_place_fma(&mut v) };
        assert_eq!(v.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), want);
        assert!(v[4] > 0.0 && v[4] < f32::MIN_POSITIVE, "a subnormal from the lanes: {}", v[4]);
        assert!(v[5] > 0.0 && v[5] < f32::MIN_POSITIVE, "a subnormal from the lanes: {}", v[5]);
        assert_eq!((v[2], v[3], v[10]), (1.0, 1.0, 0.0));
    }
}
