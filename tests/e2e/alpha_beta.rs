//! `just alpha-beta`'s tool: the α–β fit from an all-gather sweep, and a
//! lesson's communication predicted from its report beside what it measured.
use crate::common::*;

#[test]
fn the_model_is_fitted_and_predicts_a_lessons_bytes() {
    let (o, lesson) = mpirun("step01-data-parallel", 2, FAST, "alpha-beta-lesson");
    ok_stdout(&o);
    let report = lesson.join("report.json");
    let (o, _) = mpirun("fsdp-alpha-beta", 2, &["--reps", "5", report.to_str().unwrap()], "alpha-beta");
    let out = ok_stdout(&o);
    // α and 1/β: positive, finite, and the fit passes through the smallest and largest sizes.
    let line = out.lines().find(|l| l.starts_with("α = ")).expect("the fit's line");
    let nums: Vec<f64> = line.split(|c: char| !c.is_ascii_digit() && c != '.').filter_map(|w| w.parse().ok()).collect();
    assert!(nums.len() >= 2 && nums[0] > 0.0 && nums[1] > 0.0, "{line}");
    for size in ["│ 4 ", "│ 4,194,304 "] {
        let row = out.lines().find(|l| l.starts_with(size)).unwrap_or_else(|| panic!("{size}: {out}"));
        assert!(row.trim_end().ends_with("1.00 │"), "the fit passes through {size}: {row}");
    }
    // The lesson's all-reduce: one call per step of (N − 1)/N · 2 of the padded fp32 gradient.
    let r = report_of(&report);
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

fn report_of(path: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}
