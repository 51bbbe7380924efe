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
//! since each SIMD lane holds its own output element. So the AVX-512 path,
//! the AVX2 path and the portable path (`f32::mul_add`, exact on every
//! platform) give the same bits.
//!
//! The speed comes from BLIS's structure: operands packed into panels of
//! `MR` rows of `a` and `NR` columns of `b`, a 6 × 16 tile of accumulators
//! (12 AVX registers) updated by 12 FMAs per step of `k` (with AVX-512, where
//! two full row and column panels remain, a 12 × 32 tile: 24 of AVX-512's 32
//! registers, 24 FMAs per step; a 6 × 32 one for a row panel left over), and
//! the loops blocked so that what the tile reads stays in the caches — `kc`
//! steps of the contraction at a time (a `kc`-deep panel of `b` stays in L2),
//! `mc` rows of `a` and `nc` columns of `b` (each a block within L3), sized
//! from the cache topology by a rule measured here ([`Blocks::from_caches`]:
//! not BLIS's L1-sized `kc`, which measured slower at the lessons' shapes on
//! a Zen 3 — but faster for the AVX2 tiles on an Intel core, which take it:
//! [`Blocks::l1_resident`]). Where one packed k-block of all of `b` fits in
//! half of L2 (the k-blocks made shallower to fit, down to 192 steps, if
//! they must), the tiles take twelve rows (AVX-512) and `a`'s lines run
//! along k, the loops run rows first, each pair of row panels of `a` packed
//! just before its tiles use it (see `products`).
//! Blocking the contraction does not split the chain: each `kc`-block
//! *continues* it, the tile loading its accumulators from the output where
//! the block before stored them (an f32 load and store are exact), so every
//! element is still one chain over k in order, whatever the block sizes —
//! which the cache sizes may therefore choose freely. Parts of the packing
//! ask for the lines they will read next (`common::prefetch`), since an
//! operand may come from L3 or memory, where an op before left it. Where
//! the packed `a` and `b` outgrow half of L2, each column's sweep (columns
//! first) asks for the next column panel of `b` (and on the AVX2 path the
//! next block of `a`) into L2 — on an Intel core only: on a Zen 3 and a
//! Zen 4 the asks measured slower ([`Blocks::rule`]). The 12 × 32 AVX-512 tile
//! always asks for its own panels' next lines. On the AVX2 path the column
//! panels of a large output follow its 64-byte lines (`column_shift`), so
//! that no row of a tile straddles two.
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor, bail};
use half::bf16;
use std::mem::MaybeUninit;

use super::common::{from_bf16, narrow, per_line, prefetch, prefetch_l2};

mod bf16_dot;
pub use bf16_dot::{Bf16Dot, self_test as bf16_self_test};

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

/// [`matmul`] through the tiles of `isa` (one this CPU runs: [`Isa::available`]),
/// without a backward: for benchmarks of each path.
pub fn matmul_on(a: &Tensor, b: &Tensor, isa: Isa) -> Result<Tensor> {
    if !Isa::available().contains(&isa) {
        bail!("this CPU does not run the {} path", isa.name());
    }
    a.apply_op2_no_bwd(b, &MatMul { path: Path::On(isa) })
}

/// A bf16 path to measure: VDPBF16PS, or the emulation on the f32 tiles of an [`Isa`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bf16Route {
    Native,
    Emulated(Isa),
}

impl Bf16Route {
    /// Every bf16 path this CPU runs: VDPBF16PS where it passed its
    /// self-test (or would: it is tried), then the emulation on each f32 path.
    pub fn available() -> Vec<Bf16Route> {
        let native = Bf16Dot::native_available().then_some(Bf16Route::Native);
        native.into_iter().chain(Isa::available().into_iter().map(Bf16Route::Emulated)).collect()
    }

    pub fn name(self) -> String {
        match self {
            Bf16Route::Native => "bf16 vdpbf16ps".into(),
            Bf16Route::Emulated(isa) => format!("bf16 {} (emulated)", isa.name()),
        }
    }
}

/// [`matmul`] of two bf16 tensors through `route` (one this CPU runs:
/// [`Bf16Route::available`]), without a backward: for benchmarks of each path.
pub fn matmul_bf16_on(a: &Tensor, b: &Tensor, route: Bf16Route) -> Result<Tensor> {
    if !Bf16Route::available().contains(&route) {
        bail!("this CPU does not run the {} path", route.name());
    }
    let path = match route {
        Bf16Route::Native => Path::Bf16Native,
        Bf16Route::Emulated(isa) => Path::On(isa),
    };
    a.apply_op2_no_bwd(b, &MatMul { path })
}

/// Which tiles to use: the widest the CPU runs (or the one `FSDP_MATMUL`
/// names, for benchmarks), or — for the tests that hold the paths against
/// each other — a narrower one, with block sizes forced small. All give the
/// same bits.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Path {
    Fastest,
    On(Isa),
    /// bf16 operands through the VDPBF16PS tiles (f32 ones: `Fastest`).
    Bf16Native,
    #[cfg(test)]
    Forced(Isa, Blocks),
}

/// The instruction sets the tiles are written for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Avx512,
    Avx2,
    Portable,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
            Isa::Portable => "portable",
        }
    }

    /// Every path this CPU runs, widest first.
    pub fn available() -> Vec<Isa> {
        let mut v = vec![];
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = super::common::avx2_fma();
            if avx2 && is_x86_feature_detected!("avx512f") {
                v.push(Isa::Avx512);
            }
            if avx2 {
                v.push(Isa::Avx2);
            }
        }
        v.push(Isa::Portable);
        v
    }

    /// The path the model's matmul takes: the widest this CPU runs, unless
    /// `FSDP_MATMUL=avx2|portable` asks for a narrower one (to measure a
    /// narrower ISA on a wider CPU: the bits are the same either way).
    pub fn in_use() -> Isa {
        use std::sync::OnceLock;
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            let all = Isa::available();
            Isa::asked().unwrap_or_else(|e| refuse(&e)).unwrap_or(all[0])
        })
    }

    /// The path `FSDP_MATMUL` asks for, if set; an error line if it names
    /// none this CPU runs.
    fn asked() -> std::result::Result<Option<Isa>, String> {
        let Ok(a) = std::env::var("FSDP_MATMUL") else { return Ok(None) };
        let all = Isa::available();
        match all.iter().copied().find(|i| i.name() == a) {
            Some(isa) => Ok(Some(isa)),
            None => {
                let names: Vec<&str> = all.iter().map(|i| i.name()).collect();
                Err(format!("FSDP_MATMUL={a}: this CPU runs {}: set one of them, or unset it", names.join(", ")))
            }
        }
    }
}

/// The matmul's measuring knobs (`FSDP_MATMUL`, `FSDP_MATMUL_BLOCKS`), read
/// as the first matmul will read them: the line to print if one is set
/// wrong. The lessons ask before their first collective, so that every rank
/// stops together and rank 0 alone says why.
pub fn check_env() -> std::result::Result<(), String> {
    Isa::asked()?;
    Blocks::asked()?;
    bf16_dot::check_env()
}

/// A measuring knob set wrong where no lesson checked it first (a benchmark,
/// an example): one line, and the process ends with exit code 2.
fn refuse(line: &str) -> ! {
    eprintln!("error: {line}");
    std::process::exit(2)
}

// ANCHOR: blocks
/// Block sizes, in elements: `kc` steps of the contraction, `mc` rows of
/// `a` (a multiple of `MR`), `nc` columns of `b` (a multiple of `NR`); for
/// an output of at most `small_out` bytes, `kc_small` steps instead. Where
/// one packed k-block of all of `b` takes at most `rows_first_b` bytes (and
/// the tiles take twelve rows, and `a`'s lines run along k), the loops run
/// rows first (see `products`), in k-blocks made shallower to fit where
/// `rows_first_kc_min` allows ([`Blocks::rows_first_kc`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Blocks {
    pub kc: usize,
    pub mc: usize,
    pub nc: usize,
    pub kc_small: usize,
    pub small_out: usize,
    pub rows_first_b: usize,
    /// Where one k-block of all of `b` would outgrow `rows_first_b`, the
    /// shallowest k-block rows first may take instead, to fit it (0: never
    /// shrink; see [`Blocks::rows_first_kc`]).
    pub rows_first_kc_min: usize,
    /// Bytes that can be counted on to stay in L2 (half of it). Beyond
    /// them, on the AVX2 path an output's column panels follow its 64-byte
    /// lines (see `column_shift`), and packed operands have each sweep ask
    /// for the next panels (see `Sweep`) where `ask_ahead`.
    pub in_l2: usize,
    /// Whether sweeps over packed operands beyond `in_l2` ask for the next
    /// panels into L2: only on an Intel core ([`Blocks::rule`]).
    pub ask_ahead: bool,
}

impl Blocks {
    /// The blocks for the cache sizes (bytes), chosen by measurement on a
    /// Zen 3 core (32 KiB L1d, 512 KiB L2, a 32 MiB L3; the book's
    /// performance appendix). The contraction is blocked once a panel of `b`
    /// outgrows 3/16 of L2 (1,536 steps there), into the fewest equal blocks
    /// (see [`Blocks::kc_for`]), since every extra k-block reloads the
    /// output's tiles — unless the output fits in half of L2, where that
    /// reload is cheap: then a `b` panel is kept to half of L1 (256 steps),
    /// as BLIS does. Measured on the lessons' products: L1-sized k-blocks
    /// made the small-output gᵀ·x products (384 × 512 × 128, 512 × 512 × 128)
    /// 14% faster and the large-output ones (1024³, K = 1536) 4–12% slower.
    /// `a` and `b` are blocked only once a block of them outgrows a quarter of L3.
    /// Its sweeps ask ahead; [`Blocks::rule`] stops that on a core not Intel's.
    pub fn from_caches(l1: usize, l2: usize, l3: usize) -> Blocks {
        let kc = (l2 * 3 / 16 / (4 * NR)).clamp(64, 1 << 14);
        let mc = ((l3 / 4 / (4 * kc)) / MR * MR).max(MR);
        let nc = ((l3 / 4 / (4 * kc)) / NR * NR).max(NR);
        let kc_small = (l1 / 2 / (4 * NR)).clamp(64, kc);
        // Rows first where one packed k-block of all of b fits in half of L2, in k-blocks down
        // to 192 steps if it must (measured on an Intel Xeon; see `products`).
        let (small_out, rows_first_b, in_l2) = (l2 / 2, l2 / 2, l2 / 2);
        Blocks { kc, mc, nc, kc_small, small_out, rows_first_b, rows_first_kc_min: 192, in_l2, ask_ahead: true }
    }
    // ANCHOR_END: blocks

    /// Blocks of the given sizes, whatever the output's size, in the
    /// columns-first order; `in_l2` 0, so that the column shift and the
    /// sweeps' prefetches run at every size (the tests' forced blocks rely
    /// on it).
    pub fn fixed(kc: usize, mc: usize, nc: usize) -> Blocks {
        Blocks {
            kc,
            mc,
            nc,
            kc_small: kc,
            small_out: 0,
            rows_first_b: 0,
            rows_first_kc_min: 0,
            in_l2: 0,
            ask_ahead: true,
        }
    }

    /// The k-block for a contraction of `k` into an `m` × `n` output: the
    /// fewest blocks of at most `kc` (`kc_small` for a small output), all of
    /// one size (the last may be shorter by less than one block count).
    pub fn kc_for(&self, k: usize, m: usize, n: usize) -> usize {
        let kc = if 4 * m * n <= self.small_out { self.kc_small } else { self.kc };
        let blocks = k.div_ceil(kc.max(1));
        k.div_ceil(blocks.max(1))
    }

    /// The k-block of a product that could run rows first, against `cols`
    /// packed columns of `b`, whose k-block would otherwise be `kc`: `kc`
    /// where one packed k-block of all of `b` fits in `rows_first_b`; else
    /// the fewest equal blocks that fit, if at least `rows_first_kc_min`
    /// deep (and that is not 0); else none (the product runs columns first).
    pub fn rows_first_kc(&self, k: usize, cols: usize, kc: usize) -> Option<usize> {
        let fits = |kc: usize| 4 * cols * kc <= self.rows_first_b;
        if fits(kc) {
            return Some(kc);
        }
        let most = (self.rows_first_b / (4 * cols)).max(1); // cols > 0 here: zero columns fit above
        let kc = k.div_ceil(k.div_ceil(most).max(1));
        (self.rows_first_kc_min > 0 && kc >= self.rows_first_kc_min && fits(kc)).then_some(kc)
    }

    /// The blocks `FSDP_MATMUL_BLOCKS=KC,MC,NC` sets, if set (`mc`, `nc`
    /// rounded down to whole tiles); an error line if it is not three
    /// positive sizes.
    fn asked() -> std::result::Result<Option<Blocks>, String> {
        let Ok(v) = std::env::var("FSDP_MATMUL_BLOCKS") else { return Ok(None) };
        let sizes: Vec<usize> = v.split(',').filter_map(|v| v.trim().parse().ok()).filter(|&b| b > 0).collect();
        match sizes[..] {
            [kc, mc, nc] if v.split(',').count() == 3 => {
                Ok(Some(Blocks::fixed(kc, (mc / MR * MR).max(MR), (nc / NR * NR).max(NR))))
            }
            _ => Err(format!(
                "FSDP_MATMUL_BLOCKS={v}: give three positive sizes KC,MC,NC (e.g. 256,72,4096), or unset it"
            )),
        }
    }

    /// BLIS's rule, which the AVX2 tiles take on an Intel core: a `kc`-deep
    /// panel of `b` in half of L1, `mc` rows of `a` (`kc` deep) in a quarter
    /// of L2. Measured on one Intel Xeon (AVX-512; a 48 KiB L1d and a 2 MiB
    /// L2, as Linux reported them) through the AVX2 path, against
    /// [`Blocks::from_caches`]' blocks: the small preset's products and 1024³
    /// 4–10% faster (kc 384, mc 96–384; mc 768 lost it again); other Intel
    /// cores (client, hybrid) take it unmeasured. Its AVX-512 tiles, twice as
    /// wide, gained nothing from it, and on a Zen 3 L1-sized k-blocks lost
    /// 4–12% at the large outputs (see `from_caches`): those keep that rule.
    /// Never rows first (the AVX2 tiles take six rows).
    pub fn l1_resident(l1: usize, l2: usize, l3: usize) -> Blocks {
        let kc = (l1 / 2 / (4 * NR)).clamp(64, 1 << 14);
        let mc = ((l2 / 4 / (4 * kc)) / MR * MR).max(MR);
        let nc = ((l3 / 4 / (4 * kc)) / NR * NR).max(NR);
        Blocks { in_l2: l2 / 2, ..Blocks::fixed(kc, mc, nc) }
    }

    /// The rule for `isa`'s tiles on a CPU with these cache sizes (bytes),
    /// from Intel (`intel`) or not: [`Blocks::l1_resident`] for the AVX2
    /// tiles on an Intel core, else [`Blocks::from_caches`]; and only on an
    /// Intel core do the sweeps ask for the next panels (`ask_ahead`). Those
    /// asks paid on the Intel Xeon they were measured on (see `products`'
    /// `after` and `Sweep::run`'s `prefetch_b`) and cost on the two AMD cores
    /// measured: at the tiny preset's products that ask, the rate without
    /// them was 4–10% higher on a Zen 3's AVX2 path (AMD EPYC, family 25,
    /// model 1), 1.4–2.0% on a Zen 4's AVX2 path and 0.5–1.2% on its AVX-512
    /// path (family 25, model 17). The book's performance appendix has the runs.
    /// Other cores not Intel's (a Zen 5) take the rule unmeasured.
    pub fn rule(isa: Isa, intel: bool, [l1, l2, l3]: [usize; 3]) -> Blocks {
        let blocks = match (isa, intel) {
            (Isa::Avx2, true) => Blocks::l1_resident(l1, l2, l3),
            _ => Blocks::from_caches(l1, l2, l3),
        };
        Blocks { ask_ahead: intel, ..blocks }
    }

    /// The blocks of the path in use on this CPU ([`Blocks::for_path`]).
    pub fn for_this_cpu() -> Blocks {
        Blocks::for_path(Isa::in_use())
    }

    /// The blocks `isa`'s tiles take on this CPU: from its cache sizes
    /// (/sys/devices/system/cpu/cpu0/cache: L1d, L2, L3, read once; 32 KiB,
    /// 512 KiB and 8 MiB where they cannot be read), by [`Blocks::rule`]:
    /// [`Blocks::l1_resident`] for the AVX2 tiles on an Intel core, else
    /// [`Blocks::from_caches`] (without the sweeps' asks on a core not Intel's).
    /// `FSDP_MATMUL_BLOCKS=KC,MC,NC` sets the three sizes instead, for every
    /// path and output size, to measure others (the bits are the same): no
    /// `kc_small`, and KC is never made shallower to run rows first. The
    /// thresholds `rows_first_b` and `in_l2`, and `ask_ahead`, stay the rule's, so which
    /// products run rows first follows KC alone, and the column shift and
    /// the sweeps' prefetches apply where they would.
    pub fn for_path(isa: Isa) -> Blocks {
        use std::sync::OnceLock;
        static CPU: OnceLock<(Option<Blocks>, [usize; 3], bool)> = OnceLock::new();
        let (asked, [l1, l2, l3], intel) = *CPU.get_or_init(|| {
            let asked = Blocks::asked().unwrap_or_else(|e| refuse(&e));
            #[cfg(target_arch = "x86_64")]
            // SAFETY: CPUID leaf 0 (the vendor) exists on every x86-64 CPU.
            #[allow(unused_unsafe)]
            let intel = unsafe {
                let v = std::arch::x86_64::__cpuid(0);
                [v.ebx, v.edx, v.ecx]
                    == [u32::from_le_bytes(*b"Genu"), u32::from_le_bytes(*b"ineI"), u32::from_le_bytes(*b"ntel")]
            };
            #[cfg(not(target_arch = "x86_64"))]
            let intel = false;
            let (mut l1, mut l2, mut l3) = (32 << 10, 512 << 10, 8 << 20);
            for i in 0..8 {
                let dir = format!("/sys/devices/system/cpu/cpu0/cache/index{i}");
                let read =
                    |f: &str| std::fs::read_to_string(format!("{dir}/{f}")).unwrap_or_default().trim().to_string();
                let size = read("size");
                let Some(kib) = size.strip_suffix('K').and_then(|v| v.parse::<usize>().ok()) else { continue };
                match read("level").as_str() {
                    "1" if read("type") == "Data" => l1 = kib << 10,
                    "2" => l2 = kib << 10,
                    "3" => l3 = kib << 10,
                    _ => {}
                }
            }
            (asked, [l1, l2, l3], intel)
        });
        let rule = Blocks::rule(isa, intel, [l1, l2, l3]);
        // The knob sets the sizes; the rows-first threshold, the column layout and the prefetches stay
        // the rule's, but KC is never made shallower to run rows first.
        let knob = |asked: Blocks| Blocks {
            rows_first_b: rule.rows_first_b,
            rows_first_kc_min: 0,
            in_l2: rule.in_l2,
            ask_ahead: rule.ask_ahead,
            ..asked
        };
        asked.map_or(rule, knob)
    }
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

/// Every batch item's `a @ b` of bf16 operands, read as they are: the chains
/// before rounding, in f32, in the one bf16 order ([`bf16_dot`]: VDPBF16PS where
/// the CPU has it, else emulated), the same bits on every path.
pub(super) fn products_bf16(a: &Operand, x: &[bf16], b: &Operand, y: &[bf16]) -> Vec<f32> {
    bf16_dot::products_bf16(a, x, b, y, Path::Fastest)
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
                CpuStorage::BF16(narrow(bf16_dot::products_bf16(&a, x, &b, y, self.path)))
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
fn products<T: Copy + 'static>(
    a: &Operand,
    x: &[T],
    b: &Operand,
    y: &[T],
    widen: impl Fn(T) -> f32 + Copy,
    path: Path,
) -> Vec<f32> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    // Every item's output is written below before it is handed out: the shapes must fit.
    assert!(a.batch_offsets.len() == b.batch_offsets.len() && k == b.rows, "matmul operands do not fit");
    let len = a.batch_offsets.len() * m * n;
    if m == 0 || n == 0 || k == 0 {
        return vec![0f32; len]; // an empty sum is 0
    }
    let (isa, blocks) = match path {
        Path::Fastest | Path::Bf16Native => (Isa::in_use(), Blocks::for_this_cpu()),
        Path::On(isa) => (isa, Blocks::for_path(isa)),
        #[cfg(test)]
        Path::Forced(isa, blocks) => (isa, blocks),
    };
    let tiles = tiles(isa);
    let (mp, np) = (m.div_ceil(MR), n.div_ceil(NR));
    let (kc, mcp, ncp) = (blocks.kc_for(k, m, n), (blocks.mc / MR).max(1), (blocks.nc / NR).max(1));
    // Rows first where one packed k-block of all of b takes at most `rows_first_b` bytes (half
    // of L2; the tiny preset's products with N = 128, say): each pair of row panels of a is packed
    // into the start of `ap` (48 bytes per step of k: in L1 at the lessons' shapes) just before the tiles
    // sweep it across every column panel, instead of all of a into `ap` (as much memory as a,
    // written to L2 and read back for every column panel). At M = K = 512, N = 128 that packing
    // was a sixth of the product's time, and rows first made those products 10-11% faster on
    // AVX-512 (an Intel Xeon, 2 MiB L2). Only where the tiles take twelve rows (AVX-512: with six,
    // b is swept twice as often, and the AVX2 path's tiny products ran 3-8% slower) and a's lines
    // run along k (x, g; a transposed gᵀ, packed two panels at a time, lost 2-3%).
    // Where all of b outgrows that, rows first still runs, in k-blocks shallow enough that one of
    // all of b fits (down to 192 steps): on an Intel Xeon (2 MiB L2), AVX-512, 1024³ (k-blocks of
    // 256) ran 5% faster, the small preset's K = 1152 and 1536 into N = 384 (576, 512) 2-3%, and
    // 1024 × 384 × 1152 (192) 1-5% (two sets of runs); 1024 × 384 × 1536 (128) gained nothing.
    // Each pair of a's row panels is then read from L1, where columns first streams it from L2 or L3
    // beside b's panels.
    let twelve_rows_along_k = tiles.avx512.is_some() && a.col_stride == 1 && a.row_stride != 1;
    let rows_first_kc = if twelve_rows_along_k { blocks.rows_first_kc(k, np * NR, kc) } else { None };
    let (rows_first, kc) = (rows_first_kc.is_some(), rows_first_kc.unwrap_or(kc));
    #[cfg(test)]
    ROWS_FIRST_RUN.with(|n| n.set(n.get() + rows_first as usize));
    // Nothing is zeroed first: the first k-block's tiles store every element
    // of the output without reading it, and the packing writes every element
    // of its panels (the rows and columns past an edge as 0). At the lessons'
    // shapes zeroing the three buffers cost more than packing them.
    let mut out: Vec<f32> = Vec::with_capacity(len);
    // On the AVX2 path the column panels follow a large output's lines.
    let shift = column_shift(out.as_ptr(), n, isa == Isa::Avx2 && 4 * m * n > blocks.in_l2);
    // Whether the rule asks ahead (`Blocks::ask_ahead`) and a and b, packed, outgrow what stays
    // in L2: then each sweep (columns first) asks for the next panels.
    let ahead = blocks.ask_ahead && 4 * (mp * MR + np * NR) * k > blocks.in_l2;
    // Both operands packed whole (rows first: b whole, a two row panels at a time), as
    // [k-block][panel][k][row or column]: the panel of k-block k0 that the tile reads is
    // contiguous, kb × MR or kb × NR. Each starts on a 64-byte line (malloc gives 16): a panel
    // of b is 16 floats wide, so every load of a 16-lane row of it then reads one line, not two.
    let a_len = if rows_first { 2 * MR * kc } else { mp * MR * k };
    let (mut ap, mut bp) = (Vec::<f32>::with_capacity(a_len + 15), Vec::<f32>::with_capacity(np * NR * k + 15));
    let (ap, bp) = (aligned(&mut ap, a_len), aligned(&mut bp, np * NR * k));
    let k_blocks = || (0..k).step_by(kc).map(move |k0| (k0, kc.min(k - k0)));
    let at_a = |k0: usize, kb: usize, p: usize| k0 * mp * MR + p * MR * kb;
    let at_b = |k0: usize, kb: usize, q: usize| k0 * np * NR + q * NR * kb;
    let mut edge = [0f32; MR * 2 * NR];
    let items = a.batch_offsets.iter().zip(&b.batch_offsets);
    for ((&ao, &bo), out) in items.zip(out.spare_capacity_mut()[..len].chunks_exact_mut(m * n)) {
        // a's rows as panels of MR, b's columns as panels of NR; k runs along a's columns and b's rows.
        let a_view = |k0: usize, p: usize, rows: usize| View {
            at: ao + k0 * a.col_stride + p * MR * a.row_stride,
            len: rows,
            stride: a.row_stride,
            k_stride: a.col_stride,
        };
        for (k0, kb) in k_blocks() {
            if !rows_first {
                pack::<_, MR>(isa, &a_view(k0, 0, m), x, kb, widen, &mut ap[at_a(k0, kb, 0)..][..mp * MR * kb]);
            }
            let b_view = |c0: usize, len: usize| View {
                at: bo + k0 * b.row_stride + c0 * b.col_stride,
                len,
                stride: b.col_stride,
                k_stride: b.row_stride,
            };
            let panels = &mut bp[at_b(k0, kb, 0)..][..np * NR * kb];
            if shift == 0 {
                pack::<_, NR>(isa, &b_view(0, n), y, kb, widen, panels);
            } else {
                // Panel 0: the NR − shift columns before the output's first line boundary, then the
                // last `shift` columns; panels 1.. the columns between, NR at a time (`column_shift`).
                let (head, rest) = panels.split_at_mut(NR * kb);
                pack::<_, NR>(isa, &b_view(0, NR - shift), y, kb, widen, head);
                let tail = b_view(n - shift, shift);
                for (kk, lanes) in head.chunks_exact_mut(NR).enumerate() {
                    for (l, lane) in lanes[NR - shift..].iter_mut().enumerate() {
                        lane.write(widen(y[tail.at + l * tail.stride + kk * tail.k_stride]));
                    }
                }
                pack::<_, NR>(isa, &b_view(NR - shift, n - NR), y, kb, widen, rest);
            }
        }
        // SAFETY: `pack` (and, for a split panel 0, the loop over its last columns) wrote every
        // element of b (all k-blocks, every panel).
        let bp = unsafe { assume_init(bp) };
        let bpanel = |k0: usize, kb: usize| move |q: usize| &bp[at_b(k0, kb, q)..][..NR * kb];
        for (k0, kb) in k_blocks() {
            let load = k0 > 0; // continue each element's chain where the block before left it
            if rows_first {
                for p in (0..mp).step_by(2) {
                    let rows = (2 * MR).min(m - p * MR);
                    let panels = rows.div_ceil(MR);
                    pack::<_, MR>(isa, &a_view(k0, p, rows), x, kb, widen, &mut ap[..panels * MR * kb]);
                    // SAFETY: `pack` wrote every element of this pair's (or one's) panels.
                    let ap = unsafe { assume_init(&ap[..panels * MR * kb]) };
                    let apanel = |pp: usize| &ap[(pp - p) * MR * kb..][..MR * kb];
                    let sweep = Sweep {
                        kb,
                        load,
                        prefetch_chains: false,
                        prefetch_panels: false,
                        m,
                        n,
                        shift,
                        ps: p..p + panels,
                        qs: 0..np,
                    };
                    sweep.run(&tiles, apanel, bpanel(k0, kb), out, &mut edge, &[]);
                }
                continue;
            }
            // SAFETY: `pack` wrote every element of a (all k-blocks, every panel).
            let ap = unsafe { assume_init(ap) };
            // The block of a after row panel p0's, in the loops' order (this k-block's next, the
            // first again for the next column block, the next k-block's first), for the sweep to
            // ask for, on the AVX2 path: the small preset's products of K = 1152 and 1536 into
            // N = 384 ran 2.7-2.8% faster with it (an Intel Xeon, 2 MiB L2), where a and b
            // outgrow L2 and each block of a is swept 24 times; the AVX-512 tiles did not gain.
            let a_block = |k0: usize, kb: usize, p0: usize| &ap[at_a(k0, kb, p0)..][..mcp.min(mp - p0) * MR * kb];
            let after = |q0: usize, p0: usize| {
                if isa != Isa::Avx2 || !ahead {
                    &[][..]
                } else if p0 + mcp < mp {
                    a_block(k0, kb, p0 + mcp)
                } else if q0 + ncp < np {
                    a_block(k0, kb, 0)
                } else {
                    k_blocks().find(|&(k1, _)| k1 > k0).map_or(&[][..], |(k1, kb1)| a_block(k1, kb1, 0))
                }
            };
            for q0 in (0..np).step_by(ncp) {
                for p0 in (0..mp).step_by(mcp) {
                    let apanel = |p: usize| &ap[at_a(k0, kb, p)..][..MR * kb];
                    let (ps, qs) = (p0..mp.min(p0 + mcp), q0..np.min(q0 + ncp));
                    let sweep = Sweep { kb, load, prefetch_chains: true, prefetch_panels: ahead, m, n, shift, ps, qs };
                    sweep.run(&tiles, apanel, bpanel(k0, kb), out, &mut edge, after(q0, p0));
                }
            }
        }
    }
    // SAFETY: the first k-block's tiles (k > 0 here) stored every element of every item's output.
    unsafe { out.set_len(len) };
    out
}

/// One k-block's tiles over a block of the output: row panels `ps` of an
/// `m` × `n` output against column panels `qs`, `kb` steps of k, each chain
/// continued from the output (`load`) or started.
struct Sweep {
    kb: usize,
    load: bool,
    /// Prefetch the chains so far of the tiles two row panels below (columns first only: rows
    /// first reaches them after a whole sweep of b, by when L1 would have lost them).
    prefetch_chains: bool,
    /// Ask for the next column panels of b into L2 (columns first, only where the rule asks,
    /// `Blocks::ask_ahead`, and a and b outgrow half of L2: on an Intel Xeon's 2 MiB L2 most of
    /// the tiny preset's products fit in half of it, where asking would only add instructions;
    /// lesson 01 at one rank within 1% either way).
    prefetch_panels: bool,
    m: usize,
    n: usize,
    /// The column layout ([`column_shift`]): 0, or panel 0 split between the output's first
    /// NR − shift columns and its last `shift`, panel q > 0 from column q·NR − shift.
    shift: usize,
    ps: std::ops::Range<usize>,
    qs: std::ops::Range<usize>,
}

impl Sweep {
    /// Column panels outer, row panels inner, the widest tiles that fit
    /// (`apanel(p)`, `bpanel(q)`: the packed panels, `kb` deep); edge tiles
    /// through `edge`. `next_a`: the packed block of `a` the next sweep
    /// reads, to ask for into L2 as this one runs (empty: nothing to ask for).
    fn run<'a, 'b>(
        &self,
        tiles: &Tiles,
        apanel: impl Fn(usize) -> &'a [f32],
        bpanel: impl Fn(usize) -> &'b [f32],
        out: &mut [MaybeUninit<f32>],
        edge: &mut [f32; MR * 2 * NR],
        next_a: &[f32],
    ) {
        let Sweep { kb, load, prefetch_chains, prefetch_panels, m, n, shift, .. } = *self;
        #[cfg(test)]
        ASKED_AHEAD.with(|n| n.set(n.get() + (prefetch_panels || !next_a.is_empty()) as usize));
        let (ps, qs) = (self.ps.clone(), self.qs.clone());
        let col0 = |q: usize| (q * NR).saturating_sub(shift);
        let corner = |p: usize, q: usize| (p * MR) * n + col0(q);
        // Panel q's columns, as (lane, column from its corner, count): two pieces for a split panel 0.
        let pieces = |q: usize| match (shift, q) {
            (0, _) | (_, 1..) => [(0, 0, NR.min(n - col0(q))), (0, 0, 0)],
            _ => [(0, 0, NR - shift), (NR - shift, n - shift, shift)],
        };
        let full = |q: usize| pieces(q)[0].2 == NR;
        let rows = |p: usize| MR.min(m - p * MR);
        // The chains so far of the tiles two row panels below `corner` (row panel p), the line
        // holding each of their 12 rows' first element, on their way to L1 while the tile at
        // `corner` computes (a hint: no value changes).
        let prefetch_next = |out: &[MaybeUninit<f32>], p: usize, q: usize| {
            if load && prefetch_chains {
                let below = (2 * MR).min(m.saturating_sub((p + 2) * MR));
                (0..below).for_each(|r| prefetch(out.as_ptr().wrapping_add(corner(p + 2, q) + r * n)));
            }
        };
        // The next column panels of b (`next`: from q + 1, or q + 2 after a 32-wide tile), their
        // lines on their way to L2 a share at a time, as the tiles of row panels `row_panels` (of
        // `ps`) compute: the whole of them by the end of this column's sweep. Without it the
        // sweep's first tiles read them from L3, where packing left them once a and b outgrew L2
        // (an Intel Xeon, 2 MiB L2, AVX2: 1024³ and 1024 × 768 × 1024 ran about 4% faster with it).
        let prefetch_b = |next: std::ops::Range<usize>, row_panels: std::ops::Range<usize>| {
            if !prefetch_panels {
                return; // a and b stay in L2 (or, rows first, all of b does)
            }
            for q in next.start..next.end.min(qs.end) {
                shares_to_l2(bpanel(q), row_panels.start - ps.start..row_panels.end - ps.start, ps.len());
            }
        };
        // The block of a the next sweep reads (`next_a`: the AVX2 path's 6 × 16 tiles alone, one
        // call per tile), likewise, a share per tile of this sweep's ps.len() × qs.len().
        debug_assert!(next_a.is_empty() || tiles.avx512.is_none(), "a's share counts one 6 × 16 tile per unit");
        let mut a_done = 0;
        let mut prefetch_a = || {
            shares_to_l2(next_a, a_done..a_done + 1, ps.len() * qs.len());
            a_done += 1;
        };
        let mut q = qs.start;
        while q < qs.end {
            let mut p = ps.start;
            // Two full column panels at once where the CPU has AVX-512: 12 × 32 tiles (two row panels
            // too), the same chains, about half the loads per FMA (14 per 24, not 13 per 12); a
            // 6 × 32 tile for a row panel they leave (one, or an edge: m = 128 leaves a full panel
            // and one of two rows), not the 6 × 16 AVX2 tile twice.
            if let Some((_, quad, wide)) = tiles.avx512.filter(|_| q + 1 < qs.end && full(q) && full(q + 1)) {
                let bpanels = [bpanel(q), bpanel(q + 1)];
                while p < ps.end {
                    prefetch_next(out, p, q);
                    prefetch_next(out, p, q + 1);
                    if p + 1 < ps.end && m >= (p + 2) * MR {
                        prefetch_b(q + 2..q + 4, p..p + 2);
                        quad(kb, [apanel(p), apanel(p + 1)], bpanels, &mut out[corner(p, q)..], n, load);
                        p += 2;
                    } else {
                        prefetch_b(q + 2..q + 4, p..p + 1);
                        let run = |c: &mut [MaybeUninit<f32>], ldc| wide(kb, apanel(p), bpanels, c, ldc, load);
                        let both = [(0, 0, 2 * NR), (0, 0, 0)];
                        in_place_or_edge(out, corner(p, q), n, rows(p), both, 2 * NR, load, edge, run);
                        p += 1;
                    }
                }
                q += 2;
                continue;
            }
            // One column panel (a lone or an edge one): two full row panels at once where the CPU has
            // AVX-512 (12 × 16, the same chains, twice the accumulators in flight), else 6 × 16.
            while p < ps.end {
                prefetch_next(out, p, q);
                let full_pair = p + 1 < ps.end && full(q) && m >= (p + 2) * MR;
                match tiles.avx512.filter(|_| full_pair) {
                    Some((pair, _, _)) => {
                        prefetch_b(q + 1..q + 2, p..p + 2);
                        pair(kb, apanel(p), apanel(p + 1), bpanel(q), &mut out[corner(p, q)..], n, load);
                        p += 2;
                    }
                    None => {
                        prefetch_b(q + 1..q + 2, p..p + 1);
                        prefetch_a();
                        let run =
                            |c: &mut [MaybeUninit<f32>], ldc| (tiles.tile)(kb, apanel(p), bpanel(q), c, ldc, load);
                        in_place_or_edge(out, corner(p, q), n, rows(p), pieces(q), NR, load, edge, run);
                        p += 1;
                    }
                }
            }
            q += 1;
        }
    }
}

/// Asks for shares `which` of `of` equal shares of the lines `s` touches
/// (counted from the line holding its first element) into L2: a hint.
fn shares_to_l2(s: &[f32], which: std::ops::Range<usize>, of: usize) {
    if s.is_empty() {
        return; // nothing to ask for (the AVX2 path's tiles call it once each): no division either
    }
    let skew = s.as_ptr() as usize % 64 / 4;
    let lines = (skew + s.len()).div_ceil(per_line::<f32>());
    let share = lines.div_ceil(of.max(1));
    let first = s.as_ptr().wrapping_sub(skew);
    for l in which.start * share..(which.end * share).min(lines) {
        prefetch_l2(first.wrapping_add(l * per_line::<f32>()));
    }
}

/// One operand as the packing reads it: element (i, kk) of the panels'
/// dimension `i` and the contraction `kk` is at `at + i·stride + kk·k_stride`.
struct View {
    at: usize,
    len: usize,
    stride: usize,
    k_stride: usize,
}

/// Packs `kb` steps of the contraction of every panel of `W` along `v`'s
/// `len` (rows of `a`, columns of `b`) into `panels`, as [panel][k][W],
/// widened to f32; past the edge, 0 (it feeds only accumulators that are
/// never stored). It reads along whichever dimension is contiguous, so a
/// transposed view costs no more than a plain one.
///
/// On the AVX2 and AVX-512 paths the same copies are compiled for AVX2 (the
/// build's baseline is SSE2): wider loads and stores, the same values
/// (lesson 01 at one rank 1.4–3% faster on a Zen 3). There, f32 lines that
/// run along k take [`pack_lines_avx2`]'s transposes instead; an f32
/// operand is never widened (`widen` is the identity for f32).
fn pack<T: Copy + 'static, const W: usize>(
    isa: Isa,
    v: &View,
    x: &[T],
    kb: usize,
    widen: impl Fn(T) -> f32,
    panels: &mut [MaybeUninit<f32>],
) {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Portable {
        // f32 lines along k (a row-major a: x, g, P, q; b = wᵀ or kᵀ): 8 × 8 blocks transposed in registers.
        if v.stride != 1 && v.k_stride == 1 {
            if let Some(x) = as_type::<T, f32>(x) {
                // SAFETY: the AVX2 and AVX-512 paths run only where the CPU has AVX2 (`Isa::available`).
                return unsafe { pack_lines_avx2::<f32, W>(v, x, kb, panels) };
            }
            if let Some(x) = as_type::<T, bf16>(x) {
                // SAFETY: as above.
                return unsafe { pack_lines_avx2::<bf16, W>(v, x, kb, panels) };
            }
        }
        #[target_feature(enable = "avx2")]
        fn on_avx2<T: Copy, const W: usize>(
            v: &View,
            x: &[T],
            kb: usize,
            widen: impl Fn(T) -> f32,
            panels: &mut [MaybeUninit<f32>],
        ) {
            pack_each::<T, W>(v, x, kb, widen, panels)
        }
        // SAFETY: the AVX2 and AVX-512 paths run only where the CPU has AVX2 (`Isa::available`).
        return unsafe { on_avx2::<T, W>(v, x, kb, widen, panels) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    pack_each::<T, W>(v, x, kb, widen, panels)
}

/// `x` as values of `U`, when `T` is `U`.
#[cfg(target_arch = "x86_64")]
fn as_type<T: 'static, U: 'static>(x: &[T]) -> Option<&[U]> {
    // SAFETY: T is U, so the slice is one of U.
    (std::any::TypeId::of::<T>() == std::any::TypeId::of::<U>())
        .then(|| unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<U>(), x.len()) })
}

/// The values [`pack_lines_avx2`] transposes, eight at a time as f32 lanes:
/// f32 as they are, bf16 widened exactly (`from_bf16`'s bits).
#[cfg(target_arch = "x86_64")]
trait Lines8: Copy + 'static {
    /// Eight values from `p` as f32 lanes.
    ///
    /// # Safety
    /// `p..p + 8` must be readable, and the CPU must have AVX2.
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
    fn wide(self) -> f32;
}

#[cfg(target_arch = "x86_64")]
impl Lines8 for f32 {
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller's.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
    fn wide(self) -> f32 {
        self
    }
}

#[cfg(target_arch = "x86_64")]
impl Lines8 for bf16 {
    /// Each bf16 the high half of its f32, a NaN made quiet as `from_bf16` makes it.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load8(p: *const bf16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's: 16 bytes at p.
        let w = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(unsafe { _mm_loadu_si128(p.cast()) }));
        let nan =
            _mm256_cmpgt_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x7FFF_FFFF)), _mm256_set1_epi32(0x7F80_0000));
        _mm256_castsi256_ps(_mm256_or_si256(w, _mm256_and_si256(nan, _mm256_set1_epi32(0x0040_0000))))
    }
    fn wide(self) -> f32 {
        from_bf16(self)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn pack_lines_avx2<T: Lines8, const W: usize>(v: &View, x: &[T], kb: usize, panels: &mut [MaybeUninit<f32>]) {
    use std::arch::x86_64::*;
    const { assert!(W == MR || W.is_multiple_of(8), "a panel of six lines or of groups of eight") };
    let full = v.len / W; // panels without an edge
    let k8 = kb / 8 * 8;
    for (p, panel) in panels.chunks_exact_mut(W * kb).take(full).enumerate() {
        let base = v.at + p * W * v.stride;
        // a's panels (x, g, q, P: an op wrote them a while ago) ask for the next panel's lines while
        // this one is packed, when this call packs it too (rows first packs a pair at a time, and
        // the next pair only after the tiles sweep b); b's along k (wᵀ, kᵀ) do not: in the benchmark,
        // with the operands in L2, asking cost them up to 5%. See `pack_each`.
        if W == MR && p + 1 < full {
            for w in 0..W {
                let next = x.as_ptr().wrapping_add(base + (W + w) * v.stride);
                (0..kb).step_by(per_line::<T>()).for_each(|kk| prefetch(next.wrapping_add(kk)));
            }
        }
        let lines: [&[T]; W] = std::array::from_fn(|w| &x[base + w * v.stride..][..kb]);
        let dst = panel.as_mut_ptr().cast::<f32>();
        // SAFETY: every load reads lines[w][kk..kk + 8] with kk + 8 ≤ kb, a line's length; every
        // store writes dst[(kk + j)·W + g ..][..n] with (kk + j) < kb and g + n ≤ W, inside the panel.
        unsafe {
            for g in (0..W).step_by(8) {
                let n = (W - g).min(8); // lines in this group: 8, or the 6 of an MR panel
                for kk in (0..k8).step_by(8) {
                    let mut r = [_mm256_setzero_ps(); 8];
                    for (ri, line) in r.iter_mut().zip(&lines[g..g + n]) {
                        *ri = T::load8(line.as_ptr().add(kk));
                    }
                    // r[i] = line g+i at k = kk..kk+8  →  t[j] = every line's value at k = kk+j
                    for (j, t) in super::common::transpose8(r).into_iter().enumerate() {
                        let d = dst.add((kk + j) * W + g);
                        if n == 8 {
                            _mm256_storeu_ps(d, t);
                        } else {
                            // the 6 lines of an MR panel: 4 values, then 2
                            _mm_storeu_ps(d, _mm256_castps256_ps128(t));
                            _mm_storel_epi64(d.add(4).cast(), _mm_castps_si128(_mm256_extractf128_ps::<1>(t)));
                        }
                    }
                }
            }
            for kk in k8..kb {
                for (w, line) in lines.iter().enumerate() {
                    dst.add(kk * W + w).write(line[kk].wide());
                }
            }
        }
    }
    if full * W < v.len {
        let edge = View { at: v.at + full * W * v.stride, len: v.len - full * W, ..*v };
        pack_each::<T, W>(&edge, x, kb, T::wide, &mut panels[full * W * kb..]);
    }
}

#[inline(always)]
fn pack_each<T: Copy, const W: usize>(
    v: &View,
    x: &[T],
    kb: usize,
    widen: impl Fn(T) -> f32,
    panels: &mut [MaybeUninit<f32>],
) {
    let full = v.len / W; // panels without an edge
    if v.stride == 1 {
        // Each step of k is one contiguous run across the panels, scattered W at a time, for a group
        // of GROUP panels at once: every k step's stores go to one place per panel of the group, W·kb
        // floats apart, and at a power-of-two kb those places fall in few sets of L1 (which repeat every
        // 4 KiB; at kb = 256 and W = 6, panels lie 6 KiB apart: two sets). All the panels at once (64 for
        // a 384-row gᵀ) thrashed those sets: the tiny gᵀ·x products ran at 0.6–0.76 of their rate on
        // AVX-512 (a Zen 5). Eight panels put four stores in a set, well within its 8–12 ways.
        //
        // Each step also asks for the run AHEAD steps of k on (gᵀ as a; x, w or v as b): packing reads
        // operands where an op before left them, often in L3 or memory, and there the loads
        // waited (on an Intel Xeon, 2 MiB L2, the tiny preset's products ran 16-21% slower with
        // 64 operand pairs cycled through 29 MiB than with one pair; asking ahead made the small
        // preset's c_attn and c_fc gᵀ·x 7-9% faster on AVX-512 even in the benchmark, which
        // repeats one pair). A run's last, partial line is not asked for: it is soon read anyway.
        const GROUP: usize = 8;
        const AHEAD: usize = 8;
        for g0 in (0..v.len.div_ceil(W)).step_by(GROUP) {
            let lines = (GROUP * W).min(v.len - g0 * W);
            for kk in 0..kb {
                let ahead = v.at + g0 * W + (kk + AHEAD) * v.k_stride;
                (0..lines).step_by(per_line::<T>()).for_each(|l| prefetch(x.as_ptr().wrapping_add(ahead + l)));
                let run = &x[v.at + g0 * W + kk * v.k_stride..][..lines];
                let src = run.chunks_exact(W);
                let edge = src.remainder();
                let mut dst = panels[g0 * W * kb + kk * W..].chunks_mut(W * kb);
                for (s, d) in src.zip(&mut dst) {
                    let d: &mut [MaybeUninit<f32>; W] = (&mut d[..W]).try_into().unwrap();
                    for w in 0..W {
                        d[w].write(widen(s[w])); // fixed length: no memcpy call
                    }
                }
                if let Some(d) = dst.next().filter(|_| !edge.is_empty()) {
                    for (w, d) in d[..W].iter_mut().enumerate() {
                        d.write(edge.get(w).map_or(0.0, |&s| widen(s)));
                    }
                }
            }
        }
    } else if v.k_stride == 1 {
        // Each panel's W lines run along k: read side by side, the panel written in order.
        for (p, panel) in panels.chunks_exact_mut(W * kb).enumerate() {
            let base = v.at + p * W * v.stride;
            if p < full {
                let lines: [&[T]; W] = std::array::from_fn(|w| &x[base + w * v.stride..][..kb]);
                for (kk, dst) in panel.chunks_exact_mut(W).enumerate() {
                    for w in 0..W {
                        dst[w].write(widen(lines[w][kk]));
                    }
                }
            } else {
                let lines = v.len - p * W;
                for (kk, dst) in panel.chunks_exact_mut(W).enumerate() {
                    (0..W).for_each(|w| {
                        _ = dst[w].write(if w < lines { widen(x[base + w * v.stride + kk]) } else { 0.0 })
                    });
                }
            }
        }
    } else {
        for (p, panel) in panels.chunks_exact_mut(W * kb).enumerate() {
            for (kk, dst) in panel.chunks_exact_mut(W).enumerate() {
                (0..W).for_each(|w| {
                    let i = p * W + w;
                    _ = dst[w].write(if i < v.len { widen(x[v.at + i * v.stride + kk * v.k_stride]) } else { 0.0 })
                });
            }
        }
    }
}

/// Runs a tile `width` columns wide and `MR` rows high (`run(c, ldc)`) at
/// `corner` of `out` (row stride `n`), of which `rows` rows and the columns
/// `pieces` name — (lane of the tile, column from `corner`, count) — lie
/// inside the output: in place when that is all of the tile, else through
/// `scratch`, the valid part copied in (with `load`: the chains so far) and
/// back out.
#[allow(clippy::too_many_arguments)]
fn in_place_or_edge(
    out: &mut [MaybeUninit<f32>],
    corner: usize,
    n: usize,
    rows: usize,
    pieces: [(usize, usize, usize); 2],
    width: usize,
    load: bool,
    scratch: &mut [f32; MR * 2 * NR],
    run: impl FnOnce(&mut [MaybeUninit<f32>], usize),
) {
    if rows == MR && pieces[0] == (0, 0, width) {
        return run(&mut out[corner..], n);
    }
    // SAFETY: the tile writes f32 values only.
    let e = unsafe { as_uninit(&mut scratch[..MR * width]) };
    for r in 0..if load { rows } else { 0 } {
        for (lane, col, cols) in pieces {
            e[r * width + lane..][..cols].copy_from_slice(&out[corner + r * n + col..][..cols]);
        }
    }
    run(e, width);
    for r in 0..rows {
        for (lane, col, cols) in pieces {
            out[corner + r * n + col..][..cols].copy_from_slice(&e[r * width + lane..][..cols]);
        }
    }
}

/// How many columns the column panels are pulled back by, so that the tiles'
/// rows in the output start on 64-byte lines: `out`'s offset within its
/// line, in f32s, where asked (`align`) and every row starts at the same
/// offset (`n` a multiple of NR) — else 0. glibc's malloc puts a buffer 16,
/// 32 or 48 bytes past a line as often as on one, and a 16-wide row of a
/// tile then spans two lines: at 16 or 48 bytes off, one of its two 32-byte
/// loads and stores crosses a line, and the prefetch of the line holding
/// its first element fetches only part of it. With the shift, panel 0 takes
/// the NR − shift columns before the first line boundary and the last
/// `shift` columns (through the edge scratch), and panel q > 0 the NR
/// columns from q·NR − shift, each row's on one line. Which tile computes
/// an element changes nothing in its chain.
///
/// Measured on an Intel Xeon (2 MiB L2), interleaved: through the AVX2
/// tiles, 1024³ ran at 82–86 GFLOP/s on an output off its lines and 89–92
/// on one, and the shift takes the former to the latter (the small preset's
/// products, outputs of 1.5–6 MB: 3–4%). Asked only there: for an output in
/// half of L2 (the tiny preset's) the split panel's trips through the
/// scratch cost more than they save (lesson 01 at one rank 2% slower), and
/// the AVX-512 tiles (two lines per row) gained nothing at 1024³ and lost
/// their 32-wide tiles beside the split panel.
fn column_shift(out: *const f32, n: usize, align: bool) -> usize {
    if !n.is_multiple_of(NR) {
        return 0;
    }
    #[cfg(test)]
    if let Some(shift) = FORCED_SHIFT.with(|s| s.get()) {
        return shift;
    }
    if align { out as usize % 64 / 4 } else { 0 }
}

/// `len` elements of `v`'s spare capacity (at least `len` + 15), starting on a 64-byte line.
fn aligned(v: &mut Vec<f32>, len: usize) -> &mut [MaybeUninit<f32>] {
    let skip = v.as_ptr().align_offset(64).min(15);
    &mut v.spare_capacity_mut()[skip..][..len]
}

/// A buffer every element of which has been written, as f32.
///
/// # Safety
/// Every element of `s` must have been initialised.
unsafe fn assume_init(s: &[MaybeUninit<f32>]) -> &[f32] {
    // SAFETY: MaybeUninit<f32> has f32's layout; the caller vouches for the values.
    unsafe { &*(s as *const [MaybeUninit<f32>] as *const [f32]) }
}

/// An initialised buffer, viewed as one that may be written.
///
/// # Safety
/// Only initialised values may be written through it (it stays an `[f32]`).
unsafe fn as_uninit(s: &mut [f32]) -> &mut [MaybeUninit<f32>] {
    // SAFETY: same layout; the caller writes only f32 values.
    unsafe { &mut *(s as *mut [f32] as *mut [MaybeUninit<f32>]) }
}

/// One tile: `k` steps of the chains of its MR × NR elements, whose
/// accumulators start from `c` (row stride `ldc`) when `load`, from 0
/// otherwise, and end in `c`.
type TileFn = fn(usize, &[f32], &[f32], &mut [MaybeUninit<f32>], usize, bool);
/// Two row panels against one column panel: the two tiles one above the other in `c`.
type PairFn = fn(usize, &[f32], &[f32], &[f32], &mut [MaybeUninit<f32>], usize, bool);
/// Two row panels against two column panels: the four tiles side by side and one above the other in `c`.
type QuadFn = fn(usize, [&[f32]; 2], [&[f32]; 2], &mut [MaybeUninit<f32>], usize, bool);
/// One row panel against two column panels: the two tiles side by side in `c`.
type WideFn = fn(usize, &[f32], [&[f32]; 2], &mut [MaybeUninit<f32>], usize, bool);

/// The register tiles of one path: 6 × 16 on every path, and where the CPU
/// has AVX-512 12 × 16 (pair), 12 × 32 (quad) and 6 × 32 (wide).
struct Tiles {
    tile: TileFn,
    avx512: Option<(PairFn, QuadFn, WideFn)>,
}

/// The tiles of `isa`: the same bits from each, only faster.
fn tiles(isa: Isa) -> Tiles {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => Tiles { tile: tile_avx2, avx512: Some((pair_avx512, quad_avx512, wide_avx512)) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => Tiles { tile: tile_avx2, avx512: None },
        _ => Tiles { tile: tile_portable, avx512: None },
    }
}

// ANCHOR: tile
/// The register tile, portably: `acc = fma(a, b, acc)` for k in order,
/// `acc` starting from the output's values when `load` (the chain so far).
fn tile_portable(k: usize, ap: &[f32], bp: &[f32], c: &mut [MaybeUninit<f32>], ldc: usize, load: bool) {
    let mut acc = [0f32; MR * NR];
    if load {
        // SAFETY: with `load`, the k-block before stored this tile.
        (0..MR * NR).for_each(|e| acc[e] = unsafe { c[e / NR * ldc + e % NR].assume_init() });
    }
    for (a, b) in ap.chunks_exact(MR).zip(bp.chunks_exact(NR)).take(k) {
        for r in 0..MR {
            for col in 0..NR {
                acc[r * NR + col] = a[r].mul_add(b[col], acc[r * NR + col]);
            }
        }
    }
    (0..MR * NR).for_each(|e| _ = c[e / NR * ldc + e % NR].write(acc[e]));
}
// ANCHOR_END: tile

#[cfg(target_arch = "x86_64")]
fn tile_avx2(k: usize, ap: &[f32], bp: &[f32], c: &mut [MaybeUninit<f32>], ldc: usize, load: bool) {
    assert!(ap.len() >= k * MR && bp.len() >= k * NR && c.len() >= (MR - 1) * ldc + NR);
    // SAFETY: chosen only where the CPU has AVX2 and FMA; the loads stay
    // within the panels and `c` (checked above), the stores within `c`; `c`
    // is read only with `load`, when the k-block before stored it.
    unsafe { tile_avx2_inner(k, ap.as_ptr(), bp.as_ptr(), c.as_mut_ptr().cast(), ldc, load) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2_inner(k: usize, ap: *const f32, bp: *const f32, c: *mut f32, ldc: usize, load: bool) {
    use std::arch::x86_64::*;
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); 2]; MR];
        if load {
            for (r, a) in acc.iter_mut().enumerate() {
                *a = [_mm256_loadu_ps(c.add(r * ldc)), _mm256_loadu_ps(c.add(r * ldc + 8))];
            }
        }
        for p in 0..k {
            let b0 = _mm256_loadu_ps(bp.add(p * NR));
            let b1 = _mm256_loadu_ps(bp.add(p * NR + 8));
            for (r, a) in acc.iter_mut().enumerate() {
                let x = _mm256_broadcast_ss(&*ap.add(p * MR + r));
                a[0] = _mm256_fmadd_ps(x, b0, a[0]);
                a[1] = _mm256_fmadd_ps(x, b1, a[1]);
            }
        }
        for (r, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(c.add(r * ldc), a[0]);
            _mm256_storeu_ps(c.add(r * ldc + 8), a[1]);
        }
    }
}

// How many 12 × 16 pairs, 12 × 32 quads and 6 × 32 wides this thread has
// run: for the tests, which would pass on the narrower tiles alone (the same bits).
#[cfg(test)]
thread_local! {
    static WIDE_TILES_RUN: std::cell::Cell<(usize, usize, usize)> = const { std::cell::Cell::new((0, 0, 0)) };
    // How many products ran rows first: likewise.
    static ROWS_FIRST_RUN: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    // How many sweeps asked for the next panels of b or a (`Blocks::ask_ahead`): likewise.
    static ASKED_AHEAD: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    // A column shift the tests set in place of the output's own (`column_shift`).
    static FORCED_SHIFT: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

#[cfg(target_arch = "x86_64")]
fn pair_avx512(k: usize, ap0: &[f32], ap1: &[f32], bp: &[f32], c: &mut [MaybeUninit<f32>], ldc: usize, load: bool) {
    assert!(ap0.len() >= k * MR && ap1.len() >= k * MR && bp.len() >= k * NR && c.len() >= (2 * MR - 1) * ldc + NR);
    #[cfg(test)]
    WIDE_TILES_RUN.with(|n| n.set((n.get().0 + 1, n.get().1, n.get().2)));
    // SAFETY: chosen only where the CPU has AVX-512F; loads stay within the
    // panels and `c` (checked above), stores within `c`; `c` is read only
    // with `load`, when the k-block before stored it.
    unsafe { pair_avx512_inner(k, ap0.as_ptr(), ap1.as_ptr(), bp.as_ptr(), c.as_mut_ptr().cast(), ldc, load) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pair_avx512_inner(
    k: usize,
    ap0: *const f32,
    ap1: *const f32,
    bp: *const f32,
    c: *mut f32,
    ldc: usize,
    load: bool,
) {
    use std::arch::x86_64::*;
    unsafe {
        // 12 rows × 16 columns: one 16-lane register per row (the second panel's rows below the first's).
        let mut acc = [_mm512_setzero_ps(); 2 * MR];
        if load {
            for (r, a) in acc.iter_mut().enumerate() {
                *a = _mm512_loadu_ps(c.add(r * ldc));
            }
        }
        for p in 0..k {
            let b = _mm512_loadu_ps(bp.add(p * NR));
            for r in 0..MR {
                acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(*ap0.add(p * MR + r)), b, acc[r]);
                acc[MR + r] = _mm512_fmadd_ps(_mm512_set1_ps(*ap1.add(p * MR + r)), b, acc[MR + r]);
            }
        }
        for (r, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(c.add(r * ldc), *a);
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn quad_avx512(k: usize, ap: [&[f32]; 2], bp: [&[f32]; 2], c: &mut [MaybeUninit<f32>], ldc: usize, load: bool) {
    assert!(ap.iter().all(|a| a.len() >= k * MR) && bp.iter().all(|b| b.len() >= k * NR));
    assert!(c.len() >= (2 * MR - 1) * ldc + 2 * NR);
    #[cfg(test)]
    WIDE_TILES_RUN.with(|n| n.set((n.get().0, n.get().1 + 1, n.get().2)));
    // SAFETY: chosen only where the CPU has AVX-512F; loads stay within the
    // panels and `c` (checked above), stores within `c`; `c` is read only
    // with `load`, when the k-block before stored it.
    // The prefetches may name addresses past the panels (`wrapping_add`): hints, never read.
    unsafe {
        quad_avx512_inner(
            k,
            ap[0].as_ptr(),
            ap[1].as_ptr(),
            bp[0].as_ptr(),
            bp[1].as_ptr(),
            c.as_mut_ptr().cast(),
            ldc,
            load,
        )
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn quad_avx512_inner(
    k: usize,
    ap0: *const f32,
    ap1: *const f32,
    bp0: *const f32,
    bp1: *const f32,
    c: *mut f32,
    ldc: usize,
    load: bool,
) {
    use std::arch::x86_64::*;
    unsafe {
        // 12 rows × 32 columns: two 16-lane registers per row, 24 of the 32 registers; per step
        // of k, two loads of b and 12 broadcasts of a feed 24 FMAs.
        let mut acc = [[_mm512_setzero_ps(); 2]; 2 * MR];
        if load {
            for (r, a) in acc.iter_mut().enumerate() {
                *a = [_mm512_loadu_ps(c.add(r * ldc)), _mm512_loadu_ps(c.add(r * ldc + NR))];
            }
        }
        // Each step asks for b's lines eight steps on and, every other step, a's sixteen on (a hint:
        // no value changes). At a k-block of 1024 the two b panels (128 KiB) stream from L2 for
        // every pair of row panels, and the hardware's prefetchers did not keep up: 1024³ ran 6%
        // faster with it on an Intel Xeon (2 MiB L2), the tiny and small preset's products within 1%.
        for p in 0..k {
            prefetch(bp0.wrapping_add((p + 8) * NR));
            prefetch(bp1.wrapping_add((p + 8) * NR));
            if p % 2 == 0 {
                prefetch(ap0.wrapping_add(p * MR + 96));
                prefetch(ap1.wrapping_add(p * MR + 96));
            }
            let (b0, b1) = (_mm512_loadu_ps(bp0.add(p * NR)), _mm512_loadu_ps(bp1.add(p * NR)));
            for r in 0..MR {
                // row r of each row panel: acc[r] from the first, acc[MR + r] from the second
                let x = _mm512_set1_ps(*ap0.add(p * MR + r));
                acc[r][0] = _mm512_fmadd_ps(x, b0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(x, b1, acc[r][1]);
                let y = _mm512_set1_ps(*ap1.add(p * MR + r));
                acc[MR + r][0] = _mm512_fmadd_ps(y, b0, acc[MR + r][0]);
                acc[MR + r][1] = _mm512_fmadd_ps(y, b1, acc[MR + r][1]);
            }
        }
        for (r, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(c.add(r * ldc), a[0]);
            _mm512_storeu_ps(c.add(r * ldc + NR), a[1]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn wide_avx512(k: usize, ap: &[f32], bp: [&[f32]; 2], c: &mut [MaybeUninit<f32>], ldc: usize, load: bool) {
    assert!(ap.len() >= k * MR && bp.iter().all(|b| b.len() >= k * NR) && c.len() >= (MR - 1) * ldc + 2 * NR);
    #[cfg(test)]
    WIDE_TILES_RUN.with(|n| n.set((n.get().0, n.get().1, n.get().2 + 1)));
    // SAFETY: chosen only where the CPU has AVX-512F; loads stay within the
    // panels and `c` (checked above), stores within `c`; `c` is read only
    // with `load`, when the k-block before stored it.
    unsafe { wide_avx512_inner(k, ap.as_ptr(), bp[0].as_ptr(), bp[1].as_ptr(), c.as_mut_ptr().cast(), ldc, load) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn wide_avx512_inner(
    k: usize,
    ap: *const f32,
    bp0: *const f32,
    bp1: *const f32,
    c: *mut f32,
    ldc: usize,
    load: bool,
) {
    use std::arch::x86_64::*;
    unsafe {
        // 6 rows × 32 columns: two 16-lane registers per row; per step of k, two loads of b and
        // six broadcasts of a feed 12 FMAs.
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        if load {
            for (r, a) in acc.iter_mut().enumerate() {
                *a = [_mm512_loadu_ps(c.add(r * ldc)), _mm512_loadu_ps(c.add(r * ldc + NR))];
            }
        }
        for p in 0..k {
            let (b0, b1) = (_mm512_loadu_ps(bp0.add(p * NR)), _mm512_loadu_ps(bp1.add(p * NR)));
            for (r, a) in acc.iter_mut().enumerate() {
                let x = _mm512_set1_ps(*ap.add(p * MR + r));
                a[0] = _mm512_fmadd_ps(x, b0, a[0]);
                a[1] = _mm512_fmadd_ps(x, b1, a[1]);
            }
        }
        for (r, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(c.add(r * ldc), a[0]);
            _mm512_storeu_ps(c.add(r * ldc + NR), a[1]);
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

    /// Rows first in k-blocks shrunk to fit all of b's k-block in 19,200 bytes (75 steps of 64 columns).
    fn shrunk() -> Blocks {
        Blocks { rows_first_b: 4 * 64 * 75, rows_first_kc_min: 8, ..Blocks::fixed(1 << 14, 18, 48) }
    }

    /// Every path the CPU runs, each with this CPU's blocks and with blocks
    /// forced small (so that edge blocks and several k-blocks are exercised).
    fn paths() -> Vec<Path> {
        // One row panel by one column panel; one row panel by two (12 × 32 tiles cannot fit, a
        // pair cannot either); two by two with k-blocks of 5; three by three (an odd one of each).
        let small =
            [Blocks::fixed(7, 6, 16), Blocks::fixed(5, 6, 32), Blocks::fixed(5, 12, 32), Blocks::fixed(64, 18, 48)];
        Isa::available()
            .into_iter()
            .flat_map(|isa| {
                let this_cpu = Blocks::for_path(isa);
                let mut blocks = vec![this_cpu];
                blocks.extend(small);
                // Where the tiles take twelve rows, each also in both orders (mc, nc play no part in rows first).
                if isa == Isa::Avx512 {
                    blocks.extend([
                        Blocks { rows_first_b: 0, ..this_cpu },
                        Blocks { rows_first_b: usize::MAX, ..this_cpu },
                    ]);
                    blocks.extend(small.map(|b| Blocks { rows_first_b: usize::MAX, ..b }));
                    // Rows first in shrunk k-blocks: 30 × 300 × 50 in four of 75, 13 × 1536 × 33 in
                    // sixteen of 96, 64 × 128 × 65 in 43, 43 and 42 (`blocks_follow_the_caches`).
                    blocks.push(shrunk());
                }
                blocks.into_iter().map(move |b| Path::Forced(isa, b))
            })
            .chain([Path::Fastest])
            .collect()
    }

    #[test]
    fn every_element_is_one_fma_chain_in_order() {
        // Edges in every direction: M, N not multiples of the tile, K long
        // enough that a chain split into k-blocks would show if it were not continued.
        // (7, 9, 40): fewer rows than two panels (no 12 × 32 tile fits) beside two full column panels;
        // (13, 20, 150): a plain b of ten column panels, packed in groups of eight, the last with an
        // edge; (13, 20, 144): nine, the last alone and without an edge; (3, 20, 40): one row panel,
        // an edge; (13, 20, 5): one column panel, an edge; (13, 20, 16): N = NR, under a forced
        // shift the split panel alone; (25, 40, 64): the split panel, a pair of full column panels
        // and a lone one at a shifted corner.
        let shapes = [
            (1, 1, 1),
            (3, 20, 40),
            (13, 20, 5),
            (7, 3, 17),
            (7, 9, 40),
            (13, 20, 150),
            (13, 20, 144),
            (13, 1536, 33),
            (64, 128, 65),
            (6, 0, 16),
            (30, 300, 50),
            (25, 17, 80),
            (13, 20, 16),
            (25, 40, 64),
        ];
        let wide_before = WIDE_TILES_RUN.with(|n| n.get());
        let rows_first_before = ROWS_FIRST_RUN.with(|n| n.get());
        // The output's own column layout, and where N is a multiple of NR every kind of shift
        // (`column_shift`): panel 0 split between the first and the last columns, by 1 to 15.
        for shift in [None, Some(0), Some(4), Some(8), Some(12), Some(1), Some(15)] {
            FORCED_SHIFT.with(|s| s.set(shift));
            for &(m, k, n) in shapes.iter().filter(|s| shift.is_none() || s.2 % NR == 0) {
                // b plain, and b as wᵀ (a linear layer's weight, its lines along k, packed by transposes)
                let (a, b, w) = (random(&[m, k], 1), random(&[k, n], 2), random(&[n, k], 3));
                for b in [b, w.t().unwrap()] {
                    let want = reference(
                        &a.flatten_all().unwrap().to_vec1().unwrap(),
                        &b.flatten_all().unwrap().to_vec1().unwrap(),
                        m,
                        k,
                        n,
                    );
                    let want: Vec<u32> = want.into_iter().map(f32::to_bits).collect();
                    for path in paths() {
                        let got = bits(&a.apply_op2_no_bwd(&b, &MatMul { path }).unwrap());
                        assert_eq!(got, want, "{path:?}, {m}×{k}×{n}, shift {shift:?}, b strides {:?}", b.stride());
                    }
                }
            }
        }
        FORCED_SHIFT.with(|s| s.set(None));
        // Where the CPU has AVX-512, the wider tiles were among those checked (this thread's count).
        let (pairs, quads, wides) = WIDE_TILES_RUN.with(|n| n.get());
        let wide_run = (pairs - wide_before.0, quads - wide_before.1, wides - wide_before.2);
        let rows_first_run = ROWS_FIRST_RUN.with(|n| n.get()) - rows_first_before;
        if Isa::available().contains(&Isa::Avx512) {
            assert!(wide_run.0 > 0 && wide_run.1 > 0 && wide_run.2 > 0, "AVX-512: pairs, quads, wides {wide_run:?}");
            assert!(rows_first_run > 0, "AVX-512: nothing ran rows first");
        } else {
            assert_eq!((wide_run, rows_first_run), ((0, 0, 0), 0), "no AVX-512, yet wide tiles or rows first ran");
        }
    }

    #[test]
    fn every_path_takes_any_strides_and_batches_with_the_same_bits() {
        // (B, H, T, hs) @ (B, H, hs, T) through a transposed view, as attention does, and aᵀ @ g as a backward does.
        let q = random(&[2, 3, 20, 8], 3);
        let k = random(&[2, 3, 20, 8], 4);
        let at = random(&[40, 70], 5);
        let g = random(&[40, 23], 6);
        // P @ V with V a view into a wider row, as attention reads it from c_attn's output.
        let p = random(&[2, 3, 20, 20], 7);
        let v = random(&[2, 3, 20, 48], 8).narrow(3, 8, 32).unwrap();
        let want = (
            bits(&matmul(&q, &k.t().unwrap().contiguous().unwrap()).unwrap()),
            bits(&matmul(&at.t().unwrap().contiguous().unwrap(), &g).unwrap()),
            bits(&matmul(&p, &v.contiguous().unwrap()).unwrap()),
        );
        // P @ V (N = 32, six items, b a view) also with panel 0 split (`column_shift`).
        for path in paths() {
            let op = MatMul { path };
            assert_eq!(bits(&q.apply_op2_no_bwd(&k.t().unwrap(), &op).unwrap()), want.0, "{path:?}");
            assert_eq!(bits(&at.t().unwrap().apply_op2_no_bwd(&g, &op).unwrap()), want.1, "{path:?}");
        }
        for shift in [None, Some(4), Some(8), Some(15)] {
            FORCED_SHIFT.with(|s| s.set(shift));
            for path in paths() {
                let op = MatMul { path };
                assert_eq!(bits(&p.apply_op2_no_bwd(&v, &op).unwrap()), want.2, "{path:?}, shift {shift:?}");
            }
        }
        FORCED_SHIFT.with(|s| s.set(None));
    }

    #[test]
    fn the_column_shift_puts_each_full_panel_on_a_line() {
        // An output 16, 32 or 48 bytes past a line: panel 0 takes 12, 8 or 4 columns, and every
        // row of every panel after it starts on a line (panel q at column q·NR − shift).
        let n = 64;
        for (at, want) in [(0x1010, 4), (0x1020, 8), (0x1030, 12)] {
            let out = at as *const f32;
            let shift = column_shift(out, n, true);
            assert_eq!(shift, want);
            for (row, q) in (0..3).flat_map(|r| (1..n / NR).map(move |q| (r, q))) {
                assert_eq!((at + 4 * (row * n + q * NR - shift)) % 64, 0, "row {row}, panel {q}");
            }
        }
        let out = 0x1010 as *const f32;
        // On a line, unasked, or rows that start at different places in a line: no shift.
        assert_eq!(column_shift(0x1040 as *const f32, 32, true), 0);
        assert_eq!(column_shift(out, 32, false), 0);
        assert_eq!(column_shift(out, 40, true), 0);
    }

    #[test]
    fn the_sweeps_ask_ahead_only_where_the_blocks_say() {
        // 30 × 50 × 40 in blocks of 18 rows and 48 columns: two row blocks, one column block.
        // Forced blocks count nothing as staying in L2 (`in_l2` 0): every product is beyond it.
        let (a, b) = (random(&[30, 50], 1), random(&[50, 40], 2));
        for isa in Isa::available() {
            let asked = |ask_ahead: bool| {
                let path = Path::Forced(isa, Blocks { ask_ahead, ..Blocks::fixed(64, 18, 48) });
                let before = ASKED_AHEAD.with(|n| n.get());
                let got = bits(&a.apply_op2_no_bwd(&b, &MatMul { path }).unwrap());
                (ASKED_AHEAD.with(|n| n.get()) - before, got)
            };
            let ((with, bits_with), (without, bits_without)) = (asked(true), asked(false));
            assert!(with > 0 && without == 0, "{isa:?}: sweeps that asked {with} with, {without} without");
            assert_eq!(bits_with, bits_without, "{isa:?}: a hint changed a value");
        }
    }

    #[test]
    fn blocks_follow_the_caches() {
        // A Zen 3 core: 32 KiB L1d, 512 KiB L2, 32 MiB L3.
        let b = Blocks::from_caches(32 << 10, 512 << 10, 32 << 20);
        assert_eq!(
            b,
            Blocks {
                kc: 1536,
                mc: 1362,
                nc: 1360,
                kc_small: 256,
                small_out: 256 << 10,
                rows_first_b: 256 << 10,
                rows_first_kc_min: 192,
                in_l2: 256 << 10,
                ask_ahead: true
            }
        );
        assert_eq!(b.mc % MR + b.nc % NR, 0);
        // A kc-deep panel of b: 3/16 of L2; a kc_small-deep one: half of L1.
        assert_eq!(4 * b.kc * NR, (512 << 10) * 3 / 16);
        assert_eq!(4 * b.kc_small * NR, (32 << 10) / 2);
        // The contraction in the fewest equal blocks: 1536 whole, 2048 in two, 4000 in three.
        let large = |k| b.kc_for(k, 1024, 1024);
        assert_eq!((large(1536), large(2048), large(4000), large(7)), (1536, 1024, 1334, 7));
        // An output that fits in half of L2 (512 × 128 floats = 256 KiB): blocks of L1's size.
        assert_eq!((b.kc_for(512, 512, 128), b.kc_for(512, 513, 128), b.kc_for(600, 384, 128)), (256, 512, 200));
        // BLIS's rule (the AVX2 tiles on an Intel core), on a Xeon's 48 KiB L1d and 2 MiB L2: a
        // b panel of 384 steps in half of L1, 336 rows of a 384 steps deep (504 KiB) in a quarter of L2.
        let intel = Blocks::l1_resident(48 << 10, 2 << 20, 105 << 20);
        assert_eq!((intel.kc, intel.mc, intel.kc_for(1536, 1024, 1024)), (384, 336, 384));
        assert_eq!((4 * intel.kc * NR, 4 * intel.mc * intel.kc), ((48 << 10) / 2, 516_096));
        // Rows first (a Xeon's 2 MiB L2: all of b's k-block in 1 MiB): 1024 × 1536 × 384 in
        // k-blocks of 512, 1024³ of 256; 1024 × 384 × 1536 not (k-blocks of 128 < 192).
        let xeon = Blocks::from_caches(48 << 10, 2 << 20, 105 << 20);
        let rows_first = |k, n| xeon.rows_first_kc(k, n, xeon.kc_for(k, 1024, n));
        assert_eq!(
            (rows_first(1536, 384), rows_first(1024, 1024), rows_first(384, 1536)),
            (Some(512), Some(256), None)
        );
        // 1024 × 384 × 1152: exactly on the floor; 1024 × 512 × 128, a small output: its k-blocks fit as they are.
        assert_eq!((rows_first(384, 1152), rows_first(512, 128)), (Some(192), Some(256)));
        // The tests' shrunk blocks (`paths`): several k-blocks rows first; k = 0 never divides by 0.
        let got = [(300, 64, 300), (1536, 48, 1536), (128, 80, 128), (0, 640, 64)]
            .map(|(k, cols, kc)| shrunk().rows_first_kc(k, cols, kc));
        assert_eq!(got, [Some(75), Some(96), Some(43), None]);
        // Which rule each path takes: BLIS's for the AVX2 tiles on an Intel core; the Zen 3's
        // elsewhere; and only on an Intel core do the sweeps ask for the next panels.
        let zen3 = [32 << 10, 512 << 10, 32 << 20];
        assert_eq!(Blocks::rule(Isa::Avx2, true, zen3), Blocks::l1_resident(32 << 10, 512 << 10, 32 << 20));
        assert!(Blocks::rule(Isa::Avx2, true, zen3).ask_ahead);
        let quiet = Blocks { ask_ahead: false, ..b };
        for isa in [Isa::Avx512, Isa::Avx2, Isa::Portable] {
            assert_eq!(Blocks::rule(isa, false, zen3), quiet, "{isa:?} on a core not Intel's");
        }
        assert_eq!((Blocks::rule(Isa::Avx512, true, zen3), Blocks::rule(Isa::Portable, true, zen3)), (b, b));
        let tiny = Blocks::from_caches(1, 1, 1);
        assert_eq!(
            tiny,
            Blocks {
                kc: 64,
                mc: MR,
                nc: NR,
                kc_small: 64,
                small_out: 0,
                rows_first_b: 0,
                rows_first_kc_min: 192,
                in_l2: 0,
                ask_ahead: true
            },
            "at least one tile"
        );
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
        // N = 32 with panel 0 split (its last columns widened on their own): the same rounding.
        let b = random(&[40, 32], 7).to_dtype(DType::BF16).unwrap();
        let wide = matmul(&a.to_dtype(DType::F32).unwrap(), &b.to_dtype(DType::F32).unwrap()).unwrap();
        for shift in [4, 8, 12] {
            FORCED_SHIFT.with(|s| s.set(Some(shift)));
            for path in paths() {
                let out = a.apply_op2_no_bwd(&b, &MatMul { path }).unwrap();
                assert_eq!(bits(&out), bits(&wide.to_dtype(DType::BF16).unwrap()), "{path:?}, shift {shift}");
            }
        }
        FORCED_SHIFT.with(|s| s.set(None));
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
