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
/// two or three blocks per unit.
#[test]
fn bitwise_equal_to_lesson_01_at_1_2_3_4_8_ranks() {
    for n in [1usize, 2, 3, 4, 8] {
        let (o, dp) = mpirun("step01-data-parallel", n, FAST, &format!("l03-vs-01-dp-{n}"));
        ok_stdout(&o);
        let dp_weights = std::fs::read(dp.join("weights.safetensors")).unwrap();
        let variants: &[&[&str]] = match n {
            2 => &[&[], &["--prefetch"], &["--blocks-per-unit", "2"]],
            4 => &[&[], &["--prefetch", "--blocks-per-unit", "3"]],
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
}

/// Every unit is gathered twice and reduce-scattered once per step: the
/// counted bytes equal (N − 1) · shard · 4 per collective call, summed — and
/// at 2 ranks the all-gathers move exactly twice lesson 02's.
#[test]
fn traffic_is_two_gathers_and_one_reduce_scatter_per_unit() {
    for n in [2usize, 3] {
        let (o, out) = mpirun(PKG, n, FAST, &format!("l03-traffic-{n}"));
        ok_stdout(&o);
        let r = report(&out);
        let steps = r["steps"].as_u64().unwrap();
        let units = r["units"].as_array().unwrap();
        let per_unit: u64 = units.iter().map(|u| (n as u64 - 1) * u["shard"].as_u64().unwrap() * 4).sum();
        let t = &r["traffic"];
        assert_eq!(t["all_gather"]["calls"].as_u64().unwrap(), 2 * units.len() as u64 * steps);
        assert_eq!(t["all_gather"]["bytes_sent"].as_u64().unwrap(), 2 * per_unit * steps);
        assert_eq!(t["reduce_scatter"]["calls"].as_u64().unwrap(), units.len() as u64 * steps);
        assert_eq!(t["reduce_scatter"]["bytes_sent"].as_u64().unwrap(), per_unit * steps);
        if n == 2 {
            assert_eq!(2 * per_unit, 2 * 1_619_712, "tiny at 2 ranks: twice lesson 02's all-gather (1,619,712 bytes)");
        }
    }
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
    assert_eq!(gathers, 10, "root and 4 blocks, twice each");
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
