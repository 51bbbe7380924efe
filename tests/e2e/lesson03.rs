//! Lesson 03, layer-wise shard: one unit unsharded at a time, the same bits
//! as lesson 01, and a measured peak below lesson 02's.
use crate::common::*;

const PKG: &str = "step03-layerwise-shard";

/// The report at N = 1..4: units, unsharded peak, tally, traffic, digest.
#[test]
fn report_is_pinned_at_1_to_4_ranks() {
    for n in 1..=4 {
        let (o, _) = mpirun(PKG, n, FAST, &format!("l03-report-{n}"));
        insta::assert_snapshot!(format!("report_{n}_ranks"), deterministic(&ok_stdout(&o)));
    }
}

/// Lesson 03's final weights equal lesson 01's bit for bit at N = 1, 2, 3,
/// 4, 8 — weights files byte-identical — and so do its variants: prefetch,
/// two or three blocks per unit, the lm_head gradient kept or the head
/// recomputed (at this shape B·T < V, so the default recomputes it).
#[test]
fn bitwise_equal_to_lesson_01_at_1_2_3_4_8_ranks() {
    for n in [1usize, 2, 3, 4, 8] {
        let (o, dp) = mpirun("step01-data-parallel", n, FAST, &format!("l03-vs-01-dp-{n}"));
        ok_stdout(&o);
        let dp_weights = std::fs::read(dp.join("weights.safetensors")).unwrap();
        let variants: &[&[&str]] = match n {
            2 => &[&[], &["--prefetch"], &["--blocks-per-unit", "2"], &["--head-grad", "keep"]],
            4 => &[&[], &["--prefetch", "--blocks-per-unit", "3"], &["--head-grad", "keep", "--prefetch"]],
            _ => &[&[]],
        };
        for (i, extra) in variants.iter().enumerate() {
            let args: Vec<&str> = FAST.iter().chain(extra.iter()).copied().chain(["--no-plot"]).collect();
            let (o, out) = mpirun(PKG, n, &args, &format!("l03-vs-01-{n}-{i}"));
            ok_stdout(&o);
            assert_eq!(digest(&dp), digest(&out), "N = {n} {extra:?}");
            assert!(
                dp_weights == std::fs::read(out.join("weights.safetensors")).unwrap(),
                "N = {n} {extra:?}: weights files differ"
            );
        }
    }
}

/// `--check` runs lesson 02 beside it: the weights agree exactly at every step.
#[test]
fn check_sees_zero_divergence_every_step() {
    let args: Vec<&str> = FAST.iter().copied().chain(["--check", "--no-plot"]).collect();
    let (o, out) = mpirun(PKG, 3, &args, "l03-check");
    let stdout = ok_stdout(&o);
    assert!(stdout.contains("max |layer-wise − whole-model| = 0.00e+00 over 3 steps"), "{stdout}");
    let div: Vec<f64> = report(&out)["divergence"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    assert_eq!(div, vec![0.0; 3]);
    // With the figure asked for: --check's whole-model copy would count in lesson 03's
    // heap, so the memory timeline is not drawn, and the run says so.
    let args: Vec<&str> = FAST.iter().copied().chain(["--check"]).collect();
    let (o, out) = mpirun(PKG, 2, &args, "l03-check-plot");
    let stdout = ok_stdout(&o);
    assert!(stdout.contains("memory timeline: not drawn under --check"), "{stdout}");
    assert!(!out.join("memory_timeline.svg").exists() && !out.join("memory_timeline.json").exists());
}

/// Every unit is gathered twice and reduce-scattered once per step — the
/// root a third time when the head is recomputed: the counted bytes equal
/// (N − 1) · shard · 4 per collective call, summed — and at 2 ranks the
/// all-gathers move exactly twice lesson 02's when the head is not recomputed.
#[test]
fn traffic_is_two_gathers_and_one_reduce_scatter_per_unit() {
    for n in [2usize, 3] {
        for (head, root_gathers) in [("keep", 2), ("recompute", 3)] {
            let args: Vec<&str> = FAST.iter().copied().chain(["--no-plot", "--head-grad", head]).collect();
            let (o, out) = mpirun(PKG, n, &args, &format!("l03-traffic-{n}-{head}"));
            ok_stdout(&o);
            let r = report(&out);
            assert_eq!(r["head_grad"], head);
            let steps = r["steps"].as_u64().unwrap();
            let units = r["units"].as_array().unwrap();
            let shard = |u: &serde_json::Value| (n as u64 - 1) * u["shard"].as_u64().unwrap() * 4;
            let per_unit: u64 = units.iter().map(shard).sum();
            let root = shard(&units[0]);
            let gathers = 2 * units.len() as u64 + root_gathers - 2;
            let t = &r["traffic"];
            assert_eq!(t["all_gather"]["calls"].as_u64().unwrap(), gathers * steps, "{head}");
            assert_eq!(
                t["all_gather"]["bytes_sent"].as_u64().unwrap(),
                (2 * per_unit + (root_gathers - 2) * root) * steps,
                "{head}"
            );
            assert_eq!(t["reduce_scatter"]["calls"].as_u64().unwrap(), units.len() as u64 * steps);
            assert_eq!(t["reduce_scatter"]["bytes_sent"].as_u64().unwrap(), per_unit * steps);
            if n == 2 && head == "keep" {
                let sent = t["all_gather"]["bytes_sent"].as_u64().unwrap() / steps;
                assert_eq!(sent, 2 * 1_619_712, "tiny at 2 ranks: twice lesson 02's all-gather (1,619,712 bytes)");
            }
        }
    }
}

/// Where the tied `wte`'s lm_head gradient waits: kept, it costs (V, C) per
/// micro-batch; with the head recomputed, the head's input (B, T, C). At
/// the default 8 × 64 tokens the input is larger, so the default keeps the
/// gradient; forcing the recompute raises the measured peak by what the
/// tally says, and changes no bit.
#[test]
fn head_grad_holds_the_smaller_buffer() {
    let base = ["--steps", "2", "--micro-batches", "8", "--no-plot"];
    let run = |extra: &[&str], name: &str| {
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        let (o, out) = mpirun(PKG, 2, &args, name);
        (ok_stdout(&o), out)
    };
    let (stdout, auto) = run(&[], "l03-head-auto");
    assert!(stdout.contains("its lm_head part kept: (V, C) = 65 × 128 per micro-batch"), "{stdout}");
    let (_, keep) = run(&["--head-grad", "keep"], "l03-head-keep");
    let (stdout, rc) = run(&["--head-grad", "recompute"], "l03-head-recompute");
    assert!(stdout.contains("the head recomputed at the end: input (B, T, C) = 8 × 64 × 128"), "{stdout}");
    assert_eq!(digest(&auto), digest(&keep));
    assert_eq!(digest(&keep), digest(&rc));
    let peak = |out: &std::path::Path| report(out)["measured_peak_bytes"][0].as_f64().unwrap();
    let tally = |out: &std::path::Path| report(out)["tally_expected_peak_bytes"].as_f64().unwrap();
    assert_eq!(peak(&auto), peak(&keep));
    // 4 micro-batches per rank, each holding (B·T − V)·C more f32: 915,456 bytes.
    let (more, predicted) = (peak(&rc) - peak(&keep), tally(&rc) - tally(&keep));
    assert_eq!(predicted, (4 * (8 * 64 - 65) * 128 * 4) as f64);
    assert!((more / predicted - 1.0).abs() < 0.02, "measured {more} B more, the tallies say {predicted}");
}

/// The point of the lesson, measured: the timeline of one step has a gather
/// and a free per unit use, and its peak heap is well under lesson 02's; the
/// peak over the whole run too.
#[test]
fn measured_peak_is_below_lesson_02() {
    let (o, out3) = mpirun(PKG, 2, FAST, "l03-peak");
    ok_stdout(&o);
    let (o, out2) =
        mpirun("step02-whole-model-shard", 2, &[FAST, &["--no-check", "--no-plot"]].concat(), "l03-peak-02");
    ok_stdout(&o);
    let tl: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out3.join("memory_timeline.json")).unwrap()).unwrap();
    let peak = |events: &serde_json::Value| {
        events.as_array().unwrap().iter().map(|e| e["peak_bytes"].as_u64().unwrap()).max().unwrap()
    };
    let gathers = tl["layerwise"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["label"].as_str().unwrap().starts_with("gather "))
        .count();
    assert_eq!(gathers, 11, "root and 4 blocks, twice each; the root again, for the head (B·T < V here)");
    let (whole, layerwise) = (peak(&tl["whole_model"]), peak(&tl["layerwise"]));
    assert!(layerwise * 10 < whole * 8, "one step: lesson 03 peaks at {layerwise} bytes, lesson 02 at {whole}");
    let run_peak = |out: &std::path::Path| report(out)["measured_peak_bytes"][0].as_u64().unwrap();
    let (p2, p3) = (run_peak(&out2), run_peak(&out3));
    assert!(p3 < p2, "whole run: lesson 03 {p3} bytes, lesson 02 {p2}");
    assert!(out3.join("memory_timeline.svg").exists());
}

/// Between machines Open MPI talks TCP; here over the loopback interface.
/// The bits do not depend on the transport: the reductions are ours.
#[test]
fn tcp_between_ranks_gives_the_same_digest_as_shared_memory() {
    let (o, shm) = mpirun(PKG, 2, FAST, "l03-shm");
    ok_stdout(&o);
    let (cmd, tcp) = mpirun_command(PKG, 2, FAST, "l03-tcp");
    // The transport flags go before the binary: rebuild the command with them.
    let args: Vec<std::ffi::OsString> = cmd.get_args().map(|a| a.to_os_string()).collect();
    let mut with_tcp = std::process::Command::new("mpirun");
    with_tcp.args(["--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo"]).args(&args);
    for (k, v) in cmd.get_envs() {
        if let Some(v) = v {
            with_tcp.env(k, v);
        }
    }
    ok_stdout(&with_tcp.output().unwrap());
    assert_eq!(digest(&shm), digest(&tcp));
    let tcp_traffic = report(&tcp)["traffic"].clone();
    assert_eq!(tcp_traffic["all_gather"]["bytes_sent"], report(&shm)["traffic"]["all_gather"]["bytes_sent"]);
}
