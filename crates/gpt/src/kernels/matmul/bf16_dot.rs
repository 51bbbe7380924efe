//! bf16 products at the rate of the instruction that multiplies bf16, with
//! one order on every x86-64 CPU.
//!
//! **The order.** Each output element is the chain of [`super`] — one
//! multiply-add per step of the contraction, `k = 0, 1, …, K−1`, in order,
//! from +0, each rounded to nearest even — with two more rules, those of the
//! instruction that does it in hardware, VDPBF16PS (AVX512_BF16): a bf16
//! input that is denormal counts as zero (DAZ), and a step whose result is
//! denormal gives zero of its sign (FTZ); and K is padded to even with a
//! step of `0 · 0`. VDPBF16PS adds two products into each f32 lane per
//! instruction, the odd (high) bf16 of each pair first, each a fused
//! multiply-add rounded to nearest even, with DAZ and FTZ — measured bit for
//! bit on an Intel Xeon (family 6, model 207) and an AMD EPYC Zen 5 (family
//! 26, model 2) with the probes in the project's notes — so packing each
//! pair as (high = k, low = k + 1) runs that chain, twice the products per
//! instruction of an f32 FMA.
//!
//! **Where it is the chain without DAZ and FTZ.** Say every nonzero value of
//! a row of `a` and of a column of `b` is normal, with an exponent of at
//! least e_a and e_b, with e_a + e_b ≥ −112. Each product is then a multiple of 2^−126
//! (the bf16 significand has 8 bits), so is every sum of them, and so is
//! every partial sum as rounded (a multiple of 2^−126 below 2^−103 needs no
//! rounding; above, a rounded f32 is a multiple of its own ulp, at least
//! 2^−126): no step's result is ever denormal, no input is, and no step
//! gives −0 (from +0, only a flush could), so the padding step changes
//! nothing. Such an element is exactly today's f32 chain over the widened
//! values, which every path computes with its f32 tiles. The model's
//! tensors are such: the bf16 digests did not move when this order came in.
//!
//! **The paths.** [`Bf16Dot::Native`]: VDPBF16PS tiles over pair-packed
//! panels, where the CPU has AVX512_BF16 and the matmul takes its AVX-512
//! path, once a start-up self-test ([`self_test`]) has held them to the
//! emulation on fixed inputs (denormals, tiny products, cancellations,
//! infinities, NaN, odd K). [`Bf16Dot::Emulated`] everywhere else: the f32
//! tiles on the widened values, then every element whose row and column
//! fail the exponent rule above computed again, alone, with the FPU's DAZ
//! and FTZ switched on inside one `asm!` block ([`chain_daz_ftz`]).
//! `FSDP_BF16=emulated` takes the emulated path on a CPU that has
//! AVX512_BF16 (to measure it; the bits are the same). AMX (TDPBF16PS) sums
//! each tile's K pairs in two chains from +0 and adds them after: it cannot
//! run this order, and is not used.

use half::bf16;
use std::mem::MaybeUninit;

use super::{Blocks, Isa, MR, NR, Operand, Path, Sweep, Tiles, aligned, assume_init, products};
use crate::precision::from_bf16;

/// How this CPU's bf16 products run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bf16Dot {
    /// VDPBF16PS tiles (AVX512_BF16), self-tested at start.
    Native,
    /// The f32 tiles on widened values, the few elements that need DAZ and FTZ computed again.
    Emulated,
}

/// Why the bf16 products run as they do, for the config line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Why {
    Native,
    NoAvx512Bf16,
    NarrowerPath,
    Asked,
    SelfTestFailed,
}

impl Bf16Dot {
    /// The path this CPU's bf16 products take (decided once, with the self-test).
    pub fn in_use() -> Bf16Dot {
        match why() {
            Why::Native => Bf16Dot::Native,
            _ => Bf16Dot::Emulated,
        }
    }

    /// One line for a lesson's config table: which instruction multiplies
    /// bf16 here, and why.
    pub fn describe() -> String {
        match why() {
            Why::Native => "VDPBF16PS (AVX512_BF16), self-tested against the emulation".into(),
            Why::NoAvx512Bf16 => "emulated on the f32 tiles (this CPU has no AVX512_BF16)".into(),
            Why::NarrowerPath => format!("emulated on the f32 tiles (FSDP_MATMUL={})", Isa::in_use().name()),
            Why::Asked => "emulated on the f32 tiles (FSDP_BF16=emulated)".into(),
            Why::SelfTestFailed => {
                "emulated on the f32 tiles: VDPBF16PS failed its self-test on this CPU (other bits than the emulation's)"
                    .into()
            }
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Bf16Dot::Native => "vdpbf16ps",
            Bf16Dot::Emulated => "emulated",
        }
    }

    /// Whether the VDPBF16PS tiles can run here: the CPU has AVX512_BF16 and
    /// they passed their self-test (whatever `FSDP_BF16` or `FSDP_MATMUL` say).
    pub fn native_available() -> bool {
        use std::sync::OnceLock;
        static OK: OnceLock<bool> = OnceLock::new();
        *OK.get_or_init(|| has_avx512_bf16() && self_test().is_ok())
    }
}

/// `FSDP_BF16`, checked as the lessons check the matmul's knobs: unset,
/// `native` or `emulated` (`native` on a CPU without AVX512_BF16 is refused).
pub fn check_env() -> std::result::Result<(), String> {
    asked().map(|_| ())
}

fn asked() -> std::result::Result<Option<Bf16Dot>, String> {
    let Ok(v) = std::env::var("FSDP_BF16") else { return Ok(None) };
    match v.as_str() {
        "emulated" => Ok(Some(Bf16Dot::Emulated)),
        "native" if has_avx512_bf16() => Ok(Some(Bf16Dot::Native)),
        "native" => Err("FSDP_BF16=native: this CPU has no AVX512_BF16: unset it, or set emulated".into()),
        _ => Err(format!("FSDP_BF16={v}: set native or emulated, or unset it")),
    }
}

fn has_avx512_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    return is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16");
    #[allow(unreachable_code)]
    false
}

fn why() -> Why {
    use std::sync::OnceLock;
    static WHY: OnceLock<Why> = OnceLock::new();
    *WHY.get_or_init(|| {
        let asked = asked().unwrap_or_else(|e| super::refuse(&e));
        if !has_avx512_bf16() {
            Why::NoAvx512Bf16
        } else if asked == Some(Bf16Dot::Emulated) {
            Why::Asked
        } else if Isa::in_use() != Isa::Avx512 {
            Why::NarrowerPath
        } else if !Bf16Dot::native_available() {
            Why::SelfTestFailed
        } else {
            Why::Native
        }
    })
}

/// Every batch item's `a @ b` of bf16 operands, in f32, in the one order
/// above, by this CPU's path.
pub(in crate::kernels) fn products_bf16(a: &Operand, x: &[bf16], b: &Operand, y: &[bf16], path: Path) -> Vec<f32> {
    match (Bf16Dot::in_use(), path) {
        (Bf16Dot::Native, Path::Fastest) => products_native(a, x, b, y, Blocks::for_path(Isa::Avx512)),
        (_, Path::Bf16Native) if Bf16Dot::native_available() => {
            products_native(a, x, b, y, Blocks::for_path(Isa::Avx512))
        }
        (_, Path::Bf16Native) => products_emulated(a, x, b, y, Path::Fastest),
        _ => products_emulated(a, x, b, y, path),
    }
}

// ---------------------------------------------------------------- emulated

/// A key whose minimum over values gives their least exponent: the
/// magnitude's bits less one (±0, wrapping, to the top). A finite value's
/// magnitude bits grow with its exponent, so the least key is one of the
/// values of least exponent. A vector of `u16`s: the minimum vectorises.
#[inline(always)]
fn key(v: bf16) -> u16 {
    (v.to_bits() & 0x7FFF).wrapping_sub(1)
}

/// The exponent (unbiased) a least [`key`] stands for, a denormal counted
/// below every normal value; `i32::MAX` for none (every value ±0: no product
/// to round).
fn exponent_of(key: u16) -> i32 {
    match key.wrapping_add(1) >> 7 {
        _ if key == u16::MAX => i32::MAX,
        0 => -200, // denormal: DAZ makes it 0, the plain chain does not
        e => e as i32 - 127,
    }
}

/// The least [`key`] of `x`: sixteen at a time (`vpminuw`) where the CPU
/// has AVX2, four such minimums in flight over 64 values at once, reduced
/// across the lanes by `phminposuw`: well under a cycle per sixteen values
/// on a long span, and a few cycles' overhead on a line of a head's 32.
fn least_key(x: &[bf16]) -> u16 {
    let scalar = |x: &[bf16]| x.iter().fold(u16::MAX, |m, &v| m.min(key(v)));
    #[cfg(target_arch = "x86_64")]
    if super::super::common::avx2() {
        #[target_feature(enable = "avx2")]
        fn on_avx2(x: &[bf16]) -> u16 {
            use std::arch::x86_64::*;
            let (mask, one) = (_mm256_set1_epi16(0x7FFF), _mm256_set1_epi16(1));
            // SAFETY (both): `p` points at sixteen bf16s, 32 bytes, inside `x`.
            let keys = |p: *const half::bf16| {
                _mm256_sub_epi16(_mm256_and_si256(unsafe { _mm256_loadu_si256(p.cast()) }, mask), one)
            };
            let mut least = [_mm256_set1_epi16(-1); 4];
            let quads = x.chunks_exact(64);
            let rest = quads.remainder();
            for q in quads {
                for (j, l) in least.iter_mut().enumerate() {
                    *l = _mm256_min_epu16(*l, keys(q[16 * j..].as_ptr()));
                }
            }
            let sixteens = rest.chunks_exact(16);
            let tail = sixteens.remainder();
            for c in sixteens {
                least[0] = _mm256_min_epu16(least[0], keys(c.as_ptr()));
            }
            let l = _mm256_min_epu16(_mm256_min_epu16(least[0], least[1]), _mm256_min_epu16(least[2], least[3]));
            let l = _mm_min_epu16(_mm256_castsi256_si128(l), _mm256_extracti128_si256::<1>(l));
            let lanes = _mm_cvtsi128_si32(_mm_minpos_epu16(l)) as u16; // the least of eight, in the low 16 bits
            tail.iter().fold(lanes, |m, &v| m.min(key(v)))
        }
        // SAFETY: the CPU has AVX2 (checked).
        return unsafe { on_avx2(x) };
    }
    scalar(x)
}

/// The least exponent of each line of `len` lines (rows of `a` or columns
/// of `b`), `k` steps each: element (i, kk) at `at + i·stride + kk·k_stride`.
fn least_exponents(x: &[bf16], at: usize, len: usize, stride: usize, k: usize, k_stride: usize) -> Vec<i32> {
    if k_stride == 1 {
        return (0..len).map(|i| exponent_of(least_key(&x[at + i * stride..][..k]))).collect();
    }
    let mut least = vec![u16::MAX; len];
    for kk in 0..k {
        match stride {
            1 => {
                let line = &x[at + kk * k_stride..][..len];
                super::super::common::zip_update(&mut least, line, |l, v| *l = (*l).min(key(v)));
            }
            _ => (0..len).for_each(|i| least[i] = least[i].min(key(x[at + i * stride + kk * k_stride]))),
        }
    }
    least.into_iter().map(exponent_of).collect()
}

/// The elements of the operand `op` reads, from the first to the last: a
/// superset of its values (a view of a wider buffer reads part of it).
fn span<'a>(op: &Operand, x: &'a [bf16]) -> &'a [bf16] {
    let first = op.batch_offsets.iter().copied().min().unwrap_or(0);
    let last = op.batch_offsets.iter().copied().max().unwrap_or(0)
        + (op.rows.max(1) - 1) * op.row_stride
        + (op.cols.max(1) - 1) * op.col_stride;
    &x[first..=last]
}

/// Where the exponents allow it, the plain f32 chain is this order's (see
/// the module's proof): two exponents summing to this or more.
const PLAIN_FROM: i32 = -112;

/// The emulated path: the f32 tiles on the widened values (`path`'s), then
/// each element whose row of `a` and column of `b` can reach a denormal
/// computed again by [`chain_daz_ftz`].
fn products_emulated(a: &Operand, x: &[bf16], b: &Operand, y: &[bf16], path: Path) -> Vec<f32> {
    let mut out = products(a, x, b, y, from_bf16, path);
    let (m, k, n) = (a.rows, a.cols, b.cols);
    if m == 0 || n == 0 || k == 0 {
        return out;
    }
    // Every value at once first (each operand's whole span: one pass at the SIMD width); only
    // where that cannot rule a denormal out, line by line.
    let (ea, eb) = (exponent_of(least_key(span(a, x))), exponent_of(least_key(span(b, y))));
    if ea.saturating_add(eb) >= PLAIN_FROM {
        return out;
    }
    for (item, (&ao, &bo)) in a.batch_offsets.iter().zip(&b.batch_offsets).enumerate() {
        let rows = least_exponents(x, ao, m, a.row_stride, k, a.col_stride);
        let cols = least_exponents(y, bo, n, b.col_stride, k, b.row_stride);
        let least_col = cols.iter().copied().min().unwrap_or(i32::MAX);
        let out = &mut out[item * m * n..][..m * n];
        let (mut row, mut col) = (vec![], vec![]);
        for (i, &ei) in rows.iter().enumerate() {
            if ei.saturating_add(least_col) >= PLAIN_FROM {
                continue; // the whole row is the plain chain
            }
            row.clear();
            row.extend((0..k).map(|kk| from_bf16(x[ao + i * a.row_stride + kk * a.col_stride])));
            for (j, _) in cols.iter().enumerate().filter(|&(_, &ej)| ei.saturating_add(ej) < PLAIN_FROM) {
                col.clear();
                col.extend((0..k).map(|kk| from_bf16(y[bo + kk * b.row_stride + j * b.col_stride])));
                out[i * n + j] = chain_daz_ftz(&row, &col);
            }
        }
    }
    out
}

/// One element of the order exactly: `acc ← a[k]·b[k] + acc` for k in
/// order from +0, fused and rounded to nearest even, with DAZ and FTZ, and a
/// `0 · 0` step when K is odd. On x86-64 the FPU computes it, with MXCSR's
/// DAZ and FTZ set and restored inside one `asm!` block (Rust may assume the
/// default MXCSR everywhere else); elsewhere a flush after each step, which
/// misses only results that round up to the least normal.
pub(super) fn chain_daz_ftz(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "one step per pair");
    let odd = a.len() % 2 == 1;
    #[cfg(target_arch = "x86_64")]
    if super::super::common::avx2_fma() {
        // SAFETY: the CPU has FMA (checked); the loop reads a[..n] and b[..n] only; MXCSR is
        // saved before and restored after, within this one block.
        return unsafe { chain_asm(a.as_ptr(), b.as_ptr(), a.len(), odd) };
    }
    let flush = |v: f32| if v != 0.0 && v.abs() < f32::MIN_POSITIVE { 0.0f32.copysign(v) } else { v };
    let daz = |v: f32| if v.abs() < f32::MIN_POSITIVE { 0.0f32.copysign(v) } else { v };
    let mut acc = 0f32;
    for (&x, &y) in a.iter().zip(b) {
        acc = flush(daz(x).mul_add(daz(y), acc));
    }
    if odd {
        acc = flush(0f32.mul_add(0.0, acc));
    }
    acc
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn chain_asm(a: *const f32, b: *const f32, n: usize, odd: bool) -> f32 {
    let mut acc = 0f32;
    let mut csr = [0u32; 2]; // the caller's MXCSR, and ours
    // SAFETY: see the caller; `csr` is ours to write.
    unsafe {
        std::arch::asm!(
            "vstmxcsr [{csr}]",
            "mov {t:e}, [{csr}]",
            "and {t:e}, 0xFFFF9FFF", // rounding: to nearest even
            "or {t:e}, 0x8040",      // FTZ (bit 15) and DAZ (bit 6)
            "mov [{csr} + 4], {t:e}",
            "vldmxcsr [{csr} + 4]",
            "test {n}, {n}",
            "jz 3f",
            "2:",
            "vmovss {x}, [{a}]",
            "vfmadd231ss {acc}, {x}, [{b}]",
            "add {a}, 4",
            "add {b}, 4",
            "dec {n}",
            "jnz 2b",
            "3:",
            "test {odd}, {odd}",
            "jz 4f",
            "vxorps {x}, {x}, {x}",
            "vfmadd231ss {acc}, {x}, {x}", // the padding step, 0 · 0
            "4:",
            "vldmxcsr [{csr}]",
            csr = in(reg) csr.as_mut_ptr(),
            t = out(reg) _,
            n = inout(reg) n => _,
            a = inout(reg) a => _,
            b = inout(reg) b => _,
            odd = in(reg) odd as usize,
            x = out(xmm_reg) _,
            acc = inout(xmm_reg) acc,
            options(nostack),
        );
    }
    acc
}

// ---------------------------------------------------------------- native

/// Packs `kb` steps of the contraction of every panel of `W` along `v`'s
/// `len` lines into `panels`, as [panel][pair][W] u32s (stored in f32
/// slots: the tiles read their bits), each pair (high = step 2p, low =
/// 2p + 1); past the edge, and the odd step's partner, 0. Compiled for AVX2
/// (the native path runs on AVX-512 CPUs): the interleaving loops vectorise,
/// and lines along k take [`pair_lines_avx2`]'s transposes.
fn pack_pairs<const W: usize>(v: &super::View, x: &[bf16], kb: usize, panels: &mut [MaybeUninit<f32>]) {
    #[cfg(target_arch = "x86_64")]
    if super::super::common::avx2() {
        #[target_feature(enable = "avx2")]
        fn on_avx2<const W: usize>(v: &super::View, x: &[bf16], kb: usize, panels: &mut [MaybeUninit<f32>]) {
            if v.k_stride == 1 && v.stride != 1 {
                return pair_lines_avx2::<W>(v, x, kb, panels);
            }
            pack_pairs_each::<W>(v, x, kb, panels)
        }
        // SAFETY: the CPU has AVX2 (checked).
        return unsafe { on_avx2::<W>(v, x, kb, panels) };
    }
    pack_pairs_each::<W>(v, x, kb, panels)
}

#[inline(always)]
fn pack_pairs_each<const W: usize>(v: &super::View, x: &[bf16], kb: usize, panels: &mut [MaybeUninit<f32>]) {
    let kp = kb.div_ceil(2);
    let bits = |i: usize, kk: usize| -> u32 {
        if i < v.len && kk < kb { x[v.at + i * v.stride + kk * v.k_stride].to_bits() as u32 } else { 0 }
    };
    let put = |p: &mut MaybeUninit<f32>, hi: u32, lo: u32| _ = p.write(f32::from_bits(hi << 16 | lo));
    if v.stride == 1 && v.len >= W {
        // W lines side by side in memory, k strided: each pair interleaves two runs.
        let full = v.len / W;
        for (q, panel) in panels.chunks_exact_mut(W * kp).enumerate() {
            for (pp, dst) in panel.chunks_exact_mut(W).enumerate() {
                let k0 = 2 * pp;
                if q < full && k0 + 1 < kb {
                    let r0: &[bf16; W] = x[v.at + q * W + k0 * v.k_stride..][..W].try_into().expect("W values");
                    let r1: &[bf16; W] = x[v.at + q * W + (k0 + 1) * v.k_stride..][..W].try_into().expect("W values");
                    for w in 0..W {
                        put(&mut dst[w], r0[w].to_bits() as u32, r1[w].to_bits() as u32);
                    }
                } else {
                    for (w, d) in dst.iter_mut().enumerate() {
                        put(d, bits(q * W + w, k0), bits(q * W + w, k0 + 1));
                    }
                }
            }
        }
    } else {
        for (q, panel) in panels.chunks_exact_mut(W * kp).enumerate() {
            for (pp, dst) in panel.chunks_exact_mut(W).enumerate() {
                for (w, d) in dst.iter_mut().enumerate() {
                    put(d, bits(q * W + w, 2 * pp), bits(q * W + w, 2 * pp + 1));
                }
            }
        }
    }
}

/// [`pack_pairs`] for lines along k (`k_stride` 1: a row-major `a`, or `b`
/// as wᵀ): each pair is one 32-bit word of its line, its halves swapped,
/// and eight lines by eight pairs are transposed in registers
/// ([`super::super::common::transpose8`], moves only: the bits are kept),
/// as the f32 packing does with eight values. The edge panel, a last pair
/// short of eight and an odd step go one pair at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn pair_lines_avx2<const W: usize>(v: &super::View, x: &[half::bf16], kb: usize, panels: &mut [MaybeUninit<f32>]) {
    use std::arch::x86_64::*;
    const { assert!(W == MR || W.is_multiple_of(8), "a panel of six lines or of groups of eight") };
    let (kp, whole) = (kb.div_ceil(2), kb / 2); // pairs, and those without an odd step's padding
    let p8 = whole / 8 * 8;
    let full = v.len / W; // panels without an edge
    let word =
        |line: &[half::bf16], pp: usize| (line[2 * pp].to_bits() as u32) << 16 | line[2 * pp + 1].to_bits() as u32;
    for (q, panel) in panels.chunks_exact_mut(W * kp).enumerate() {
        if q >= full {
            break; // the edge: below
        }
        let lines: [&[half::bf16]; W] = std::array::from_fn(|w| &x[v.at + (q * W + w) * v.stride..][..kb]);
        let dst = panel.as_mut_ptr().cast::<f32>();
        // SAFETY: each load reads 32 bytes, pairs pp..pp + 8 of a line, with 2(pp + 8) ≤ kb: inside
        // it; each store writes dst[(pp + j)·W + g ..][..n], (pp + j) < kp and g + n ≤ W: inside the panel.
        unsafe {
            for g in (0..W).step_by(8) {
                let n = (W - g).min(8); // lines in this group: 8, or the 6 of an MR panel
                for pp in (0..p8).step_by(8) {
                    let mut r = [_mm256_setzero_ps(); 8];
                    for (ri, line) in r.iter_mut().zip(&lines[g..g + n]) {
                        let w = _mm256_loadu_si256(line.as_ptr().add(2 * pp).cast());
                        // (low = step 2p, high = 2p + 1) in memory → (high = 2p, low = 2p + 1)
                        *ri = _mm256_castsi256_ps(_mm256_or_si256(
                            _mm256_slli_epi32::<16>(w),
                            _mm256_srli_epi32::<16>(w),
                        ));
                    }
                    for (j, t) in super::super::common::transpose8(r).into_iter().enumerate() {
                        let d = dst.add((pp + j) * W + g);
                        if n == 8 {
                            _mm256_storeu_ps(d, t);
                        } else {
                            _mm_storeu_ps(d, _mm256_castps256_ps128(t));
                            _mm_storel_epi64(d.add(4).cast(), _mm_castps_si128(_mm256_extractf128_ps::<1>(t)));
                        }
                    }
                }
            }
            for pp in p8..kp {
                for (w, line) in lines.iter().enumerate() {
                    let bits = match 2 * pp + 1 < kb {
                        true => word(line, pp),
                        false => (line[2 * pp].to_bits() as u32) << 16, // the odd step, beside 0
                    };
                    dst.add(pp * W + w).write(f32::from_bits(bits));
                }
            }
        }
    }
    if full * W < v.len {
        let edge = super::View { at: v.at + full * W * v.stride, len: v.len - full * W, ..*v };
        pack_pairs_each::<W>(&edge, x, kb, &mut panels[full * W * kp..]);
    }
}

/// The native path: `a` and `b` packed in pairs per k-block (k-blocks of an
/// even number of steps but the last), the VDPBF16PS tiles swept over them
/// columns first, each k-block continuing every element's chain.
fn products_native(a: &Operand, x: &[bf16], b: &Operand, y: &[bf16], blocks: Blocks) -> Vec<f32> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert!(a.batch_offsets.len() == b.batch_offsets.len() && k == b.rows, "matmul operands do not fit");
    let len = a.batch_offsets.len() * m * n;
    if m == 0 || n == 0 || k == 0 {
        return vec![0f32; len]; // an empty sum is 0
    }
    let tiles = native_tiles();
    let (mp, np) = (m.div_ceil(MR), n.div_ceil(NR));
    // A pair is 4 bytes, as one f32: the k-blocks the rule gives for f32 steps, in pairs.
    let kc = blocks.kc_for(k.div_ceil(2), m, n) * 2;
    let (mcp, ncp) = ((blocks.mc / MR).max(1), (blocks.nc / NR).max(1));
    let kp = k.div_ceil(2);
    let mut out: Vec<f32> = Vec::with_capacity(len);
    let (mut ap, mut bp) = (Vec::<f32>::with_capacity(mp * MR * kp + 15), Vec::<f32>::with_capacity(np * NR * kp + 15));
    let (ap, bp) = (aligned(&mut ap, mp * MR * kp), aligned(&mut bp, np * NR * kp));
    let k_blocks = || (0..k).step_by(kc).map(move |k0| (k0, kc.min(k - k0)));
    let at_a = |k0: usize, kb: usize, p: usize| k0 / 2 * mp * MR + p * MR * kb.div_ceil(2);
    let at_b = |k0: usize, kb: usize, q: usize| k0 / 2 * np * NR + q * NR * kb.div_ceil(2);
    let mut edge = [0f32; MR * 2 * NR];
    let items = a.batch_offsets.iter().zip(&b.batch_offsets);
    for ((&ao, &bo), out) in items.zip(out.spare_capacity_mut()[..len].chunks_exact_mut(m * n)) {
        for (k0, kb) in k_blocks() {
            let av = super::View { at: ao + k0 * a.col_stride, len: m, stride: a.row_stride, k_stride: a.col_stride };
            let bv = super::View { at: bo + k0 * b.row_stride, len: n, stride: b.col_stride, k_stride: b.row_stride };
            pack_pairs::<MR>(&av, x, kb, &mut ap[at_a(k0, kb, 0)..][..mp * MR * kb.div_ceil(2)]);
            pack_pairs::<NR>(&bv, y, kb, &mut bp[at_b(k0, kb, 0)..][..np * NR * kb.div_ceil(2)]);
        }
        // SAFETY: `pack_pairs` wrote every element of both (all k-blocks, every panel).
        let (ap, bp) = unsafe { (assume_init(ap), assume_init(bp)) };
        for (k0, kb) in k_blocks() {
            let kbp = kb.div_ceil(2);
            let apanel = |p: usize| &ap[at_a(k0, kb, p)..][..MR * kbp];
            let bpanel = |q: usize| &bp[at_b(k0, kb, q)..][..NR * kbp];
            for q0 in (0..np).step_by(ncp) {
                for p0 in (0..mp).step_by(mcp) {
                    let (ps, qs) = (p0..mp.min(p0 + mcp), q0..np.min(q0 + ncp));
                    let load = k0 > 0; // continue each element's chain where the block before left it
                    let sweep =
                        Sweep { kb: kbp, load, prefetch_chains: true, prefetch_panels: false, m, n, shift: 0, ps, qs };
                    sweep.run(&tiles, apanel, bpanel, out, &mut edge, &[]);
                }
            }
        }
    }
    // SAFETY: the first k-block's tiles (k > 0 here) stored every element of every item's output.
    unsafe { out.set_len(len) };
    out
}

/// The VDPBF16PS tiles, in the shapes of the AVX-512 path's: 6 × 16, 12 × 16,
/// 12 × 32 and 6 × 32, each `kp` pair steps over pair-packed panels.
fn native_tiles() -> Tiles {
    #[cfg(target_arch = "x86_64")]
    return Tiles { tile: tile_dp, avx512: Some((pair_dp, quad_dp, wide_dp)) };
    #[allow(unreachable_code)]
    {
        unreachable!("the native bf16 path runs only on x86-64")
    }
}

/// `rows` row panels (`ap[r]`) against `cols` column panels (`bp[c]`), `kp`
/// pair steps, into `c` (row stride `ldc`): the body every native tile shares.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
#[inline]
unsafe fn dp_tile<const R: usize, const C: usize>(
    kp: usize,
    ap: [*const u32; R],
    bp: [*const u32; C],
    c: *mut f32,
    ldc: usize,
    load: bool,
) {
    use std::arch::x86_64::*;
    use std::mem::transmute;
    unsafe {
        // R row panels of MR rows (R ≤ 2), C column panels of NR: one 16-lane register per row
        // and panel, the first R·MR rows of these.
        let mut acc = [[_mm512_setzero_ps(); C]; 2 * MR];
        let acc = &mut acc[..R * MR];
        if load {
            for (r, a) in acc.iter_mut().enumerate() {
                for (q, a) in a.iter_mut().enumerate() {
                    *a = _mm512_loadu_ps(c.add(r * ldc + q * NR));
                }
            }
        }
        for p in 0..kp {
            let b: [__m512bh; C] = std::array::from_fn(|q| transmute(_mm512_loadu_si512(bp[q].add(p * NR).cast())));
            for (panel, &a) in ap.iter().enumerate() {
                for r in 0..MR {
                    let x: __m512bh = transmute(_mm512_set1_epi32(*a.add(p * MR + r) as i32));
                    for q in 0..C {
                        acc[panel * MR + r][q] = _mm512_dpbf16_ps(acc[panel * MR + r][q], x, b[q]);
                    }
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            for (q, a) in a.iter().enumerate() {
                _mm512_storeu_ps(c.add(r * ldc + q * NR), *a);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn tile_dp(kp: usize, ap: &[f32], bp: &[f32], c: &mut [MaybeUninit<f32>], ldc: usize, load: bool) {
    assert!(ap.len() >= kp * MR && bp.len() >= kp * NR && c.len() >= (MR - 1) * ldc + NR);
    // SAFETY: native tiles run only where the CPU has AVX-512F and AVX512_BF16 (`why`); the
    // loads stay within the panels (checked), the stores within `c`; `c` is read only with
    // `load`, when the k-block before stored it.
    unsafe { dp_tile::<1, 1>(kp, [ap.as_ptr().cast()], [bp.as_ptr().cast()], c.as_mut_ptr().cast(), ldc, load) }
}

#[cfg(target_arch = "x86_64")]
fn pair_dp(kp: usize, ap0: &[f32], ap1: &[f32], bp: &[f32], c: &mut [MaybeUninit<f32>], ldc: usize, load: bool) {
    assert!(ap0.len() >= kp * MR && ap1.len() >= kp * MR && bp.len() >= kp * NR);
    assert!(c.len() >= (2 * MR - 1) * ldc + NR);
    let ap = [ap0.as_ptr().cast(), ap1.as_ptr().cast()];
    // SAFETY: as `tile_dp`.
    unsafe { dp_tile::<2, 1>(kp, ap, [bp.as_ptr().cast()], c.as_mut_ptr().cast(), ldc, load) }
}

#[cfg(target_arch = "x86_64")]
fn quad_dp(kp: usize, ap: [&[f32]; 2], bp: [&[f32]; 2], c: &mut [MaybeUninit<f32>], ldc: usize, load: bool) {
    assert!(ap.iter().all(|a| a.len() >= kp * MR) && bp.iter().all(|b| b.len() >= kp * NR));
    assert!(c.len() >= (2 * MR - 1) * ldc + 2 * NR);
    let (a, b) = (ap.map(|a| a.as_ptr().cast()), bp.map(|b| b.as_ptr().cast()));
    // SAFETY: as `tile_dp`.
    unsafe { dp_tile::<2, 2>(kp, a, b, c.as_mut_ptr().cast(), ldc, load) }
}

#[cfg(target_arch = "x86_64")]
fn wide_dp(kp: usize, ap: &[f32], bp: [&[f32]; 2], c: &mut [MaybeUninit<f32>], ldc: usize, load: bool) {
    assert!(ap.len() >= kp * MR && bp.iter().all(|b| b.len() >= kp * NR) && c.len() >= (MR - 1) * ldc + 2 * NR);
    // SAFETY: as `tile_dp`.
    unsafe {
        dp_tile::<1, 2>(kp, [ap.as_ptr().cast()], bp.map(|b| b.as_ptr().cast()), c.as_mut_ptr().cast(), ldc, load)
    }
}

// ---------------------------------------------------------------- self-test

/// The native tiles against the emulation, on fixed inputs that reach
/// every rule of the order: normal values, tiny products and sums, bf16
/// denormals, exact cancellations, zeros of both signs, infinities and a
/// NaN, an odd K and several k-blocks. An error names the first difference.
pub fn self_test() -> std::result::Result<(), String> {
    let (m, k, n) = (14, 75, 37);
    let mut rng = crate::rng::SplitMix64::new(2026);
    let mut value = |i: usize, kk: usize, salt: usize| -> bf16 {
        let r = rng.normal() as f32;
        let bits = match (i * 7 + kk * 3 + salt) % 23 {
            0 => 0x0001 | ((i as u16 & 1) << 15),     // denormal
            1 => 0x0080,                              // the least normal, 2^-126
            2 => bf16::from_f32(r * 1e-19).to_bits(), // tiny: products below 2^-126
            3 => 0x8000,                              // −0
            _ => bf16::from_f32(r).to_bits(),
        };
        bf16::from_bits(bits)
    };
    let mut x: Vec<bf16> = (0..m * k).map(|e| value(e / k, e % k, 0)).collect();
    let mut y: Vec<bf16> = (0..k * n).map(|e| value(e % n, e / n, 5)).collect();
    // Row 3 cancels column 4 exactly at its end; row 5 meets an infinity, row 6 a NaN.
    for kk in 0..k {
        x[3 * k + kk] = if kk < 40 { y[kk * n + 4] } else { bf16::from_f32(-y[(kk - 40) * n + 4].to_f32()) };
    }
    y[10 * n + 8] = bf16::INFINITY;
    y[11 * n + 9] = bf16::NAN;
    let a = Operand { batch_offsets: vec![0], rows: m, cols: k, row_stride: k, col_stride: 1 };
    let b = Operand { batch_offsets: vec![0], rows: k, cols: n, row_stride: n, col_stride: 1 };
    let want: Vec<f32> = (0..m * n)
        .map(|e| {
            let row: Vec<f32> = (0..k).map(|kk| from_bf16(x[e / n * k + kk])).collect();
            let col: Vec<f32> = (0..k).map(|kk| from_bf16(y[kk * n + e % n])).collect();
            chain_daz_ftz(&row, &col)
        })
        .collect();
    // This CPU's blocks, and k-blocks of 16 steps (five of them, the last odd).
    for blocks in [Blocks::for_path(Isa::Avx512), Blocks::fixed(16, 12, 32)] {
        let got = products_native(&a, &x, &b, &y, blocks);
        for (e, (g, w)) in got.iter().zip(&want).enumerate() {
            let same = g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan());
            if !same {
                return Err(format!("element ({}, {}): VDPBF16PS {g:e}, the emulation {w:e}", e / n, e % n));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fixed inputs of the self-test reach what they are for: some
    /// elements need DAZ or FTZ (the plain chain differs), one is an exact
    /// cancellation, one infinite, one NaN.
    #[test]
    fn the_self_test_passes_and_reaches_every_rule() {
        if Bf16Dot::in_use() == Bf16Dot::Native || has_avx512_bf16() {
            self_test().expect("VDPBF16PS against the emulation");
        }
        // DAZ: a denormal factor counts as 0; FTZ: a denormal step gives 0 of its sign.
        let tiny = f32::from_bits(0x0001_0000); // bf16 0x0001, a denormal
        assert_eq!(chain_daz_ftz(&[tiny], &[1.0]).to_bits(), 0, "DAZ");
        assert_eq!(chain_daz_ftz(&[tiny, 0.0], &[1.0, 0.0]).to_bits(), 0);
        let (a, b) = (2f32.powi(-64), -(2f32.powi(-64))); // the product 2^-128, a denormal
        assert_eq!(chain_daz_ftz(&[a, 0.0], &[b, 0.0]).to_bits(), 0, "FTZ, then 0·0 makes −0 +0");
        assert_eq!(chain_daz_ftz(&[a], &[b]).to_bits(), 0, "odd K: the padding step");
        let (one, least) = (1.0, 2f32.powi(-126));
        assert_eq!(
            chain_daz_ftz(&[one, a], &[least, a]).to_bits(),
            0x00a0_0000,
            "a denormal product inside one fused step counts"
        );
        // Without DAZ and FTZ, the plain chain keeps the denormal.
        assert_ne!(a.mul_add(b, 0.0).to_bits(), 0);
    }

    /// The SIMD minimum is the scalar one at every length around its chunks
    /// (64, 16, the tail), wherever the least value sits, ±0 and denormals included.
    #[test]
    fn the_least_key_is_the_scalar_minimum() {
        let mut rng = crate::rng::SplitMix64::new(3);
        for len in (0usize..=140).chain([1000, 4099]) {
            let x: Vec<bf16> = (0..len).map(|_| bf16::from_f32(rng.normal() as f32)).collect();
            for at in [0, len / 2, len.saturating_sub(1)].into_iter().filter(|_| len > 0) {
                for special in [1e-30f32, 0.0, -0.0, f32::from_bits(0x0001_0000), 1e30, f32::INFINITY] {
                    let mut y = x.clone();
                    y[at] = bf16::from_f32(special);
                    let want = y.iter().fold(u16::MAX, |m, &v| m.min(key(v)));
                    assert_eq!(least_key(&y), want, "len {len}, {special:e} at {at}");
                }
            }
            assert_eq!(least_key(&x), x.iter().fold(u16::MAX, |m, &v| m.min(key(v))), "len {len}");
        }
        assert_eq!(least_key(&[bf16::ZERO; 70]), u16::MAX, "every value ±0: no exponent");
    }

    /// The emulated path equals the order on inputs that need DAZ and FTZ
    /// (some elements computed again) and on plain ones (none), through
    /// every f32 path; and the native path, where the CPU has it, too.
    #[test]
    fn every_bf16_path_gives_the_order_exactly() {
        let (m, k, n) = (19, 41, 35);
        let mut rng = crate::rng::SplitMix64::new(7);
        for tiny in [false, true] {
            let mut draw = |len: usize| -> Vec<bf16> {
                (0..len)
                    .map(|e| {
                        let r = rng.normal() as f32;
                        bf16::from_f32(if tiny && e % 11 == 0 { r * 1e-30 } else { r })
                    })
                    .collect()
            };
            let (mut x, mut y) = (draw(m * k), draw(k * n));
            if tiny {
                // Row 2 of a and column 3 of b near 1e-20: their products (about 1e-40) are denormal,
                // every step of element (2, 3) flushed, where the plain chain adds them up.
                (0..k).for_each(|kk| x[2 * k + kk] = bf16::from_f32(x[2 * k + kk].to_f32() * 1e-20));
                (0..k).for_each(|kk| y[3 * k + kk] = bf16::from_f32(y[3 * k + kk].to_f32() * 1e-20));
            }
            let a = Operand { batch_offsets: vec![0], rows: m, cols: k, row_stride: k, col_stride: 1 };
            let b = Operand { batch_offsets: vec![0], rows: k, cols: n, row_stride: 1, col_stride: k }; // bᵀ stored
            let want: Vec<u32> = (0..m * n)
                .map(|e| {
                    let row: Vec<f32> = (0..k).map(|kk| from_bf16(x[e / n * k + kk])).collect();
                    let col: Vec<f32> = (0..k).map(|kk| from_bf16(y[e % n * k + kk])).collect();
                    chain_daz_ftz(&row, &col).to_bits()
                })
                .collect();
            for isa in Isa::available() {
                let got = products_emulated(&a, &x, &b, &y, Path::Forced(isa, Blocks::fixed(8, 6, 16)));
                assert_eq!(
                    got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    want,
                    "emulated on {isa:?}, tiny {tiny}"
                );
            }
            if has_avx512_bf16() {
                for blocks in [Blocks::for_path(Isa::Avx512), Blocks::fixed(10, 6, 16), Blocks::fixed(6, 12, 32)] {
                    let got = products_native(&a, &x, &b, &y, blocks);
                    assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want, "native, tiny {tiny}");
                }
            }
            // Plain inputs: the order is the plain f32 chain; tiny ones: it is not, somewhere.
            let plain = products(&a, &x, &b, &y, from_bf16, Path::Fastest);
            let plain: Vec<u32> = plain.iter().map(|v| v.to_bits()).collect();
            assert_eq!(plain == want, !tiny, "the plain chain, tiny {tiny}");
        }
    }
}
