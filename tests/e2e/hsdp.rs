//! Hybrid sharding (`--hsdp S`, lessons 03 and 04): shard within groups of S
//! consecutive ranks, all-reduce each gradient shard across the N/S groups.
//! The weights are lesson 01's bit for bit; every collective runs over its
//! group and sends what the formulas say; `just tally … --hsdp S` gives the
//! same bytes per step as a run; its checkpoints are written by the first
//! shard group and resume at another S or N; a value of S that cannot keep
//! those promises is refused in one line.
use crate::common::*;

const L03: &str = "step03-layerwise-shard";
const L04: &str = "step04-optimizer-state-shard";

fn with<'a>(base: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
    base.iter().chain(extra).copied().collect()
}

/// At 4 ranks (S = 2): lesson 03 — clipped, the norm summed over the shard
/// group only, and with `--prefetch` — and lesson 04's three stages in fp32
/// (ZeRO-2 with `--overlap-comm` too); at 8 ranks (S = 2, 4): lesson 03 and
/// ZeRO-3. Each gives lesson 01's final weights, file byte for byte; in
/// bf16, ZeRO-3 under HSDP gives ZeRO-3's.
#[test]
fn hsdp_equals_lesson_01_bit_for_bit_at_4_and_8_ranks() {
    for (n, shards, clip) in [(4usize, &[2usize][..], true), (8, &[2, 4][..], false)] {
        // FAST's 24 micro-batches split among 4 and 8 ranks
        let base = if clip { with(FAST, &["--grad-clip", "0.5"]) } else { FAST.to_vec() };
        let (o, dp) = mpirun("step01-data-parallel", n, &base, &format!("hsdp-dp-{n}"));
        ok_stdout(&o);
        let want = std::fs::read(dp.join("weights.safetensors")).unwrap();
        for &size in shards {
            let s = size.to_string();
            let mut runs: Vec<(&str, Vec<&str>)> = vec![
                (L03, with(&base, &["--no-plot", "--hsdp", &s])),
                (L04, with(&base, &["--stage", "3", "--precision", "fp32", "--hsdp", &s])),
            ];
            if n == 4 {
                runs.extend([
                    // the overlapped schedules: on the stream's own shard and replica groups
                    (L03, with(&base, &["--no-plot", "--hsdp", &s, "--prefetch"])),
                    (L04, with(&base, &["--stage", "2", "--precision", "fp32", "--hsdp", &s, "--overlap-comm"])),
                    (L04, with(&base, &["--stage", "1", "--precision", "fp32", "--hsdp", &s])),
                    (L04, with(&base, &["--stage", "2", "--precision", "fp32", "--hsdp", &s])),
                ]);
            }
            for (i, (pkg, args)) in runs.iter().enumerate() {
                let (o, out) = mpirun(pkg, n, args, &format!("hsdp-{n}-{size}-{i}"));
                let stdout = ok_stdout(&o);
                assert!(stdout.contains(&format!("HSDP: {} shard group(s) of {size} consecutive rank(s)", n / size)));
                assert_eq!(digest(&dp), digest(&out), "N = {n}, S = {size}: {pkg} {args:?}");
                assert!(want == std::fs::read(out.join("weights.safetensors")).unwrap(), "N = {n}, S = {size}, {pkg}");
            }
        }
    }
    // bf16: ZeRO-3 under HSDP is ZeRO-3, bit for bit (each element rounds the same in any group).
    let (o, full) = mpirun(L04, 4, FAST, "hsdp-bf16-full");
    ok_stdout(&o);
    let (o, hybrid) = mpirun(L04, 4, &with(FAST, &["--hsdp", "2"]), "hsdp-bf16-hsdp");
    ok_stdout(&o);
    assert_eq!(digest(&full), digest(&hybrid));
}

/// Every rank's measured peak heap within 2% of the tally's.
fn within_tally(r: &serde_json::Value) {
    for ratio in tally_ratios(r) {
        assert!((0.98..=1.02).contains(&ratio), "measured peak / tally = {ratio:.3}");
    }
}

/// Bytes per step and rank from report.json, by kind, of one communicator.
fn group(r: &serde_json::Value, name: &str, kind: &str) -> (u64, Option<u64>) {
    let g = &r["traffic_by_group"][name][kind];
    let steps = r["losses"].as_array().unwrap().len() as u64;
    (g["bytes_sent"].as_u64().unwrap() / steps, g["theory_bytes_per_step"].as_u64())
}

/// Lesson 03 at 4 ranks, S = 2: the all-gathers and reduce-scatters run in
/// the shard group and the all-reduce in the replica group, each sending
/// its theory's bytes, blocking or on the stream (`--prefetch`); the totals are their sum; the tally holds the
/// measured heap (the replica all-reduce's buffer included); and
/// `zero-tally 809856 4 --hsdp 2` gives the same bytes per device.
#[test]
fn hsdp_sends_each_collective_over_its_group_as_the_formulas_say() {
    let args = with(FAST, &["--no-plot", "--hsdp", "2", "--grad-clip", "0.5"]);
    let (o, out) = mpirun(L03, 4, &args, "hsdp-traffic");
    let stdout = ok_stdout(&o);
    assert!(stdout.contains("by communicator, per step, rank 0"), "{stdout}");
    let r = report(&out);
    let (shard, replica) = ("shard group (2 ranks)", "replica group (2 ranks)");
    let mut sent = 0;
    for (g, kind) in [(shard, "all_gather"), (shard, "reduce_scatter"), (shard, "grad_norm"), (replica, "all_reduce")] {
        let (bytes, theory) = group(&r, g, kind);
        assert!(bytes > 0 && Some(bytes) == theory, "{g} {kind}: {bytes} sent, theory {theory:?}");
        sent += bytes;
        // Nothing else runs there: the all-reduce only across, the gathers only inside.
        let other = if g == shard { replica } else { shard };
        assert_eq!(group(&r, other, kind).0, 0, "{kind} in the {other}");
    }
    // On the stream (--prefetch): the same bytes, in the same groups.
    let (o, out_p) = mpirun(L03, 4, &with(&args, &["--prefetch"]), "hsdp-traffic-prefetch");
    ok_stdout(&o);
    let rp = report(&out_p);
    for (g, kind) in [(shard, "all_gather"), (shard, "reduce_scatter"), (replica, "all_reduce")] {
        assert_eq!(group(&rp, g, kind), group(&r, g, kind), "--prefetch: {g} {kind}");
    }
    // … and the tally holds the heap with the reductions in flight: lesson 03's
    // peak comes while one is (the replica all-reduce's part a row of its own);
    // ZeRO-2's, whose peak comes before, holds its heap all the same.
    let rows = rp["tally"].as_array().unwrap();
    let part = |row: &serde_json::Value| row["category"].as_str().unwrap().ends_with("replica all-reduce part (fp32)");
    assert!(rows.iter().any(part), "{rows:?}");
    within_tally(&rp);
    let (o, out_z) =
        mpirun(L04, 4, &with(FAST, &["--stage", "2", "--hsdp", "2", "--overlap-comm"]), "hsdp-zero2-overlap");
    ok_stdout(&o);
    within_tally(&report(&out_z));
    let steps = r["losses"].as_array().unwrap().len() as u64;
    let total: u64 = ["all_gather", "reduce_scatter", "all_reduce", "grad_norm"]
        .iter()
        .map(|k| r["traffic"][*k]["bytes_sent"].as_u64().unwrap() / steps)
        .sum();
    assert_eq!(total, sent, "the totals are the groups' sum");
    // The replica all-reduce's receive buffer is a tally row, and the tally holds the heap.
    let rows = r["tally"].as_array().unwrap();
    assert!(rows.iter().any(|row| row["category"] == "replica all-reduce receive buffer"), "{rows:?}");
    within_tally(&r);

    // `just tally`'s formula at the same N and S, in elements of Ψ (2.000 Ψ here:
    // 2 × 1/2 gathered, 1/2 reduce-scattered, 2 × 1/2 / 2 all-reduced), against the
    // run's gathers, reduce-scatter and all-reduce in fp32 bytes (809,856
    // parameters split evenly: no padding; the head is recomputed at this shape,
    // so the root is gathered a third time, which the formula leaves out).
    let o = std::process::Command::new(binary(L04).with_file_name("zero-tally"))
        .args(["809856", "4", "--hsdp", "2"])
        .output()
        .unwrap();
    let text = ok_stdout(&o);
    let row = text.lines().find(|l| l.contains("HSDP, S = 2")).expect("the HSDP row");
    let cells: Vec<&str> = row.split('│').map(str::trim).filter(|c| !c.is_empty()).collect();
    let per_device: f64 = cells[1].trim_end_matches(" Ψ").parse().unwrap();
    assert_eq!(per_device, 2.0, "{row}");
    let root: u64 = r["units"][0]["shard"].as_u64().unwrap();
    let third_root_gather = if r["head_grad"] == "recompute" { root * 4 } else { 0 };
    let ran = group(&r, shard, "all_gather").0 - third_root_gather
        + group(&r, shard, "reduce_scatter").0
        + group(&r, replica, "all_reduce").0;
    assert_eq!(ran as f64, per_device * 809_856.0 * 4.0, "the run's bytes against the tally's formula");
}

/// Values of S that cannot shard evenly or cannot keep lesson 01's bits,
/// and the one combination not built yet (a trace), get one line each.
#[test]
fn bad_hsdp_values_get_one_line() {
    let e = fails(L03, 4, &with(FAST, &["--hsdp", "0"]), "hsdp-0");
    assert_eq!(e, "error: --hsdp 0 does not cut 4 rank(s) into shard groups of equal size: pass one of 1, 2, 4");
    let e = fails(L04, 4, &with(FAST, &["--hsdp", "3"]), "hsdp-3");
    assert_eq!(e, "error: --hsdp 3 does not cut 4 rank(s) into shard groups of equal size: pass one of 1, 2, 4");
    let e = fails(L03, 6, &with(FAST, &["--hsdp", "2"]), "hsdp-6-2");
    assert_eq!(
        e,
        "error: --hsdp 2 on 6 ranks makes 3 replica groups, whose sum is not lesson 01's pairwise tree (the number of replica groups must be a power of two): pass one of 1, 3, 6"
    );
    let trace = out_dir("hsdp-trace-folder");
    let e = fails(L03, 4, &with(FAST, &["--hsdp", "2", "--trace", trace.to_str().unwrap()]), "hsdp-trace");
    assert!(e.starts_with("error: --hsdp is not traced yet"), "{e}");
    let e = fails(L03, 4, &with(FAST, &["--hsdp", "-2"]), "hsdp-negative");
    assert!(e.contains("invalid value '-2' for '--hsdp <S>'"), "{e}");
    // The heartbeat's knob (across machines), checked on every run like the others.
    let e = fails_with_env(L03, 2, FAST, &[("FSDP_HEARTBEAT_TIMEOUT", "0.5")], "hsdp-heartbeat-knob");
    assert!(e.starts_with("error: FSDP_HEARTBEAT_TIMEOUT=0.5: give the seconds of silence"), "{e}");
}

/// An HSDP run's checkpoint holds S shard files (written by the first shard
/// group alone) and resumes, bit for bit, under HSDP at the same N and S,
/// at another N and S, and fully sharded on fewer ranks — where the resume
/// rules promise it (power-of-two world sizes dividing the micro-batches) —
/// and a full-shard checkpoint resumes under HSDP.
#[test]
fn hsdp_checkpoints_hold_one_shard_group_and_resume_at_any_s_and_n() {
    let steps = |n: &'static str| -> Vec<&'static str> {
        let mut v = FAST.to_vec();
        let at = v.iter().position(|a| *a == "--steps").unwrap();
        v[at + 1] = n;
        v.push("--no-plot");
        v
    };
    let (o, dp) = mpirun("step01-data-parallel", 4, &steps("4")[..steps("4").len() - 1], "hsdp-ck-dp");
    ok_stdout(&o);
    let ck = out_dir("hsdp-ck");
    let ck_s = ck.to_str().unwrap();
    let (o, _) = mpirun(L03, 4, &with(&steps("2"), &["--hsdp", "2", "--ckpt", ck_s]), "hsdp-ck-save");
    let stdout = ok_stdout(&o);
    assert!(stdout.contains("(2 shard files, "), "{stdout}");
    let dir = ck.join("step-000002");
    let mut files: Vec<String> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    files.sort();
    assert_eq!(files, ["meta.json", "shard-000-of-002.safetensors", "shard-001-of-002.safetensors"]);
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
    assert_eq!((meta["world_size"].as_u64(), meta["replicas"].as_u64()), (Some(2), Some(2)));
    for (n, extra, name) in [
        (4, &["--hsdp", "2"][..], "hsdp-ck-4-2"),
        (8, &["--hsdp", "4"][..], "hsdp-ck-8-4"),
        (2, &[][..], "hsdp-ck-2-full"),
    ] {
        let args = with(&with(&steps("4"), &["--resume", ck_s]), extra);
        let (o, out) = mpirun(L03, n, &args, name);
        let stdout = ok_stdout(&o);
        assert!(stdout.contains("(step 2, saved by 4 ranks)"), "{name}: {stdout}");
        assert_eq!(digest(&out), digest(&dp), "{name}");
    }
    // And the other way: a full-shard checkpoint of 2 ranks resumes under HSDP on 4.
    let ck2 = out_dir("hsdp-ck-full");
    let ck2_s = ck2.to_str().unwrap();
    let (o, _) = mpirun(L03, 2, &with(&steps("2"), &["--ckpt", ck2_s]), "hsdp-ck-full-save");
    ok_stdout(&o);
    let (o, out) = mpirun(L03, 4, &with(&steps("4"), &["--resume", ck2_s, "--hsdp", "2"]), "hsdp-ck-full-resumed");
    ok_stdout(&o);
    assert_eq!(digest(&out), digest(&dp));
}
