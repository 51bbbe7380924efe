//! The bias add of a linear layer and the erf GELU, each one pass forward
//! and one back.
//!
//! candle's `broadcast_add` of a bias has a backward that sums the
//! gradient over every row with its generic strided reduction, and its
//! `gelu_erf` a backward of ten element-wise ops, each into a fresh tensor.
//!
//! ```text
//! bias_add  y = x + b (b on every row)       dx = g,  db = Σ_rows g   (rows in order)
//! gelu      y = x · Φ(x)                     dx = g · (Φ(x) + x · φ(x))
//!           Φ(x) = (1 + erf(x/√2)) / 2,  φ(x) = exp(−x²/2) / √(2π)
//! ```
//!
//! In f32, `erf` is Abramowitz & Stegun's 7.1.26 (absolute error below
//! 6e-7 in f32; the formula PyTorch's vectorised CPU GELU uses too) and `exp` a
//! Cody–Waite reduction with a degree-6 polynomial, both written with plain
//! IEEE multiplies and adds: no library call, so the compiler vectorises
//! the loops, and every machine computes the same bits. f64 (the
//! finite-difference tests) uses `libm`'s `erf` and std's `exp`. bf16 is
//! widened, computed in f32 and rounded once.
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor, bail};
use half::bf16;

use super::common::{cpu, from_bf16, map, map_f32, narrow, nonempty, row_sum, to_bf16, values, zip_map, zip_map_f32};

/// `x + b` with `b` (N) added to every row of `x` (…, N). Differentiable.
pub fn bias_add(x: &Tensor, b: &Tensor) -> Result<Tensor> {
    x.apply_op2(b, BiasAdd)
}

/// GELU with the exact (erf) normal CDF, as torch's `F.gelu`. Differentiable.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    x.apply_op1(Gelu)
}

struct BiasAdd;
pub(super) struct Gelu;
/// GELU's backward as an op: (x, g) → dx.
pub(super) struct GeluBackward;

/// `f` on every element of `x` (and `y`), in the dtype's precision; bf16 widened to f32.
macro_rules! map {
    ($s:expr, $l:expr, $op:expr, |$v:ident| $f32:expr, $f64:expr) => {{
        match $s.dtype() {
            DType::F32 => CpuStorage::F32(map_f32(values::<f32>($s, $l, $op)?, |$v| $f32)),
            DType::F64 => CpuStorage::F64(values::<f64>($s, $l, $op)?.iter().map(|&$v| $f64).collect()),
            DType::BF16 => CpuStorage::BF16(map(values::<bf16>($s, $l, $op)?, |w| {
                let $v = from_bf16(w);
                to_bf16($f32)
            })),
            d => bail!("{} supports f32, bf16 and f64, got {d:?}", $op),
        }
    }};
}

const FRAC_1_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

/// e^x, from plain f32 operations: x = n·ln2 + r with |r| ≤ ln2/2 (ln2
/// split in two so the reduction is exact), e^r by a degree-6 Taylor
/// polynomial (relative error below 2e-7 there), 2^n through the exponent
/// bits. x is clamped to [−87, 88] (2^n stays a normal f32): below, the
/// result is e^−87 ≈ 1.6e−38, above e^88, never 0 or ∞; a NaN stays NaN.
#[inline(always)]
pub(super) fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75; // ln 2's leading bits: n·LN2_HI is exact
    const LN2_LO: f32 = 1.428_606_8e-6;
    const ROUND: f32 = 12_582_912.0; // 1.5·2²³: adding it rounds to an integer (ties to even)
    let x = x.clamp(-87.0, 88.0); // a NaN stays NaN
    let shifted = x * LOG2E + ROUND; // n in its low mantissa bits
    let n = shifted - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0 + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // 2^n: n + 127 into the exponent field (integer ops only, no float → int conversion)
    let scale = f32::from_bits(shifted.to_bits().wrapping_add(127) << 23);
    p * scale
}

/// erf(x), Abramowitz & Stegun 7.1.26: |error| < 1.5e-7 in exact arithmetic,
/// below 6e-7 in f32 (the test measures it). `e` is e^(−x²), which the
/// caller may already have.
#[inline(always)]
fn erf_with(x: f32, e: f32) -> f32 {
    let t = 1.0 / (1.0 + 0.327_591_1 * x.abs());
    let poly = t * (0.254_829_6 + t * (-0.284_496_74 + t * (1.421_413_8 + t * (-1.453_152_1 + t * 1.061_405_4))));
    (1.0 - poly * e).copysign(x)
}

#[inline(always)]
pub(super) fn erf_f32(x: f32) -> f32 {
    erf_with(x, exp_f32(-x * x))
}

#[inline(always)]
fn gelu_f32(x: f32) -> f32 {
    0.5 * x * (1.0 + erf_f32(x * std::f32::consts::FRAC_1_SQRT_2))
}
fn gelu_f64(x: f64) -> f64 {
    0.5 * x * (1.0 + libm::erf(x * std::f64::consts::FRAC_1_SQRT_2))
}
/// d gelu / dx = Φ(x) + x·φ(x): one exp serves both (e^(−a²) with a = x/√2 is e^(−x²/2)).
#[inline(always)]
fn dgelu_f32(x: f32) -> f32 {
    let a = x * std::f32::consts::FRAC_1_SQRT_2;
    let e = exp_f32(-a * a);
    0.5 * (1.0 + erf_with(a, e)) + x * e * FRAC_1_SQRT_2PI as f32
}
fn dgelu_f64(x: f64) -> f64 {
    0.5 * (1.0 + libm::erf(x * std::f64::consts::FRAC_1_SQRT_2)) + x * (-0.5 * x * x).exp() * FRAC_1_SQRT_2PI
}

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "gelu-erf"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((map!(s, l, "gelu", |v| gelu_f32(v), gelu_f64(v)), l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(x.apply_op2_no_bwd(&grad.contiguous()?, &GeluBackward)?))
    }
}

impl CustomOp2 for GeluBackward {
    fn name(&self) -> &'static str {
        "gelu-erf-backward"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        if l1.dims() != l2.dims() {
            bail!("gelu backward: x {:?} and its gradient {:?} differ", l1.dims(), l2.dims());
        }
        let op = "gelu backward";
        let out = match (s1, s2) {
            (CpuStorage::F32(_), CpuStorage::F32(_)) => {
                let (x, g) = (values::<f32>(s1, l1, op)?, values::<f32>(s2, l2, op)?);
                CpuStorage::F32(zip_map_f32(x, g, |x, g| g * dgelu_f32(x)))
            }
            (CpuStorage::F64(_), CpuStorage::F64(_)) => {
                let (x, g) = (values::<f64>(s1, l1, op)?, values::<f64>(s2, l2, op)?);
                CpuStorage::F64(x.iter().zip(g).map(|(&x, &g)| g * dgelu_f64(x)).collect())
            }
            (CpuStorage::BF16(_), CpuStorage::BF16(_)) => {
                let (x, g) = (values::<bf16>(s1, l1, op)?, values::<bf16>(s2, l2, op)?);
                CpuStorage::BF16(zip_map(x, g, |x, g| to_bf16(from_bf16(g) * dgelu_f32(from_bf16(x)))))
            }
            _ => bail!("gelu backward: unsupported dtypes {:?}, {:?}", s1.dtype(), s2.dtype()),
        };
        Ok((out, l1.shape().clone()))
    }
}

/// `a + b` of one shape as one op, differentiable: f32 and f64 added in
/// their precision, bf16 widened, added in f32 and rounded once ([`to_bf16`]),
/// which are the bits of candle's add on a CPU without AVX512_BF16, and of
/// every CPU here: where the CPU has AVX512_BF16, candle's bf16 add rounds
/// with VCVTNEPS2BF16, which flushes a denormal result to zero. It also
/// runs at the SIMD width, where candle's widens and rounds eight values
/// at a time through out-of-line calls. The model's residual adds, and a
/// block tape's two sums of gradients.
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    a.apply_op2(b, Add)
}

pub(super) struct Add;

impl CustomOp2 for Add {
    fn name(&self) -> &'static str {
        "add"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        if l1.dims() != l2.dims() {
            bail!("add: shapes {:?} and {:?} differ", l1.dims(), l2.dims());
        }
        let op = "add";
        let out = match (s1, s2) {
            (CpuStorage::F32(_), CpuStorage::F32(_)) => {
                CpuStorage::F32(zip_map_f32(values(s1, l1, op)?, values(s2, l2, op)?, |a, b| a + b))
            }
            (CpuStorage::F64(_), CpuStorage::F64(_)) => {
                let (a, b) = (values::<f64>(s1, l1, op)?, values::<f64>(s2, l2, op)?);
                CpuStorage::F64(a.iter().zip(b).map(|(&a, &b)| a + b).collect())
            }
            (CpuStorage::BF16(_), CpuStorage::BF16(_)) => {
                let (a, b) = (values::<bf16>(s1, l1, op)?, values::<bf16>(s2, l2, op)?);
                CpuStorage::BF16(zip_map(a, b, |a, b| to_bf16(from_bf16(a) + from_bf16(b))))
            }
            _ => bail!("add: unsupported dtypes {:?}, {:?}", s1.dtype(), s2.dtype()),
        };
        Ok((out, l1.shape().clone()))
    }

    /// An add's gradient is the gradient itself, for both operands.
    fn bwd(&self, _a: &Tensor, _b: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(grad.clone()), Some(grad.clone())))
    }
}

impl CustomOp2 for BiasAdd {
    fn name(&self) -> &'static str {
        "bias-add"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        nonempty(l1.dims(), "bias_add")?;
        let n = *l1.dims().last().unwrap_or(&0);
        if l2.dims() != [n] {
            bail!("bias_add: x {:?} needs a bias of ({n}), got {:?}", l1.dims(), l2.dims());
        }
        let op = "bias_add";
        macro_rules! rows {
            ($t:ty, $add:expr) => {{
                let (x, b) = (values::<$t>(s1, l1, op)?, values::<$t>(s2, l2, op)?);
                let mut y = Vec::with_capacity(x.len());
                for row in x.chunks_exact(n) {
                    y.extend(row.iter().zip(b).map(|(&x, &b)| $add(x, b)));
                }
                y
            }};
        }
        let out = match (s1, s2) {
            (CpuStorage::F32(_), CpuStorage::F32(_)) => CpuStorage::F32(rows!(f32, |x: f32, b: f32| x + b)),
            (CpuStorage::F64(_), CpuStorage::F64(_)) => CpuStorage::F64(rows!(f64, |x: f64, b: f64| x + b)),
            // bf16 + bf16, rounded once: what candle's bf16 add computes
            (CpuStorage::BF16(_), CpuStorage::BF16(_)) => {
                CpuStorage::BF16(rows!(bf16, |x: bf16, b: bf16| to_bf16(from_bf16(x) + from_bf16(b))))
            }
            _ => bail!("bias_add: unsupported dtypes {:?}, {:?}", s1.dtype(), s2.dtype()),
        };
        Ok((out, l1.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, b: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // dx is the gradient itself; db sums it over the rows, in row order.
        let g = grad.contiguous()?;
        let n = b.elem_count();
        let (storage, l) = g.storage_and_layout();
        let s = cpu(&storage, "bias_add")?;
        let op = "bias_add backward";
        let db = match g.dtype() {
            DType::F32 => Tensor::from_vec(row_sum(values::<f32>(s, l, op)?, n, |g| g), n, g.device())?,
            DType::F64 => Tensor::from_vec(row_sum(values::<f64>(s, l, op)?, n, |g| g), n, g.device())?,
            DType::BF16 => Tensor::from_vec(narrow(row_sum(values::<bf16>(s, l, op)?, n, from_bf16)), n, g.device())?,
            d => bail!("bias_add supports f32, bf16 and f64, got {d:?}"),
        };
        drop(storage);
        Ok((Some(g), Some(db)))
    }
}

#[cfg(test)]
mod tests {
    use super::super::common::testing::{self, max_diff};
    use super::super::common::zip_map_f32_in;
    use super::*;
    use candle_core::{Device, Var};

    /// Normal values with σ = 2: GELU's curve over its whole bend.
    fn random(shape: &[usize], seed: u64) -> Tensor {
        (testing::random(shape, seed) * 2.0).unwrap()
    }

    /// Both ops against candle's composites, forward and backward, f64 and f32.
    #[test]
    fn agree_with_the_composite_ops_forward_and_backward() {
        let (x, b, g) = (random(&[6, 10], 1), random(&[10], 2), random(&[6, 10], 3));
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
            let to = |t: &Tensor| Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap();
            let g = g.to_dtype(dtype).unwrap();
            let (xf, bf, xc, bc) = (to(&x), to(&b), to(&x), to(&b));
            let yf = gelu(&bias_add(xf.as_tensor(), bf.as_tensor()).unwrap()).unwrap();
            let yc = xc.as_tensor().broadcast_add(bc.as_tensor()).unwrap().gelu_erf().unwrap();
            assert!(max_diff(&yf, &yc) < tol, "{dtype:?} forward: {}", max_diff(&yf, &yc));
            let gf = (&yf * &g).unwrap().sum_all().unwrap().backward().unwrap();
            let gc = (&yc * &g).unwrap().sum_all().unwrap().backward().unwrap();
            // candle's GELU backward uses 0.398942 for 1/√(2π) (ours is exact,
            // see the finite differences below): its gradients differ by up to ~1e-6.
            let tol = tol.max(2e-6);
            for (f, c, name) in [(&xf, &xc, "x"), (&bf, &bc, "b")] {
                let (a, e) = (gf.get(f.as_tensor()).unwrap(), gc.get(c.as_tensor()).unwrap());
                assert!(max_diff(a, e) < tol, "{dtype:?} d{name}: {}", max_diff(a, e));
            }
        }
    }

    /// Both gradients against central finite differences, in f64.
    #[test]
    fn backward_matches_finite_differences() {
        let (x, b, g) = (random(&[3, 4], 4), random(&[4], 5), random(&[3, 4], 6));
        let f = |x: &Tensor, b: &Tensor| {
            (gelu(&bias_add(x, b).unwrap()).unwrap() * &g).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap()
        };
        let (vx, vb) = (Var::from_tensor(&x).unwrap(), Var::from_tensor(&b).unwrap());
        let y = gelu(&bias_add(vx.as_tensor(), vb.as_tensor()).unwrap()).unwrap();
        let store = (y * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let h = 1e-6;
        for (k, (v, t)) in [(&vx, &x), (&vb, &b)].into_iter().enumerate() {
            let analytic: Vec<f64> = store.get(v.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            for (e, &a) in analytic.iter().enumerate() {
                let at = |d: f64| {
                    let mut p: Vec<f64> = t.flatten_all().unwrap().to_vec1().unwrap();
                    p[e] += d;
                    let moved = Tensor::from_vec(p, t.shape(), &Device::Cpu).unwrap();
                    if k == 0 { f(&moved, &b) } else { f(&x, &moved) }
                };
                let numeric = (at(h) - at(-h)) / (2.0 * h);
                assert!((a - numeric).abs() < 1e-6, "arg {k} element {e}: analytic {a}, numeric {numeric}");
            }
        }
    }

    #[test]
    fn every_width_gives_the_bits_of_one() {
        // The element-wise loops run AVX2-wide where the CPU has it, AVX-512-wide
        // on the AVX-512 path; each element must still be the scalar formula's bits. Values across
        // GELU's whole range, edges included: ±0, tiny, huge, ±∞, NaN (a NaN
        // need only stay a NaN: its sign and payload are the hardware's).
        let mut rng = crate::rng::SplitMix64::new(11);
        let mut x: Vec<f32> = (0..4099).map(|_| (rng.normal() * 4.0) as f32).collect();
        x.extend([0.0, -0.0, 1e-40, -1e-30, 30.0, -30.0, 1e30, -1e30, f32::INFINITY, f32::NEG_INFINITY, f32::NAN]);
        let g: Vec<f32> = x.iter().rev().copied().collect();
        // One element at a time, through an opaque call: no loop for the compiler to widen.
        let check = |what: &str, wide: Vec<f32>, one: &dyn Fn(usize) -> f32| {
            for (i, &w) in wide.iter().enumerate() {
                let s = std::hint::black_box(one(i));
                assert!(w.to_bits() == s.to_bits() || (w.is_nan() && s.is_nan()), "{what}({}): {w:e} vs {s:e}", x[i]);
            }
        };
        check("gelu", map_f32(&x, gelu_f32), &|i| gelu_f32(x[i]));
        check("gelu backward", zip_map_f32(&x, &g, |x, g| g * dgelu_f32(x)), &|i| g[i] * dgelu_f32(x[i]));
        // Every width this CPU runs, whichever the path in use takes.
        let mut widths = vec![4];
        #[cfg(target_arch = "x86_64")]
        widths.extend(
            [(8, std::arch::is_x86_feature_detected!("avx2")), (16, std::arch::is_x86_feature_detected!("avx512f"))]
                .into_iter()
                .filter_map(|(w, has)| has.then_some(w)),
        );
        for w in widths {
            check(&format!("gelu, {w} lanes"), zip_map_f32_in(w, &x, &x, |v, _| gelu_f32(v)), &|i| gelu_f32(x[i]));
            let backward = zip_map_f32_in(w, &x, &g, |x, g| g * dgelu_f32(x));
            check(&format!("gelu backward, {w} lanes"), backward, &|i| g[i] * dgelu_f32(x[i]));
        }
    }

    /// The f32 `exp` and `erf` against `libm` (f64) over their whole useful range.
    #[test]
    fn exp_and_erf_are_accurate() {
        let (mut worst_exp, mut worst_erf) = (0f64, 0f64);
        for i in -870_000..=880_000 {
            let x = i as f32 * 1e-4;
            let want = libm::exp(x as f64);
            worst_exp = worst_exp.max(((exp_f32(x) as f64 - want) / want).abs());
        }
        for i in -60_000..=60_000 {
            let x = i as f32 * 1e-4;
            worst_erf = worst_erf.max((erf_f32(x) as f64 - libm::erf(x as f64)).abs());
        }
        assert!(worst_exp < 4e-7, "exp: relative error {worst_exp:e}");
        // A&S's 1.5e-7, plus f32's rounding of 1 − poly·e^(−x²) where both are near 1
        assert!(worst_erf < 6e-7, "erf: absolute error {worst_erf:e}");
        // Far out: e^x tiny and positive (clamped at −87), erf exactly ±1.
        assert!(exp_f32(-100.0) > 0.0 && exp_f32(-100.0) < 1e-37);
        assert_eq!((erf_f32(-9.0), erf_f32(9.0)), (-1.0, 1.0));
        // A broken run must not look healthy: NaN goes through.
        assert!(exp_f32(f32::NAN).is_nan() && gelu_f32(f32::NAN).is_nan() && dgelu_f32(f32::NAN).is_nan());
    }

    /// bf16: GELU widened, computed in f32, rounded once; the bias add is candle's bf16 add, bit for bit.
    #[test]
    fn bf16_rounds_once() {
        let (x, b) =
            (random(&[5, 8], 7).to_dtype(DType::BF16).unwrap(), random(&[8], 8).to_dtype(DType::BF16).unwrap());
        let bits = |t: &Tensor| {
            t.flatten_all().unwrap().to_vec1::<bf16>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        let wide = gelu(&x.to_dtype(DType::F32).unwrap()).unwrap().to_dtype(DType::BF16).unwrap();
        assert_eq!(bits(&gelu(&x).unwrap()), bits(&wide));
        assert_eq!(bits(&bias_add(&x, &b).unwrap()), bits(&x.broadcast_add(&b).unwrap()));
        // GELU's backward too: the f32 one, rounded once.
        let g = random(&[5, 8], 9).to_dtype(DType::BF16).unwrap();
        let back = |x: &Tensor, g: &Tensor| x.apply_op2_no_bwd(g, &GeluBackward).unwrap();
        let wide = back(&x.to_dtype(DType::F32).unwrap(), &g.to_dtype(DType::F32).unwrap());
        assert_eq!(bits(&back(&x, &g)), bits(&wide.to_dtype(DType::BF16).unwrap()));
    }
}
