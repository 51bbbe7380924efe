//! `just alpha-beta`'s tool: the α–β fit from an all-gather sweep, and a
//! lesson's communication predicted from its report beside what it measured.
use crate::common::*;

#[test]
fn the_model_is_fitted_and_predicts_a_lessons_bytes() {
    let (o, lesson) = mpirun("step01-data-parallel", 2, FAST, "alpha-beta-lesson");
    ok_stdout(&o);
    let (o, _) =
        mpirun("fsdp-alpha-beta", 2, &["--reps", "5", lesson.join("report.json").to_str().unwrap()], "alpha-beta");
    let out = ok_stdout(&o);
    // α and 1/β: a latency under a millisecond, a bandwidth above 100 MB/s, both positive.
    let line = out.lines().find(|l| l.starts_with("α = ")).expect("the fit's line");
    let after = |key: &str| -> f64 {
        let rest = &line[line.find(key).unwrap_or_else(|| panic!("{key} in {line}")) + key.len()..];
        rest.split_whitespace().next().unwrap().trim_end_matches(',').parse().unwrap()
    };
    let (alpha_us, gbs) = (after("α = "), after("1/β = "));
    assert!(alpha_us > 0.0 && alpha_us < 1000.0 && gbs > 0.1, "{line}");
    // The on-paper table depends on no measurement: its numbers are the formula's.
    for cell in ["7,964,998", "1,196,844", "below 1,923 tokens", "17,307 on InfiniBand"] {
        assert!(out.contains(cell), "{cell}: {out}");
    }
    // The lesson's all-reduce: one call per step of (N − 1)/N · 2 of the padded fp32 gradient.
    let r = report(&lesson);
    let steps = r["steps"].as_u64().unwrap();
    let sent = r["traffic"]["all_reduce"]["bytes_sent"].as_u64().unwrap() / steps;
    assert_eq!(sent, 3_239_424);
    let row = out.lines().find(|l| l.contains(" all_reduce ")).unwrap_or_else(|| panic!("{out}"));
    let cells: Vec<&str> = row.split('│').map(str::trim).collect();
    assert_eq!(&cells[2..5], ["all_reduce", "1.0", "3,239,424"], "{row}");
    // A report from another world size is refused with one line.
    let (o, one) = mpirun("step01-data-parallel", 1, FAST, "alpha-beta-one-rank");
    ok_stdout(&o);
    let (o, _) = mpirun(
        "fsdp-alpha-beta",
        2,
        &["--reps", "5", one.join("report.json").to_str().unwrap()],
        "alpha-beta-mismatch",
    );
    let (code, lines) = failure(&o);
    assert_eq!((code, lines.len()), (2, 1), "{lines:?}");
    assert!(lines[0].contains("ran at 1 ranks, the sweep at 2"), "{}", lines[0]);
}

/// `FSDP_SYNC_COLLECTIVES=1`: a barrier before every collective changes no
/// bit and no byte, and the wait it isolates is recorded.
#[test]
fn synchronised_collectives_change_no_bit_and_record_the_wait() {
    let args = [FAST, &["--no-plot"]].concat();
    let (o, plain) = mpirun("step03-layerwise-shard", 2, &args, "sync-off");
    ok_stdout(&o);
    let (mut cmd, synced) = mpirun_command("step03-layerwise-shard", 2, &args, "sync-on");
    let o = cmd.env("FSDP_SYNC_COLLECTIVES", "1").output().unwrap();
    ok_stdout(&o);
    assert_eq!(digest(&plain), digest(&synced));
    let (a, b) = (report(&plain), report(&synced));
    for kind in ["all_gather", "reduce_scatter"] {
        assert_eq!(a["traffic"][kind]["bytes_sent"], b["traffic"][kind]["bytes_sent"], "{kind}");
        assert_eq!(a["traffic"][kind]["waited_seconds"].as_f64(), Some(0.0), "no barrier, no wait: {kind}");
    }
    let waited: f64 = b["traffic"].as_object().unwrap().values().map(|t| t["waited_seconds"].as_f64().unwrap()).sum();
    assert!(waited > 0.0, "the barriers recorded a wait");
}
