//! `fsdp-bench` (`just bench`): every lesson at 1, 2 and 4 ranks on the tiny
//! and small presets, run as real MPI jobs; median step time after warm-up,
//! compute against communication, bytes per collective against theory, the
//! measured heap against the tally, peak RSS, and the model FLOPs achieved
//! against this machine's own single-thread matmul peak, measured here.
//! Writes bench.md, bench.json and two SVG plots under `--out`.
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Instant;

use candle_core::{Device, Tensor};
use clap::Parser;
use fsdp_harness::plot::{Chart, Series, svg};
use serde_json::{Value, json};

#[derive(Debug, Parser)]
#[command(name = "fsdp-bench", about = "Speed, memory and bytes of every lesson, measured")]
struct Args {
    /// Output folder for bench.md, bench.json, the plots and each run's report.
    #[arg(long, default_value = "out/bench")]
    out: PathBuf,
    /// Steps measured per run, after the warm-up.
    #[arg(long, default_value_t = 30)]
    steps: u64,
    /// Warm-up steps, not measured.
    #[arg(long, default_value_t = 3)]
    warmup: u64,
    /// World sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    ranks: Vec<usize>,
    /// Presets.
    #[arg(long, value_delimiter = ',', default_value = "tiny,small")]
    presets: Vec<String>,
    /// Run nothing: redraw the two plots under `--out` from its bench.json.
    #[arg(long)]
    replot: bool,
    /// Measure only the lessons' matmul: on one thread, through every SIMD
    /// path this CPU runs (AVX-512, AVX2; the portable path only on a CPU
    /// with neither, as it is far too slow to time beside them), at 1024³ and at the tiny and
    /// small presets' own products (each linear layer's forward and both
    /// backward products, transposed views included), beside the CPU's FMA
    /// peak from its clock and vector width.
    #[arg(long)]
    matmul_only: bool,
    /// With --matmul-only: print it as JSON (`just compare-pytorch` reads it).
    #[arg(long)]
    json: bool,
    /// Print only the 1024³ rate, in FLOP/s, and nothing else (what `just
    /// alpha-beta` needs: not the whole per-path, per-shape sweep).
    #[arg(long)]
    peak_only: bool,
}

/// One lesson configuration: label, binary, extra flags. Each scheme that
/// can keep its activations runs both ways, so that lessons compare at the
/// same activation policy: lesson 03 and ZeRO-3 always recompute.
const LESSONS: [(&str, &str, &[&str]); 12] = [
    ("01 data parallel", "step01-data-parallel", &[]),
    ("01 data parallel, recompute", "step01-data-parallel", &["--recompute"]),
    ("02 whole-model shard", "step02-whole-model-shard", &["--no-check", "--no-plot"]),
    ("02 whole-model shard, recompute", "step02-whole-model-shard", &["--no-check", "--no-plot", "--recompute"]),
    ("03 layer-wise shard, recompute", "step03-layerwise-shard", &["--no-plot"]),
    ("04 ZeRO-1", "step04-optimizer-state-shard", &["--stage", "1", "--precision", "fp32"]),
    ("04 ZeRO-1, recompute", "step04-optimizer-state-shard", &["--stage", "1", "--precision", "fp32", "--recompute"]),
    ("04 ZeRO-2", "step04-optimizer-state-shard", &["--stage", "2", "--precision", "fp32"]),
    ("04 ZeRO-2, recompute", "step04-optimizer-state-shard", &["--stage", "2", "--precision", "fp32", "--recompute"]),
    ("04 ZeRO-3, recompute", "step04-optimizer-state-shard", &["--stage", "3", "--precision", "fp32"]),
    ("04 ZeRO-1, bf16", "step04-optimizer-state-shard", &["--stage", "1", "--precision", "bf16"]),
    ("04 ZeRO-3, recompute, bf16", "step04-optimizer-state-shard", &["--stage", "3", "--precision", "bf16"]),
];

/// Micro-batch shape per preset: (B, T). The small preset gets a smaller
/// batch so the whole bench stays within minutes on 2 cores.
fn shape(preset: &str) -> (&'static str, &'static str) {
    if preset == "tiny" { ("8", "64") } else { ("4", "64") }
}

struct Row {
    lesson: &'static str,
    preset: String,
    ranks: usize,
    ms_per_step: f64,
    tokens_per_s: f64,
    comm_ms: f64,
    bytes: Vec<(String, u64, Option<u64>)>,
    peak_heap: u64,
    tally: u64,
    rss: u64,
    flops_per_step: f64,
}

fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn run(a: &Args) -> anyhow::Result<()> {
    // SAFETY: no other thread exists yet.
    unsafe { std::env::set_var("RAYON_NUM_THREADS", "1") };
    // The kernel's rates as the lessons see them: they keep freed blocks in
    // the heap (fsdp_harness::launch), so a product's buffers are not fresh
    // pages to fault in (at 1024³ those faults cost a third of its time).
    fsdp_harness::alloc::keep_freed_memory();
    std::fs::create_dir_all(&a.out)?;
    if a.replot {
        let j: Value = serde_json::from_slice(&std::fs::read(a.out.join("bench.json"))?)?;
        let rows: Vec<Row> =
            j["runs"].as_array().map(|runs| runs.iter().filter_map(row_from_json).collect()).unwrap_or_default();
        anyhow::ensure!(!rows.is_empty(), "no runs in {}/bench.json", a.out.display());
        let cpu = j["cpu"].as_str().unwrap_or("unknown CPU");
        plots(&rows, &a.out, &machine(cpu, j["matmul_peak_flops"].as_f64().unwrap_or(0.0)))?;
        println!("redrew {0}/tokens_per_second.svg and {0}/memory_per_rank.svg", a.out.display());
        return Ok(());
    }
    // Also before --matmul-only's rates, though `just compare-pytorch` takes its 1024³ figure
    // from those: the rates are measured on the heap this leaves. Without it, on a Zen 3 (AMD
    // family 25, model 1), the small preset's c_attn gᵀ·x measured 5-7% slower (three sets of six
    // to eight interleaved rounds), its code the same: where malloc puts its operands moves it.
    let mut peak = matmul_peak()?;
    if a.peak_only {
        println!("{peak}");
        return Ok(());
    }
    if a.matmul_only {
        let rates = matmul_rates()?;
        let json = serde_json::json!({"cpu": cpu_model(), "matmul_peak_flops": peak,
            "path": fsdp_gpt::kernels::Isa::in_use().name(), "rates": rates, "fma_peaks": fma_peaks(),
            "instruction_peaks": instruction_peaks(), "bf16": fsdp_gpt::kernels::Bf16Dot::describe(),
            "bf16_path": bf16_route_in_use().name()});
        if a.json {
            println!("{json}");
        } else {
            print!("{}", matmul_table(&json));
        }
        return Ok(());
    }
    println!(
        "single-thread f32 matmul peak of this machine (the model's own kernel, 1024³, best of 5): {:.1} GFLOP/s\n",
        peak / 1e9
    );
    // The bf16 rows are measured against the kernel's bf16 rate on its route here (VDPBF16PS, or
    // the emulation on f32 tiles), and that rate against the instruction's own peak.
    let mut peak_bf16 = matmul_peak_bf16()?;
    let bin = std::env::current_exe()?.parent().map(Path::to_path_buf).unwrap_or_default();
    let mut rows = vec![];
    let started = Instant::now();
    for preset in &a.presets {
        for &n in &a.ranks {
            for &(lesson, package, extra) in &LESSONS {
                let name = format!("{}-{preset}-{n}", package.trim_start_matches("step"));
                let name = format!(
                    "{name}{}{}",
                    extra.iter().filter(|x| x.len() == 1).map(|s| format!("-s{s}")).collect::<String>(),
                    if extra.contains(&"--recompute") { "-recompute" } else { "" }
                ) + if extra.contains(&"bf16") { "-bf16" } else { "" };
                let dir = a.out.join("runs").join(&name);
                let (b, t) = shape(preset);
                let steps = (a.warmup + a.steps).to_string();
                let micro = (4.max(n)).to_string();
                let mut cmd = Command::new("mpirun");
                cmd.args(["-q", "--oversubscribe", "-n", &n.to_string()])
                    .arg(bin.join(package))
                    .args([
                        "--preset",
                        preset,
                        "--batch-size",
                        b,
                        "--seq-len",
                        t,
                        "--micro-batches",
                        &micro,
                        "--steps",
                        &steps,
                        "--log-every",
                        "100000",
                    ])
                    .args(extra)
                    .arg("--out")
                    .arg(&dir)
                    .env("FSDP_PROGRESS", "plain")
                    .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
                    .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
                let t0 = Instant::now();
                let o = cmd.output()?;
                anyhow::ensure!(o.status.success(), "{name} failed: {}", String::from_utf8_lossy(&o.stderr));
                let r: Value = serde_json::from_slice(&std::fs::read(dir.join("report.json"))?)?;
                let row = row_of(lesson, preset, n, &r, a.warmup)?;
                println!(
                    "{lesson:<32} {preset:<5} N={n}  {:>8.1} ms/step  {:>7.0} tok/s  peak {:>7.1} MB / tally {:.3}  ({:.0} s)",
                    row.ms_per_step,
                    row.tokens_per_s,
                    row.peak_heap as f64 / 1e6,
                    row.peak_heap as f64 / row.tally.max(1) as f64,
                    t0.elapsed().as_secs_f64()
                );
                rows.push(row);
                // This CPU's clock moves: the rate is measured again after every run and the
                // highest is the one the table divides by (the lowest, most cautious, percentages).
                peak = peak.max(matmul_peak()?);
                peak_bf16 = peak_bf16.max(matmul_peak_bf16()?);
            }
        }
    }
    let bf16 = Bf16Rate { route: bf16_route_in_use().name(), flops: peak_bf16, instruction: instruction_peaks() };
    let md = table(&rows, peak, &bf16);
    std::fs::write(a.out.join("bench.md"), &md)?;
    println!("\n{md}");
    let j = json!({
        "cpu": cpu_model(),
        "matmul_peak_flops": peak,
        "matmul_peak_bf16_flops": peak_bf16,
        "bf16_route": bf16.route,
        "instruction_peaks": bf16.instruction,
        "runs": rows.iter().map(|r| json!({"lesson": r.lesson, "preset": r.preset, "ranks": r.ranks, "ms_per_step": r.ms_per_step,
            "tokens_per_second": r.tokens_per_s, "comm_ms_per_step": r.comm_ms, "peak_heap_bytes": r.peak_heap, "tally_bytes": r.tally,
            "peak_rss_bytes": r.rss, "flops_per_step": r.flops_per_step})).collect::<Vec<_>>(),
    });
    std::fs::write(a.out.join("bench.json"), serde_json::to_string_pretty(&j)?)?; // before the plots: the runs are kept
    plots(&rows, &a.out, &machine(&cpu_model(), peak))?;
    println!(
        "wrote {0}/bench.md, {0}/bench.json, {0}/tokens_per_second.svg, {0}/memory_per_rank.svg in {1:.0} s",
        a.out.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// This machine's single-thread f32 matmul rate through the model's own
/// kernel (`fsdp_gpt::kernels::matmul`): the ceiling the lessons' compute is
/// measured against.
fn matmul_peak() -> anyhow::Result<f64> {
    let n = 1024;
    let a = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?;
    let b = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?;
    let _ = fsdp_gpt::kernels::matmul(&a, &b)?; // warm-up
    let mut best = 0f64;
    for _ in 0..5 {
        let t0 = Instant::now();
        let c = fsdp_gpt::kernels::matmul(&a, &b)?;
        let s = t0.elapsed().as_secs_f64();
        drop(c);
        best = best.max(2.0 * (n * n * n) as f64 / s);
    }
    Ok(best)
}

/// The same for bf16 operands, through the route the lessons' bf16 matmul takes here.
fn matmul_peak_bf16() -> anyhow::Result<f64> {
    rate(Route::Bf16(bf16_route_in_use()), 1024, 1024, 1024, false, false)
}

/// What the bf16 rows are measured against: the kernel's bf16 rate at 1024³ on its route, and
/// the instructions' own peaks as [`instruction_peaks`] measured them.
struct Bf16Rate {
    route: String,
    flops: f64,
    instruction: Value,
}

/// The products the lessons' linear layers make at a preset's micro-batch
/// (B·T tokens of C channels, x · wᵀ with w stored (out, in)): for each
/// layer, the forward and the two backward products, as (name, M, K, N,
/// a transposed, b transposed) — a transposed operand is a view, as the
/// kernels read it.
pub fn lesson_products(preset: &str) -> Vec<(String, usize, usize, usize, bool, bool)> {
    let (tokens, c) = match preset {
        "tiny" => (8 * 64, 128),
        _ => (8 * 128, 384),
    };
    let mut v = vec![];
    for (layer, cin, cout) in [("c_attn", c, 3 * c), ("c_fc", c, 4 * c), ("mlp c_proj", 4 * c, c)] {
        v.push((format!("{preset} {layer}: x·wᵀ"), tokens, cin, cout, false, true));
        v.push((format!("{preset} {layer}: g·w"), tokens, cout, cin, false, false));
        v.push((format!("{preset} {layer}: gᵀ·x"), cout, tokens, cin, true, false));
    }
    v
}

/// The bf16 route the lessons' matmul takes on this CPU (as `FSDP_MATMUL` and `FSDP_BF16` set it).
fn bf16_route_in_use() -> fsdp_gpt::kernels::Bf16Route {
    use fsdp_gpt::kernels::{Bf16Dot, Bf16Route, Isa};
    match Bf16Dot::in_use() {
        Bf16Dot::Native => Bf16Route::Native,
        Bf16Dot::Emulated => Bf16Route::Emulated(Isa::in_use()),
    }
}

/// A path of the lessons' matmul: f32 through an instruction set's tiles,
/// or bf16 through one of its routes (VDPBF16PS, or emulated on f32 tiles).
#[derive(Clone, Copy)]
enum Route {
    F32(fsdp_gpt::kernels::Isa),
    Bf16(fsdp_gpt::kernels::Bf16Route),
}

impl Route {
    fn name(self) -> String {
        match self {
            Route::F32(isa) => isa.name().to_string(),
            Route::Bf16(r) => r.name(),
        }
    }

    fn run(self, a: &Tensor, b: &Tensor) -> anyhow::Result<Tensor> {
        Ok(match self {
            Route::F32(isa) => fsdp_gpt::kernels::matmul_on(a, b, isa)?,
            Route::Bf16(r) => fsdp_gpt::kernels::matmul_bf16_on(a, b, r)?,
        })
    }
}

/// One thread's rate through `route` for an M × K × N product: best of five
/// timed after one untimed, FLOP/s.
fn rate(route: Route, m: usize, k: usize, n: usize, at: bool, bt: bool) -> anyhow::Result<f64> {
    let dtype = match route {
        Route::F32(_) => candle_core::DType::F32,
        Route::Bf16(_) => candle_core::DType::BF16,
    };
    let operand = |rows: usize, cols: usize, t: bool| -> anyhow::Result<Tensor> {
        Ok(match t {
            true => Tensor::randn(0f32, 1.0, (cols, rows), &Device::Cpu)?.to_dtype(dtype)?.t()?,
            false => Tensor::randn(0f32, 1.0, (rows, cols), &Device::Cpu)?.to_dtype(dtype)?,
        })
    };
    let (a, b) = (operand(m, k, at)?, operand(k, n, bt)?);
    let _ = route.run(&a, &b)?;
    let reps = ((2e8 / (2.0 * (m * k * n) as f64)) as usize).clamp(1, 200); // ≈ 0.1 s at 2 GFLOP/s per timing
    let mut best = 0f64;
    for _ in 0..5 {
        let t0 = Instant::now();
        for _ in 0..reps {
            drop(route.run(&a, &b)?);
        }
        best = best.max(reps as f64 * 2.0 * (m * k * n) as f64 / t0.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// Every path's rate at 1024³ and at the presets' products.
fn matmul_rates() -> anyhow::Result<Vec<Value>> {
    let mut shapes = vec![("1024³".to_string(), 1024, 1024, 1024, false, false)];
    shapes.extend(lesson_products("tiny"));
    shapes.extend(lesson_products("small"));
    let mut out = vec![];
    // The portable path (a libm fma per multiply-add where the CPU has SIMD paths) is for other
    // architectures: far too slow to time at these sizes beside them, and its bits are the same.
    let mut paths = fsdp_gpt::kernels::Isa::available();
    if paths.len() > 1 {
        paths.retain(|p| *p != fsdp_gpt::kernels::Isa::Portable);
    }
    let mut routes: Vec<Route> = paths.iter().map(|&isa| Route::F32(isa)).collect();
    routes.extend(
        fsdp_gpt::kernels::Bf16Route::available()
            .into_iter()
            .filter(|r| !matches!(r, fsdp_gpt::kernels::Bf16Route::Emulated(isa) if !paths.contains(isa)))
            .map(Route::Bf16),
    );
    for route in routes {
        for (name, m, k, n, at, bt) in &shapes {
            let flops = rate(route, *m, *k, *n, *at, *bt)?;
            out.push(json!({"path": route.name(), "shape": name, "m": m, "k": k, "n": n, "flops": flops}));
        }
    }
    Ok(out)
}

/// The single-core peaks of the instructions the matmul's tiles are made
/// of, measured: independent chains of each — twelve on 256-bit registers
/// (AVX2's sixteen), twenty-four on 512-bit ones, enough to cover the
/// latency at two per cycle — best of three runs of 0.1 s or so, FLOP/s:
/// VFMADD231PS (2 FLOPs per f32 lane), and VDPBF16PS (two products and two
/// adds per f32 lane, 4 FLOPs) where the CPU has AVX512_BF16. What a tile
/// could reach if it did nothing else.
fn instruction_peaks() -> Value {
    #[allow(unused_mut)]
    let mut peaks = serde_json::Map::new();
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::asm;
        // Seconds for `rounds` rounds of a body of `per` instructions.
        fn best_of_3(run: impl Fn(u64) -> f64) -> f64 {
            run(200_000); // the core up to its clock
            (0..3).map(|_| run(2_000_000)).fold(f64::INFINITY, f64::min)
        }
        let rate = |per: f64, flops: f64, secs: f64| 2_000_000.0 * per * flops / secs;
        if std::arch::is_x86_feature_detected!("fma") {
            // SAFETY (each run): register arithmetic on a CPU with the feature; clobbers named.
            let secs = best_of_3(|rounds| {
                let t0 = Instant::now();
                unsafe {
                    asm!(
                        "vxorps ymm14, ymm14, ymm14",
                        "vxorps ymm15, ymm15, ymm15",
                        "2:",
                        "vfmadd231ps ymm0, ymm14, ymm15", "vfmadd231ps ymm1, ymm14, ymm15",
                        "vfmadd231ps ymm2, ymm14, ymm15", "vfmadd231ps ymm3, ymm14, ymm15",
                        "vfmadd231ps ymm4, ymm14, ymm15", "vfmadd231ps ymm5, ymm14, ymm15",
                        "vfmadd231ps ymm6, ymm14, ymm15", "vfmadd231ps ymm7, ymm14, ymm15",
                        "vfmadd231ps ymm8, ymm14, ymm15", "vfmadd231ps ymm9, ymm14, ymm15",
                        "vfmadd231ps ymm10, ymm14, ymm15", "vfmadd231ps ymm11, ymm14, ymm15",
                        "dec {n}",
                        "jnz 2b",
                        n = inout(reg) rounds => _,
                        out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _, out("ymm4") _, out("ymm5") _,
                        out("ymm6") _, out("ymm7") _, out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
                        out("ymm14") _, out("ymm15") _,
                        options(nomem, nostack),
                    );
                }
                t0.elapsed().as_secs_f64()
            });
            peaks.insert("vfmadd231ps ymm".into(), json!(rate(12.0, 16.0, secs)));
        }
        // 24 chains on zmm0..zmm23 of `$ins zmmR, zmm30, zmm31`.
        macro_rules! zmm24 {
            ($ins:literal) => {
                |rounds: u64| {
                    let t0 = Instant::now();
                    unsafe {
                        asm!(
                            "vpxord zmm30, zmm30, zmm30",
                            "vpxord zmm31, zmm31, zmm31",
                            "2:",
                            concat!($ins, " zmm0, zmm30, zmm31"),
                            concat!($ins, " zmm1, zmm30, zmm31"),
                            concat!($ins, " zmm2, zmm30, zmm31"),
                            concat!($ins, " zmm3, zmm30, zmm31"),
                            concat!($ins, " zmm4, zmm30, zmm31"),
                            concat!($ins, " zmm5, zmm30, zmm31"),
                            concat!($ins, " zmm6, zmm30, zmm31"),
                            concat!($ins, " zmm7, zmm30, zmm31"),
                            concat!($ins, " zmm8, zmm30, zmm31"),
                            concat!($ins, " zmm9, zmm30, zmm31"),
                            concat!($ins, " zmm10, zmm30, zmm31"),
                            concat!($ins, " zmm11, zmm30, zmm31"),
                            concat!($ins, " zmm12, zmm30, zmm31"),
                            concat!($ins, " zmm13, zmm30, zmm31"),
                            concat!($ins, " zmm14, zmm30, zmm31"),
                            concat!($ins, " zmm15, zmm30, zmm31"),
                            concat!($ins, " zmm16, zmm30, zmm31"),
                            concat!($ins, " zmm17, zmm30, zmm31"),
                            concat!($ins, " zmm18, zmm30, zmm31"),
                            concat!($ins, " zmm19, zmm30, zmm31"),
                            concat!($ins, " zmm20, zmm30, zmm31"),
                            concat!($ins, " zmm21, zmm30, zmm31"),
                            concat!($ins, " zmm22, zmm30, zmm31"),
                            concat!($ins, " zmm23, zmm30, zmm31"),
                            "dec {n}",
                            "jnz 2b",
                            n = inout(reg) rounds => _,
                            out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _, out("zmm4") _,
                            out("zmm5") _, out("zmm6") _, out("zmm7") _, out("zmm8") _, out("zmm9") _,
                            out("zmm10") _, out("zmm11") _, out("zmm12") _, out("zmm13") _, out("zmm14") _,
                            out("zmm15") _, out("zmm16") _, out("zmm17") _, out("zmm18") _, out("zmm19") _,
                            out("zmm20") _, out("zmm21") _, out("zmm22") _, out("zmm23") _,
                            out("zmm30") _, out("zmm31") _,
                            options(nomem, nostack),
                        );
                    }
                    t0.elapsed().as_secs_f64()
                }
            };
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            peaks.insert("vfmadd231ps zmm".into(), json!(rate(24.0, 32.0, best_of_3(zmm24!("vfmadd231ps")))));
        }
        if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bf16") {
            peaks.insert("vdpbf16ps zmm".into(), json!(rate(24.0, 64.0, best_of_3(zmm24!("vdpbf16ps")))));
        }
    }
    Value::Object(peaks)
}

/// The CPU's single-core f32 FMA peak per path, from the clock [`clock_hz`]
/// measures and the vector width, two FMA units assumed (Zen 2 onwards,
/// Intel since Haswell): 2 units × f32 lanes per unit per cycle × 2 FLOPs. A
/// Zen 4 (AMD family 25 with AVX-512) has two 256-bit FMA units and runs a
/// 512-bit FMA as two halves: its AVX-512 peak is its AVX2 peak. (Where
/// AVX-512 has one 512-bit FMA unit, some Intel parts, or a 256-bit
/// datapath, a mobile Zen 5, the AVX-512 figure is still twice too high.)
/// /proc/cpuinfo's "cpu MHz" is printed beside it, and is the clock used where
/// none was measured (off x86-64): in a virtual machine it can be a fixed
/// figure the core runs well above (a Zen 3 here: 2,445 MHz reported, 3,050-3,220
/// measured, the kernel at 90-93 GFLOP/s at 1024³, above the 78.3 that 2,445 MHz allows).
fn fma_peaks() -> Value {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let mhz: f64 = cpuinfo_field(&info, "cpu MHz").and_then(|v| v.trim().parse().ok()).unwrap_or(0.0);
    let hz = Some(clock_hz()).filter(|&hz| hz > 0.0).unwrap_or(mhz * 1e6);
    // Family 25 is Zen 3 and Zen 4; only Zen 4 has AVX-512, the one path this narrows.
    let amd_family_25 = cpuinfo_field(&info, "vendor_id").is_some_and(|v| v.trim() == "AuthenticAMD")
        && cpuinfo_field(&info, "cpu family").is_some_and(|f| f.trim() == "25");
    let lanes = |isa: fsdp_gpt::kernels::Isa| match isa {
        fsdp_gpt::kernels::Isa::Avx512 if amd_family_25 => 8.0,
        fsdp_gpt::kernels::Isa::Avx512 => 16.0,
        fsdp_gpt::kernels::Isa::Avx2 => 8.0,
        fsdp_gpt::kernels::Isa::Portable => 1.0,
    };
    let peaks: serde_json::Map<String, Value> = fsdp_gpt::kernels::Isa::available()
        .into_iter()
        .map(|isa| (isa.name().to_string(), json!(hz * 2.0 * lanes(isa) * 2.0)))
        .collect();
    json!({"mhz": hz / 1e6, "cpuinfo_mhz": mhz, "peaks": peaks})
}

/// The clock this core runs at now, measured: a chain of dependent
/// register-to-register additions takes one cycle per addition on the x86
/// cores this project runs on (Zen, Intel since Haswell), so additions per
/// second is cycles per second. (Not `add x, 1`: newer Intel cores may fold
/// an immediate into the register renamer.) After 20 ms of the same chain
/// untimed (a core that idled may take that long to reach its clock), the
/// best of 20 runs of 2 million additions (0.6 ms each at 3.2 GHz), so that
/// a run the scheduler interrupted does not count. 0 off x86-64.
fn clock_hz() -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        const ROUNDS: u64 = 250_000; // 8 additions each
        // One run of the chain: its seconds.
        let chain = || {
            let (mut x, mut n, one) = (0u64, ROUNDS, 1u64);
            let t0 = Instant::now();
            // SAFETY: register arithmetic only; no memory is touched.
            unsafe {
                std::arch::asm!(
                    "2:",
                    "add {x}, {one}", "add {x}, {one}", "add {x}, {one}", "add {x}, {one}",
                    "add {x}, {one}", "add {x}, {one}", "add {x}, {one}", "add {x}, {one}",
                    "dec {n}", // its own chain, beside x's: free
                    "jnz 2b",
                    x = inout(reg) x, n = inout(reg) n, one = in(reg) one,
                    options(nomem, nostack),
                );
            }
            let s = t0.elapsed().as_secs_f64();
            assert_eq!((x, n), (8 * ROUNDS, 0)); // the chain ran
            s
        };
        let warm = Instant::now();
        while warm.elapsed().as_secs_f64() < 0.02 {
            chain();
        }
        (8 * ROUNDS) as f64 / (0..20).map(|_| chain()).fold(f64::INFINITY, f64::min)
    }
    #[cfg(not(target_arch = "x86_64"))]
    0.0
}

/// The rates as a table, GFLOP/s, a column per path.
fn matmul_table(j: &Value) -> String {
    let rates = j["rates"].as_array().cloned().unwrap_or_default();
    let mut paths: Vec<String> = vec![];
    let mut shapes: Vec<(String, String)> = vec![];
    for r in &rates {
        let (p, s) = (r["path"].as_str().unwrap_or("").to_string(), r["shape"].as_str().unwrap_or("").to_string());
        if !paths.contains(&p) {
            paths.push(p);
        }
        let dims = format!("{} × {} × {}", r["m"], r["k"], r["n"]);
        if !shapes.iter().any(|(x, _)| *x == s) {
            shapes.push((s, dims));
        }
    }
    let mut header = vec!["product".to_string(), "M × K × N".to_string()];
    header.extend(paths.iter().map(|p| format!("{p} (GFLOP/s)")));
    let mut t = fsdp_harness::table::Table::new(header);
    for (s, dims) in &shapes {
        let mut row = vec![s.clone(), dims.clone()];
        for p in &paths {
            let f = rates
                .iter()
                .find(|r| r["path"] == p.as_str() && r["shape"] == s.as_str())
                .and_then(|r| r["flops"].as_f64());
            row.push(f.map_or("—".into(), |f| format!("{:.1}", f / 1e9)));
        }
        t.row(row);
    }
    let peaks = &j["fma_peaks"];
    let p: Vec<String> = peaks["peaks"]
        .as_object()
        .map(|o| o.iter().map(|(k, v)| format!("{k} {:.1}", v.as_f64().unwrap_or(0.0) / 1e9)).collect())
        .unwrap_or_default();
    let measured: Vec<String> = j["instruction_peaks"]
        .as_object()
        .map(|o| o.iter().map(|(k, v)| format!("{k} {:.1}", v.as_f64().unwrap_or(0.0) / 1e9)).collect())
        .unwrap_or_default();
    format!(
        "{}: the lessons' matmul on one thread, GFLOP/s (best of 5), through every path this CPU runs (in use: {}; bf16: {}):\n{}FMA peak at the clock measured now, {:.0} MHz (/proc/cpuinfo says {:.0}), 2 FMA units × f32 lanes per unit per cycle × 2 FLOPs: {} GFLOP/s\nThe instructions' peaks, measured (independent chains, nothing else): {} GFLOP/s\n",
        j["cpu"].as_str().unwrap_or("?"),
        j["path"].as_str().unwrap_or("?"),
        j["bf16"].as_str().unwrap_or("?"),
        t.render(),
        peaks["mhz"].as_f64().unwrap_or(0.0),
        peaks["cpuinfo_mhz"].as_f64().unwrap_or(0.0),
        p.join(", "),
        measured.join(", "),
    )
}

fn row_of(lesson: &'static str, preset: &str, ranks: usize, r: &Value, warmup: u64) -> anyhow::Result<Row> {
    let f = |v: &Value| v.as_f64().unwrap_or(0.0);
    let mut secs: Vec<f64> = r["step_seconds"].as_array().map(|a| a.iter().map(f).collect()).unwrap_or_default();
    secs.drain(..(warmup as usize).min(secs.len()));
    anyhow::ensure!(!secs.is_empty(), "no measured steps");
    let mut sorted = secs.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    let steps = f(&r["steps"]).max(1.0);
    let tokens = f(&r["tokens_per_step"]);
    let traffic = r["traffic"].as_object().cloned().unwrap_or_default();
    let comm: f64 =
        traffic.iter().filter(|(k, _)| k.as_str() != "control").map(|(_, v)| f(&v["seconds"])).sum::<f64>() / steps;
    let expected = r["expected_bytes_per_step"].as_object().cloned().unwrap_or_default();
    let bytes = traffic
        .iter()
        .filter(|(k, v)| k.as_str() != "control" && f(&v["calls"]) > 0.0)
        .map(|(k, v)| (k.clone(), (f(&v["bytes_sent"]) / steps) as u64, expected.get(k).and_then(Value::as_u64)))
        .collect();
    let max = |key: &str| r[key].as_array().map_or(0, |a| a.iter().filter_map(Value::as_u64).max().unwrap_or(0));
    // nanoGPT's estimate: 6 FLOPs per parameter per token (forward 2, backward 4),
    // plus attention's 12·L·T·C; position embeddings do no matmul.
    let cfg = fsdp_gpt::GptConfig::preset(preset, 65)?;
    let params = f(&r["params"]) - (cfg.block_size * cfg.n_embd) as f64;
    let seq: f64 = shape(preset).1.parse().unwrap_or(64.0);
    let flops_per_token = 6.0 * params + 12.0 * cfg.n_layer as f64 * seq * cfg.n_embd as f64;
    Ok(Row {
        lesson,
        preset: preset.to_string(),
        ranks,
        ms_per_step: median * 1e3,
        tokens_per_s: tokens / median,
        comm_ms: comm * 1e3,
        bytes,
        peak_heap: max("measured_peak_bytes"),
        tally: r["tally_expected_peak_bytes"].as_u64().unwrap_or(0),
        rss: max("peak_rss_bytes"),
        flops_per_step: flops_per_token * tokens,
    })
}

/// A row of bench.json, for redrawing the plots (the bytes are not kept there).
fn row_from_json(r: &Value) -> Option<Row> {
    let lesson = LESSONS.iter().map(|l| l.0).find(|l| r["lesson"].as_str() == Some(*l))?;
    Some(Row {
        lesson,
        preset: r["preset"].as_str()?.to_string(),
        ranks: r["ranks"].as_u64()? as usize,
        ms_per_step: r["ms_per_step"].as_f64()?,
        tokens_per_s: r["tokens_per_second"].as_f64()?,
        comm_ms: r["comm_ms_per_step"].as_f64()?,
        bytes: vec![],
        peak_heap: r["peak_heap_bytes"].as_u64()?,
        tally: r["tally_bytes"].as_u64()?,
        rss: r["peak_rss_bytes"].as_u64()?,
        flops_per_step: r["flops_per_step"].as_f64()?,
    })
}

fn table(rows: &[Row], peak: f64, bf16: &Bf16Rate) -> String {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // The native route's own instruction, where it runs; the emulation runs f32 FMAs.
    let instruction = match bf16.route.contains("vdpbf16ps") {
        true => bf16.instruction["vdpbf16ps zmm"].as_f64().map(|p| (p, "VDPBF16PS")),
        false => None,
    };
    let against = match instruction {
        Some((p, name)) => {
            format!(", {:.0}% of {name}'s own peak measured here ({:.1} GFLOP/s)", 100.0 * bf16.flops / p, p / 1e9)
        }
        None => String::new(),
    };
    let mut s = format!(
        "CPU: {}. This machine's single-thread f32 matmul rate (the model's own kernel, 1024³, best of 5, measured before the first run and after each; the highest): **{:.1} GFLOP/s**; its bf16 rate the same way (route: {}): **{:.1} GFLOP/s**{against}; one compute thread per rank; {cores} cores. \
         \"% of matmul peak\": the model FLOPs of a step (6 per parameter per token + attention) per second, per busy core, against that rate (the bf16 rate for the bf16 rows). \
         \"recompute\": activation checkpointing, block by block (lesson 03 and ZeRO-3 always recompute); compare rows of one policy.\n\n",
        cpu_model(),
        peak / 1e9,
        bf16.route,
        bf16.flops / 1e9
    );
    s.push_str(
        "| lesson | preset | ranks | ms / step | tokens / s | comm ms / step | compute ms / step | bytes sent / step / rank (theory) | peak heap / rank (tally) | measured / tally | peak RSS / rank | % of matmul peak |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let bytes: Vec<String> = r
            .bytes
            .iter()
            .map(|(k, b, e)| match e {
                Some(e) if e == b => format!("{k} {} (= theory)", thousands(*b)),
                Some(e) => format!("{k} {} (theory {})", thousands(*b), thousands(*e)),
                None => format!("{k} {}", thousands(*b)),
            })
            .collect();
        // Per core busy: N ranks share min(N, cores) cores, one thread each.
        let achieved = r.flops_per_step / (r.ms_per_step / 1e3) / r.ranks.min(cores) as f64;
        s.push_str(&format!(
            "| {} | {} | {} | {:.1} | {} | {:.1} | {:.1} | {} | {:.1} MB ({:.1} MB) | {:.3} | {:.1} MiB | {:.0}% |\n",
            r.lesson,
            r.preset,
            r.ranks,
            r.ms_per_step,
            thousands(r.tokens_per_s as u64),
            r.comm_ms,
            (r.ms_per_step - r.comm_ms).max(0.0),
            if bytes.is_empty() { "—".to_string() } else { bytes.join("; ") },
            r.peak_heap as f64 / 1e6,
            r.tally as f64 / 1e6,
            r.peak_heap as f64 / r.tally.max(1) as f64,
            r.rss as f64 / (1 << 20) as f64,
            100.0 * achieved / if r.lesson.contains("bf16") { bf16.flops } else { peak }
        ));
    }
    s
}

/// The CPU as /proc/cpuinfo names it, with its family and model numbers and
/// its widest vector path: a virtual machine's name ("AMD EPYC") is often
/// all it says, and the same name covers a Zen 3 (family 25) and a Zen 5 (26).
fn cpu_model() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |key: &str| cpuinfo_field(&info, key);
    let name = field("model name").map_or("unknown".into(), |n| n.trim().to_string());
    let (family, model) = (field("cpu family").unwrap_or("?").trim(), field("model").unwrap_or("?").trim());
    format!("{name} (family {family}, model {model}; {})", fsdp_gpt::kernels::Isa::available()[0].name())
}

/// The value of the first `key : value` line of /proc/cpuinfo's text (the first CPU's).
fn cpuinfo_field<'a>(info: &'a str, key: &str) -> Option<&'a str> {
    info.lines().find(|l| l.split(':').next().is_some_and(|k| k.trim() == key)).and_then(|l| l.split(':').nth(1))
}

fn thousands(n: u64) -> String {
    fsdp_harness::table::thousands(n)
}

/// The machine a figure was measured on, for its axis label.
fn machine(cpu: &str, matmul_peak: f64) -> String {
    format!("ranks · {cpu}, single-thread matmul {:.1} GFLOP/s", matmul_peak / 1e9)
}

/// The two figures; `x_label` names the machine (figures from two machines are not comparable).
fn plots(rows: &[Row], out: &Path, x_label: &str) -> anyhow::Result<()> {
    // One colour per scheme and precision, one per entry of LESSONS (the array's length is checked).
    let colors: [&str; LESSONS.len()] = [
        "#1f77b4", "#1f77b4", "#ff7f0e", "#ff7f0e", "#2ca02c", "#d62728", "#d62728", "#9467bd", "#9467bd", "#8c564b",
        "#e377c2", "#17becf",
    ];
    let presets: Vec<String> = rows.iter().map(|r| r.preset.clone()).fold(vec![], |mut v, p| {
        if !v.contains(&p) {
            v.push(p);
        }
        v
    });
    let chart = |title: &str, y: &str, pick: &dyn Fn(&Row) -> f64, preset: &str| Chart {
        title: format!("{title} · {preset}"),
        x_label: x_label.into(),
        y_label: y.into(),
        series: LESSONS
            .iter()
            .enumerate()
            .map(|(i, (lesson, _, _))| Series {
                name: lesson.to_string(),
                color: colors[i],
                points: rows
                    .iter()
                    .filter(|r| r.lesson == *lesson && r.preset == preset)
                    .map(|r| (r.ranks as f64, pick(r)))
                    .collect(),
                dashed: lesson.contains("recompute"), // the same colour per scheme; dashed: recomputed
            })
            .collect(),
        y_from_zero: true, // amounts: a bar from zero, not from the smallest
        ..Default::default()
    };
    let tps: Vec<Chart> =
        presets.iter().map(|p| chart("tokens/s, all ranks", "tokens / s", &|r| r.tokens_per_s, p)).collect();
    let mem: Vec<Chart> =
        presets.iter().map(|p| chart("peak heap per rank", "MB", &|r| r.peak_heap as f64 / 1e6, p)).collect();
    std::fs::write(out.join("tokens_per_second.svg"), svg(&tps))?;
    std::fs::write(out.join("memory_per_rank.svg"), svg(&mem))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The measured clock is a plausible one: an x86 core that ran two or
    /// more of the chain's additions per cycle (the measurement's one
    /// assumption) would give 7 GHz or more, a timer or loop gone wrong
    /// anything at all, a run the scheduler kept interrupting well under a
    /// GHz.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_add_chain_measures_a_plausible_clock() {
        let ghz = super::clock_hz() / 1e9;
        assert!((0.8..7.0).contains(&ghz), "measured clock {ghz:.2} GHz");
    }
}
