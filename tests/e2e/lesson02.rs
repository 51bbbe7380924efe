//! Lesson 02, whole-model shard: 1/N of the master weights per rank, and
//! the same bits as lesson 01.
use crate::common::*;

const PKG: &str = "step02-whole-model-shard";

/// The report at N = 1..4: the classic toy's table, the tally, the digest.
#[test]
fn report_is_pinned_at_1_to_4_ranks() {
    for n in 1..=4 {
        let (o, _) = mpirun(PKG, n, FAST, &format!("l02-report-{n}"));
        insta::assert_snapshot!(format!("report_{n}_ranks"), deterministic(&ok_stdout(&o)));
    }
}

/// Lesson 02's final weights equal lesson 01's bit for bit at every world
/// size, 3 and 8 included; and the replicated check saw exactly zero
/// divergence at every step.
#[test]
fn bitwise_equal_to_lesson_01_at_1_2_3_4_8_ranks() {
    for n in [1usize, 2, 3, 4, 8] {
        let (o, dp) = mpirun("step01-data-parallel", n, FAST, &format!("l02-vs-01-dp-{n}"));
        ok_stdout(&o);
        let (o, shard) = mpirun(PKG, n, FAST, &format!("l02-vs-01-shard-{n}"));
        ok_stdout(&o);
        assert_eq!(digest(&dp), digest(&shard), "N = {n}");
        assert!(
            std::fs::read(dp.join("weights.safetensors")).unwrap()
                == std::fs::read(shard.join("weights.safetensors")).unwrap(),
            "N = {n}: weights files differ"
        );
        let r = report(&shard);
        let div: Vec<f64> = r["divergence"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        assert_eq!(div, vec![0.0; 3], "N = {n}: max |sharded − replicated| per step");
        let losses = r["losses"].as_array().unwrap();
        assert_eq!(losses, r["reference_losses"].as_array().unwrap(), "N = {n}: replicated and sharded losses");
    }
}

/// A padded layout (7 ranks do not divide 809,856) still trains the same bits.
#[test]
fn padding_at_7_ranks_changes_nothing() {
    let args = ["--steps", "2", "--batch-size", "1", "--seq-len", "8", "--micro-batches", "7"];
    let (o, dp) = mpirun("step01-data-parallel", 7, &args, "l02-pad-dp");
    ok_stdout(&o);
    let (o, shard) = mpirun(PKG, 7, &args, "l02-pad-shard");
    let stdout = ok_stdout(&o);
    let padding = stdout.lines().find(|l| l.contains("│ padding")).expect("padding row");
    assert!(padding.ends_with(" 2 elements │"), "{padding}");
    assert_eq!(digest(&dp), digest(&shard));
}

/// Each rank holds 1/N of the master weights: 1.62 MB of 3.24 MB at 2 ranks.
#[test]
fn master_shard_is_one_nth() {
    for n in [1usize, 2, 4] {
        let (o, out) = mpirun(PKG, n, FAST, &format!("l02-shard-{n}"));
        ok_stdout(&o);
        let r = report(&out);
        assert_eq!(
            r["master_shard_bytes"].as_u64().unwrap() * n as u64,
            r["replicated_master_bytes"].as_u64().unwrap()
        );
        assert!(out.join("shard_vs_replicated.svg").exists());
    }
}

/// A run whose weights turn NaN (a learning rate of 1e38 overflows them)
/// must say so: the divergence is NaN, never a comforting 0.00e+00.
#[test]
fn a_nan_is_never_read_as_zero_divergence() {
    let (o, _) = mpirun(
        PKG,
        2,
        &["--steps", "2", "--lr", "1e38", "--batch-size", "2", "--seq-len", "16", "--log-every", "1"],
        "l02-nan",
    );
    let stdout = ok_stdout(&o);
    let lines: Vec<&str> = stdout.lines().filter(|l| l.contains("max |sharded − replicated| =")).collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    assert!(lines.iter().all(|l| l.ends_with("= NaN")), "{lines:?}");
    assert!(stdout.contains("│ max |sharded − replicated| │ NaN over 2 steps │"), "{stdout}");
}

/// `just diff NN`: the step's change, then the files beside the idea file —
/// each speed or scale feature (lesson 02's buckets and `--check`) and the
/// accounting — named even where the lesson before has one of the same name.
#[test]
fn just_diff_names_what_each_lesson_adds() {
    let diff = |nn: &str| {
        let o = std::process::Command::new("bash").arg(root().join("scripts/lesson-diff.sh")).arg(nn).output().unwrap();
        ok_stdout(&o)
    };
    let d02 = diff("02");
    assert!(d02.contains("== the step: crates/01-data-parallel/src/data_parallel.rs → crates/02-whole-model-shard/src/whole_model_shard.rs"), "{d02}");
    let besides = d02.split("== what lesson 02 has beside its idea file").nth(1).unwrap_or_default();
    assert!(
        besides.contains("crates/02-whole-model-shard/src/buckets.rs")
            && besides.contains("(lesson 01-data-parallel has one too)")
            && besides.contains("crates/02-whole-model-shard/src/check.rs"),
        "{d02}"
    );
    assert!(!besides.contains("none:"), "{d02}");
    let d03 = diff("03");
    let besides = d03.split("== what lesson 03 has beside its idea file").nth(1).unwrap_or_default();
    assert!(
        besides.contains("crates/03-layerwise-shard/src/units.rs")
            && besides.contains("crates/03-layerwise-shard/src/tally.rs"),
        "{d03}"
    );
    assert!(!besides.contains("none:"), "{d03}");
}
