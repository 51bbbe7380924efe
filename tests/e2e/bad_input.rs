//! Bad input: one clear line on rank 0 naming what to fix, exit code 2, no
//! hung rank, no panic, no backtrace. Each case runs on several ranks.
use crate::common::*;

#[test]
fn more_ranks_than_micro_batches() {
    let e = fails("step01-data-parallel", 3, &["--micro-batches", "2"], "bad-ranks");
    assert_eq!(
        e,
        "error: 3 ranks but only 2 micro-batches per step: pass --micro-batches 3 (or a multiple of 3), or run fewer ranks"
    );
}

#[test]
fn micro_batches_that_do_not_divide() {
    let e = fails("step02-whole-model-shard", 3, &["--micro-batches", "4"], "bad-divide");
    assert_eq!(
        e,
        "error: --micro-batches 4 does not divide among 3 ranks: pass a multiple of 3, e.g. --micro-batches 6"
    );
}

#[test]
fn zero_steps() {
    let e = fails("step01-data-parallel", 2, &["--steps", "0"], "bad-steps");
    assert!(e.contains("'0' for '--steps <STEPS>'"), "{e}");
}

#[test]
fn negative_learning_rate() {
    let e = fails("step02-whole-model-shard", 2, &["--lr=-1"], "bad-lr");
    assert!(e.contains("`-1` is not a positive number"), "{e}");
    // Written with a space, a negative value reaches its flag's validator too (not "unexpected argument").
    for (flag, says) in [
        ("--lr", "`-1` is not a positive number"),
        ("--grad-clip", "`-1` is not a positive number"),
        ("--weight-decay", "`-1` is not a number ≥ 0"),
        ("--steps", "'-1' for '--steps <STEPS>'"),
    ] {
        let e = fails("step01-data-parallel", 2, &[flag, "-1"], &format!("bad-negative{flag}"));
        assert!(e.contains(says) && !e.contains("unexpected argument"), "{flag}: {e}");
    }
}

#[test]
fn unknown_preset() {
    let e = fails("step01-data-parallel", 2, &["--preset", "huge"], "bad-preset");
    assert_eq!(e, "error: unknown preset `huge`: choose one of tiny, small, gpt2");
}

#[test]
fn missing_data_file() {
    let e = fails("step01-data-parallel", 2, &["--data", "/nonexistent/input.txt"], "bad-missing");
    assert!(e.starts_with("error: data file /nonexistent/input.txt: cannot read it"), "{e}");
}

#[test]
fn empty_too_short_and_non_utf8_data() {
    let dir = out_dir("bad-data-files");
    let cases: [(&str, &[u8], &str); 3] = [
        ("empty.txt", b"", "is empty"),
        ("short.txt", b"to be", "has 5 characters, fewer than the 66 one sequence needs"),
        ("latin1.txt", b"caf\xe9 au lait", "not UTF-8 (invalid byte at offset 3)"),
    ];
    for (file, bytes, want) in cases {
        let p = dir.join(file);
        std::fs::write(&p, bytes).unwrap();
        let e = fails("step02-whole-model-shard", 2, &["--data", p.to_str().unwrap()], &format!("bad-{file}"));
        assert!(e.contains(want), "{file}: {e}");
    }
}

#[test]
fn seq_len_beyond_block_size() {
    let e = fails("step01-data-parallel", 2, &["--seq-len", "65"], "bad-seq");
    assert_eq!(e, "error: --seq-len 65 exceeds the tiny preset's block size 64: pass --seq-len 64 or less");
}

#[test]
fn accumulate_under_mpirun() {
    let e = fails("step01-data-parallel", 2, &["--accumulate", "2"], "bad-acc");
    assert!(e.contains("--accumulate simulates ranks in one process"), "{e}");
}

/// Lesson 01's `--accumulate N` and lesson 03's `--accumulate MODE` share a
/// name: each, given the other's value, says which flag it is.
#[test]
fn the_two_accumulate_flags_name_each_other() {
    let e = fails("step01-data-parallel", 1, &["--accumulate", "no-sync"], "bad-acc-mode");
    assert!(
        e.contains("pass a number of ranks to stand in for, e.g. 2 (in lessons 03 and 04, --accumulate takes a mode"),
        "{e}"
    );
    let e = fails("step01-data-parallel", 1, &["--accumulate", "0"], "bad-acc-zero");
    assert!(e.contains("pass a number of ranks from 1 to 4096"), "{e}");
    let e = fails("step03-layerwise-shard", 2, &["--accumulate", "2"], "bad-acc-number");
    assert!(e.contains("lesson 01's --accumulate N takes a number of ranks"), "{e}");
}

#[test]
fn unknown_flag() {
    let e = fails("step02-whole-model-shard", 2, &["--stepz", "3"], "bad-flag");
    assert!(e.contains("unexpected argument '--stepz'"), "{e}");
}

#[test]
fn blocks_per_unit_out_of_range() {
    let e = fails("step03-layerwise-shard", 2, &["--blocks-per-unit", "0"], "bad-bpu-0");
    assert_eq!(e, "error: --blocks-per-unit 0: a unit needs at least one block (pass 1 to 4)");
    let e = fails("step03-layerwise-shard", 2, &["--blocks-per-unit", "5"], "bad-bpu-5");
    assert_eq!(e, "error: --blocks-per-unit 5 exceeds the tiny preset's 4 blocks: pass 1 to 4");
}

#[test]
fn zero_stage_precision_and_budget_out_of_range() {
    let e = fails("step04-optimizer-state-shard", 2, &["--stage", "4"], "bad-stage");
    assert!(e.contains("'4' for '--stage <STAGE>'"), "{e}");
    let e = fails("step01-data-parallel", 2, &["--precision", "fp16"], "bad-precision");
    assert!(e.contains("`fp16` is not a precision: choose fp32 or bf16"), "{e}");
    let e = fails("step04-optimizer-state-shard", 2, &["--mem-budget", "12parsecs"], "bad-budget");
    assert!(e.contains("`12parsecs` is not a size"), "{e}");
}

#[test]
fn budget_below_the_model_size() {
    // 1 MB is less than is live before training: every rank stops before
    // step 1 with one out-of-memory line, and no report is written.
    let e =
        fails("step03-layerwise-shard", 2, &["--steps", "3", "--mem-budget", "1MB", "--no-plot"], "bad-budget-small");
    assert!(
        e.starts_with("error: out of memory on rank 0: ")
            && e.contains(" live before training already exceeds the budget 1.00 MB (pass a larger --mem-budget"),
        "{e}"
    );
    // A budget below 0.1 MB is said in bytes: "0.00 MB" would hide it.
    let e = fails("step03-layerwise-shard", 2, &["--steps", "3", "--mem-budget", "1KB", "--no-plot"], "bad-budget-1kb");
    assert!(e.contains(" live before training already exceeds the budget 1,000 bytes (pass a larger"), "{e}");
}

#[test]
fn unwritable_out_folder_and_data_that_is_a_folder() {
    let e = fails("step04-optimizer-state-shard", 2, &["--out", "/proc/no-such-place"], "bad-out");
    assert!(e.contains("cannot create --out folder /proc/no-such-place"), "{e}");
    let e = fails("step02-whole-model-shard", 2, &["--data", "/tmp"], "bad-data-folder");
    assert_eq!(
        e,
        "error: data file /tmp: cannot read it (Is a directory (os error 21)); pass --data with a readable text file"
    );
}

/// Only rank 1 fails at setup (its --data is missing; mpirun's `:` gives
/// each rank its own flags): one line, rank 0's, naming rank 1 and the fix.
#[test]
fn a_setup_failure_on_another_rank_is_one_line() {
    let bin = binary("step02-whole-model-shard");
    let good = scratch().join("test-out/rank1-good.txt");
    std::fs::create_dir_all(good.parent().unwrap()).unwrap();
    std::fs::write(&good, "the quick brown fox jumps over the lazy dog. ".repeat(60)).unwrap();
    let out = out_dir("bad-rank1");
    let o = std::process::Command::new("mpirun")
        .args(["-q", "-n", "1"])
        .arg(&bin)
        .args(["--steps", "1", "--data"])
        .arg(&good)
        .arg("--out")
        .arg(&out)
        .args([":", "-n", "1"])
        .arg(&bin)
        .args(["--steps", "1", "--data", "/no/such/file.txt", "--out"])
        .arg(&out)
        .envs(MPIRUN_ENV)
        .output()
        .unwrap();
    let (code, lines) = failure(&o);
    assert_eq!(code, 2, "{lines:?}");
    assert_eq!(
        lines,
        [
            "error (rank 1): data file /no/such/file.txt: cannot read it (No such file or directory (os error 2)); pass --data with a readable text file"
        ]
    );
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 0);
}

#[test]
fn head_grad_outside_stage_3() {
    let e = fails("step04-optimizer-state-shard", 2, &["--stage", "2", "--head-grad", "keep"], "bad-head-grad");
    assert_eq!(e, "error: --head-grad keep applies to stage 3 (lesson 03's schedule): leave it out at --stage 2");
}

#[test]
fn unknown_head_grad() {
    let e = fails("step03-layerwise-shard", 2, &["--head-grad", "sometimes"], "bad-head-grad-word");
    assert!(e.contains("pass keep or recompute"), "{e}");
}

/// The reference data is the seed's start: a checkpoint flag would be ignored, so it is refused.
#[test]
fn reference_data_refuses_what_it_would_ignore() {
    let out = out_dir("bad-reference-data");
    let o = std::process::Command::new(binary("fsdp-reference-data"))
        .args(["--resume", "somewhere", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    let (code, lines) = failure(&o);
    assert_eq!(code, 2, "{lines:?}");
    assert_eq!(
        lines,
        ["error: --resume does not apply: the reference data is the seed's start and batches; leave --resume out"]
    );
    assert!(std::fs::read_dir(&out).unwrap().next().is_none(), "nothing written");
    let o = std::process::Command::new(binary("fsdp-reference-data"))
        .args(["--grad-clip", "1", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert_eq!(
        failure(&o).1,
        [
            "error: --grad-clip does not apply: the reference data is the seed's start and batches; leave --grad-clip out"
        ]
    );
}

/// `--reduce-dtype bf16` where a part of the run reduces in fp32 only, and an unknown dtype.
#[test]
fn reduce_dtype_where_it_cannot_apply() {
    let e = fails("step03-layerwise-shard", 2, &["--no-plot", "--check", "--reduce-dtype", "bf16"], "bad-reduce-check");
    assert_eq!(
        e,
        "error: --check compares against lesson 02, which reduces in fp32: leave out --check, or --reduce-dtype bf16"
    );
    let e = fails("step04-optimizer-state-shard", 2, &["--hsdp", "1", "--reduce-dtype", "bf16"], "bad-reduce-hsdp");
    assert_eq!(
        e,
        "error: --hsdp reduces across replica groups in fp32 only here: leave out --reduce-dtype bf16, or --hsdp"
    );
    let e = fails("step04-optimizer-state-shard", 2, &["--reduce-dtype", "fp16"], "bad-reduce-fp16");
    assert!(e.contains("`fp16` is not a reduce dtype: choose fp32 or bf16"), "{e}");
}

/// The measuring knobs, set wrong: the same one line from rank 0, every rank
/// stopped before its first collective (nothing half-run, nothing written).
#[test]
fn measuring_knobs_set_wrong() {
    for (pkg, var, value, want) in [
        ("step01-data-parallel", "FSDP_MATMUL", "avx9", "FSDP_MATMUL=avx9: this CPU runs "),
        (
            "step03-layerwise-shard",
            "FSDP_MATMUL_BLOCKS",
            "256,72",
            "FSDP_MATMUL_BLOCKS=256,72: give three positive sizes",
        ),
        ("step02-whole-model-shard", "FSDP_MATMUL_BLOCKS", "0,72,4096", "FSDP_MATMUL_BLOCKS=0,72,4096: give three"),
        ("step03-layerwise-shard", "FSDP_POLL_US", "200,10", "FSDP_POLL_US=200,10: give FIRST,MOST in microseconds"),
        ("step01-data-parallel", "FSDP_POLL_US", "fast", "FSDP_POLL_US=fast: give FIRST,MOST"),
    ] {
        let e = fails_with_env(pkg, 2, &[], &[(var, value)], &format!("bad-knob-{var}-{value}"));
        assert!(e.starts_with(&format!("error: {want}")), "{var}={value}: {e}");
    }
}

/// Every rank fails at once, after setup (each panics at the end of step 2):
/// each error line that reaches the terminal is whole, never two ranks'
/// lines printed into each other.
#[test]
fn ranks_failing_together_print_whole_lines() {
    let (mut cmd, _) = mpirun_command("step01-data-parallel", 4, &["--steps", "5"], "bad-together");
    let o = cmd.env("FSDP_FAILPOINT", "panic-after-step:2").output().unwrap();
    let (code, lines) = failure(&o);
    assert_ne!(code, 0, "{lines:?}");
    let errors: Vec<&String> = lines.iter().filter(|l| l.contains("error (rank")).collect();
    assert!(!errors.is_empty(), "no rank's error line: {lines:?}");
    let whole = |l: &str| {
        let Some(rest) = l.strip_prefix("error (rank ") else { return false };
        let (rank, rest) = rest.split_at(1);
        rank.parse::<u8>().is_ok_and(|r| r < 4)
            && rest.starts_with("): internal error: failpoint panic-after-step:2 at crates/harness/src/lesson.rs:")
            && rest.rsplit(':').next().is_some_and(|n| n.parse::<u32>().is_ok())
    };
    for l in errors {
        assert!(whole(l), "a broken error line: {l:?} (all: {lines:?})");
    }
}
