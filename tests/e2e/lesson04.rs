//! Lesson 04, optimizer-state shard: ZeRO stages 1, 2, 3 give lesson 01's
//! bits under the same precision; the tallies, the bf16 wire bytes, the
//! memory budget and `zero-tally`.
use crate::common::*;

const PKG: &str = "step04-optimizer-state-shard";

fn with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    FAST.iter().copied().chain(extra.iter().copied()).collect()
}

/// Every stage equals lesson 01 bit for bit, under fp32 and under bf16, at
/// N = 1, 2, 3, 4, stages 1 and 2 also under `--recompute`, stage 3 with
/// the head recomputed or its gradient kept — the weights files byte-identical.
#[test]
fn every_stage_equals_lesson_01_under_both_precisions() {
    for precision in ["fp32", "bf16"] {
        for n in 1..=4usize {
            let (o, dp) = mpirun(
                "step01-data-parallel",
                n,
                &with(&["--precision", precision]),
                &format!("l04-dp-{precision}-{n}"),
            );
            ok_stdout(&o);
            let dp_weights = std::fs::read(dp.join("weights.safetensors")).unwrap();
            // Stages 1 and 2 with and without recompute; stage 3 always
            // recomputes, and its head too at this shape (B·T < V), or not.
            let stages = [
                &["1"][..],
                &["2"],
                &["3"],
                &["3", "--head-grad", "keep"],
                &["1", "--recompute"],
                &["2", "--recompute"],
            ];
            for stage in stages {
                let mut args = with(&["--precision", precision, "--stage"]);
                args.extend_from_slice(stage);
                let name = format!("l04-{precision}-{n}-{}", stage.join(""));
                let (o, out) = mpirun(PKG, n, &args, &name);
                ok_stdout(&o);
                assert_eq!(digest(&dp), digest(&out), "{precision}, N = {n}, stage {stage:?}");
                assert!(
                    dp_weights == std::fs::read(out.join("weights.safetensors")).unwrap(),
                    "{precision}, N = {n}, stage {stage:?}: weights files differ"
                );
            }
        }
    }
    // bf16 computes something else than fp32 (the test above is not vacuous).
    assert_ne!(digest(&scratch().join("test-out/l04-dp-fp32-2")), digest(&scratch().join("test-out/l04-dp-bf16-2")));
}

/// The report of each stage at 4 ranks, and of stage 3 at 1–3 ranks: the
/// side-by-side table, the tally, the traffic, the digest.
#[test]
fn reports_are_pinned() {
    for (n, stage) in [(4, "1"), (4, "2"), (4, "3"), (1, "3"), (2, "3"), (3, "3")] {
        let (o, _) = mpirun(PKG, n, &with(&["--stage", stage]), &format!("l04-report-{n}-{stage}"));
        insta::assert_snapshot!(format!("report_stage_{stage}_{n}_ranks"), deterministic(&ok_stdout(&o)));
    }
}

/// Under bf16 the all-gathers move 2 bytes per element, half of fp32's; the
/// gradient is reduced in fp32 either way. Stage 3 gathers each unit twice,
/// stages 1 and 2 once (the new weights).
#[test]
fn bf16_halves_the_all_gather_bytes() {
    let sent = |stage: &str, precision: &str| {
        // The root gathered twice at stage 3: its lm_head gradient kept, not the head recomputed.
        let mut args = with(&["--stage", stage, "--precision", precision]);
        if stage == "3" {
            // the root gathered twice: its lm_head gradient kept, not the head recomputed
            args.extend(["--head-grad", "keep"]);
        }
        let (o, out) = mpirun(PKG, 2, &args, &format!("l04-bytes-{stage}-{precision}"));
        ok_stdout(&o);
        let r = report(&out);
        let steps = r["steps"].as_u64().unwrap();
        (
            r["traffic"]["all_gather"]["bytes_sent"].as_u64().unwrap() / steps,
            r["traffic"]["reduce_scatter"]["bytes_sent"].as_u64().unwrap() / steps,
        )
    };
    let (g32, r32) = sent("3", "fp32");
    let (g16, r16) = sent("3", "bf16");
    assert_eq!((g32, r32), (2 * 1_619_712, 1_619_712), "tiny at 2 ranks: (N−1)/N of 809,856 fp32 elements per gather");
    assert_eq!((g16, r16), (g32 / 2, r32));
    let (g1, r1) = sent("1", "bf16");
    assert_eq!((g1, r1), (g16 / 2, r16));
}

/// `--reduce-dtype bf16`: the reduce-scatter moves 2 bytes per element, half
/// of fp32's to the byte, and every sum of the pairwise tree is rounded to
/// bf16 wherever it is formed — so the bits are the same at 1, 2 and 4 ranks,
/// with the reduce-scatter on the stream (`--prefetch`), and at stages 1 and
/// 2, and differ from the fp32 reduction's.
#[test]
fn a_bf16_reduction_halves_the_reduce_scatter_and_keeps_one_order() {
    let run = |n: usize, extra: &[&str], name: &str| {
        let (o, out) = mpirun(PKG, n, &with(extra), name);
        ok_stdout(&o);
        let r = report(&out);
        let per_step = r["traffic"]["reduce_scatter"]["bytes_sent"].as_u64().unwrap() / r["steps"].as_u64().unwrap();
        let expected = r["expected_bytes_per_step"]["reduce_scatter"].as_u64().unwrap();
        assert_eq!(per_step, expected, "{name}: the bytes against theory");
        (digest(&out), per_step)
    };
    let (fp32, bytes32) = run(2, &[], "l04-reduce-fp32");
    let (bf16, bytes16) = run(2, &["--reduce-dtype", "bf16"], "l04-reduce-bf16-2");
    assert_eq!(bytes16 * 2, bytes32, "half the bytes");
    assert_ne!(bf16, fp32, "rounding each sum to bf16 changes the weights");
    for (n, extra, name) in [
        (1, &["--reduce-dtype", "bf16"][..], "l04-reduce-bf16-1"),
        (4, &["--reduce-dtype", "bf16"], "l04-reduce-bf16-4"),
        (2, &["--reduce-dtype", "bf16", "--prefetch"], "l04-reduce-bf16-stream"),
        (2, &["--reduce-dtype", "bf16", "--stage", "1"], "l04-reduce-bf16-s1"),
        (4, &["--reduce-dtype", "bf16", "--stage", "2", "--overlap-comm"], "l04-reduce-bf16-s2"),
    ] {
        assert_eq!(run(n, extra, name).0, bf16, "{name}");
    }
}

/// The gradient reduction's bf16 rounding (`fsdp_comm`, which does not
/// depend on the model's crate) and the model's give the same bits for
/// every rounding case of every exponent and sign, NaNs included.
#[test]
fn the_reductions_bf16_rounding_is_the_models() {
    let lows = [0u32, 1, 0x3FFF, 0x7FFF, 0x8000, 0x8001, 0xFFFF];
    for high in 0..=0xFFFFu32 {
        for low in lows {
            let x = f32::from_bits(high << 16 | low);
            assert_eq!(fsdp_comm::reduce::bf16_bits(x), fsdp_gpt::precision::to_bf16(x).to_bits(), "{x:e}");
        }
    }
}

/// The side-by-side totals fall stage by stage, and so does the heap the
/// allocator measured: ZeRO-3 peaks below data parallelism.
#[test]
fn memory_falls_stage_by_stage() {
    let (o, out) = mpirun(PKG, 4, &with(&["--stage", "3"]), "l04-falls-3");
    ok_stdout(&o);
    let r = report(&out);
    let totals: Vec<u64> = r["side_by_side_bytes"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert!(totals.windows(2).all(|w| w[0] > w[1]), "data parallel > ZeRO-1 > ZeRO-2 > ZeRO-3: {totals:?}");
    let (o, dp) = mpirun("step01-data-parallel", 4, &with(&["--precision", "bf16"]), "l04-falls-dp");
    ok_stdout(&o);
    let peak = |out: &std::path::Path| report(out)["measured_peak_bytes"][0].as_u64().unwrap();
    assert!(peak(&out) < peak(&dp), "measured: ZeRO-3 {} bytes, data parallel {}", peak(&out), peak(&dp));
}

/// "Doesn't fit → fits": under one budget per rank, data parallelism runs
/// out of memory — one line, exit 2, every rank ended — and ZeRO-3 trains.
#[test]
fn a_budget_that_data_parallel_exceeds_and_zero_3_fits() {
    let args = [
        "--preset",
        "small",
        "--batch-size",
        "2",
        "--seq-len",
        "64",
        "--micro-batches",
        "4",
        "--steps",
        "1",
        "--mem-budget",
        "150MB",
    ];
    let (o, _) = mpirun("step01-data-parallel", 4, &[&args[..], &["--precision", "bf16"]].concat(), "l04-fits-dp");
    let (code, lines) = failure(&o);
    assert_eq!(code, 2, "{lines:?}");
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].starts_with("error: out of memory on rank 0: needed ") && lines[0].contains("budget 150.00 MB, live "),
        "{}",
        lines[0]
    );
    let (o, out) = mpirun(PKG, 4, &[&args[..], &["--stage", "3"]].concat(), "l04-fits-z3");
    ok_stdout(&o);
    assert!(report(&out)["measured_peak_bytes"].as_array().unwrap().iter().all(|p| p.as_u64().unwrap() <= 150_000_000));
}

/// `just tally 7B 64`: the paper's numbers, exactly.
#[test]
fn zero_tally_scales_to_7b() {
    let o = std::process::Command::new(binary("zero-tally")).args(["7B", "64"]).output().unwrap();
    let stdout = ok_stdout(&o);
    for row in [
        "│ data parallel │    (2 + 2 + K)·Ψ │                 16.000 │      112.00 │          no │",
        "│ ZeRO-3        │  (2 + 2 + K)·Ψ/N │                  0.250 │        1.75 │         yes │",
    ] {
        assert!(stdout.contains(row), "{stdout}");
    }
    insta::assert_snapshot!(stdout);
    // Hybrid sharding: 70B over groups of 8 is 16 B × 70e9 / 8 = 140 GB at stage 3 (does not fit 80 GB),
    // and ZeRO-3's traffic: 3·7/8 + 2·(31/32)/8 Ψ sent per device, 2·(31/32)/8 Ψ of it across groups;
    // across one group's boundary 2·31/32 Ψ against full sharding's 3·31/32 Ψ.
    let o = std::process::Command::new(binary("zero-tally")).args(["70B", "256", "--hsdp", "8"]).output().unwrap();
    let hsdp = ok_stdout(&o);
    let line = |text: &str, start: &str| text.lines().find(|l| l.contains(start)).unwrap_or_default().to_string();
    let z3 = line(&hsdp, "│ HSDP, ZeRO-3");
    assert!(z3.contains(" 2.000 │") && z3.contains("140.00") && z3.ends_with("no │"), "{hsdp}");
    let split = line(&hsdp, "│ HSDP, S = 8");
    assert!(split.contains("2.867 Ψ") && split.contains("0.242 Ψ") && split.contains("1.938 Ψ"), "{hsdp}");
    let full = line(&hsdp, "│ sharded over all N");
    assert!(full.contains("2.988 Ψ") && full.contains("2.906 Ψ"), "{hsdp}");
    // Offload: ZeRO-3's device keeps (2 + 2)·Ψ/N = 4.375 GB, the host 12·Ψ/N = 13.125 GB.
    let o = std::process::Command::new(binary("zero-tally")).args(["70B", "64", "--offload"]).output().unwrap();
    let offload = ok_stdout(&o);
    let z3 = line(&offload, "│ ZeRO-3");
    assert!(z3.contains("4.38") && z3.contains("13.12") && z3.ends_with("yes │"), "{offload}");
    let o = std::process::Command::new(binary("zero-tally")).args(["70B", "256", "--hsdp", "7"]).output().unwrap();
    let (code, lines) = failure(&o);
    assert_eq!((code, lines.len()), (2, 1), "{lines:?}");
    assert!(lines[0].contains("--hsdp 7 does not divide 256 ranks"), "{}", lines[0]);
    let o = std::process::Command::new(binary("zero-tally")).args(["7Q", "2"]).output().unwrap();
    let (code, lines) = failure(&o);
    assert_eq!((code, lines.len()), (2, 1), "{lines:?}");
    assert!(lines[0].contains("`7Q` is not a parameter count"), "{}", lines[0]);
    // The count printed is the count used: exact up to 2^53, refused beyond, whole numbers only.
    for (count, exact) in [("1.5e15", "1,500,000,000,000,000"), ("1.07B", "1,070,000,000"), ("4.1M", "4,100,000")] {
        let o = std::process::Command::new(binary("zero-tally")).args([count, "64"]).output().unwrap();
        assert!(ok_stdout(&o).contains(&format!("Ψ = {exact} parameters")), "{count}");
    }
    for (count, says) in [
        ("1e30", "`1e30` is more parameters than the tally counts exactly (at most 2^53"),
        ("2.5", "`2.5` is not a whole number of parameters"),
        ("-7B", "`-7B` is not a parameter count"),
    ] {
        let o = std::process::Command::new(binary("zero-tally")).args([count, "64"]).output().unwrap();
        let (code, lines) = failure(&o);
        assert_eq!((code, lines.len()), (2, 1), "{count}: {lines:?}");
        assert!(lines[0].contains(says), "{count}: {}", lines[0]);
    }
}
