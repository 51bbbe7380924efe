//! Gradient accumulation, four ways (`--accumulate`, issue 53): micro-batch
//! after micro-batch, every mode gives lesson 01's bits, sends the bytes and
//! runs the collectives its theory says, and holds what its tally says.
use crate::common::*;

/// The modes other than the default (unit-major, which the other modules test).
const MODES: [&str; 3] = ["reduce-every", "no-sync", "keep-unsharded"];

/// Two steps of 2 × 16-token micro-batches, M of them.
fn shape(m: usize) -> Vec<String> {
    ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--log-every", "1", "--micro-batches"]
        .iter()
        .map(|s| s.to_string())
        .chain([m.to_string()])
        .collect()
}

/// Lesson 01's digest at M micro-batches under `precision` (one rank: the
/// pairwise tree gives every power-of-two world size these bits, and under
/// `--sum-groups G` every world size dividing G), with `shared` (flags both
/// runs take, e.g. `--sum-groups`).
fn lesson01(m: usize, precision: &str, shared: &[&str]) -> String {
    let mut args = shape(m);
    args.extend(["--precision", precision].iter().chain(shared).map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (o, out) = mpirun("step01-data-parallel", 1, &args, &format!("acc-dp-{precision}-{m}-{}", shared.join("")));
    ok_stdout(&o);
    digest(&out)
}

/// All-gathers and reduce-scatters per step by the theory of `mode`, for
/// `units` units and `mine` micro-batches of mine (the head's gradient kept).
fn calls(mode: &str, units: u64, mine: u64) -> (u64, u64) {
    match mode {
        "reduce-every" => (2 * units * mine, units * mine),
        "no-sync" => (2 * units * mine, units),
        "keep-unsharded" => (units, units),
        _ => unreachable!("{mode}"),
    }
}

/// Runs `package` with `extra` in every mode at each (N, M/N) of `grid`, and
/// checks each run: lesson 01's digest (lesson 01 run with `shared` too);
/// per step, the all-gathers' and reduce-scatters' calls and bytes against
/// the theory (the report's); the tally's peak within 2% of the measured peak
/// heap on every rank.
fn every_mode_keeps_the_promises(
    package: &str,
    extra: &[&str],
    shared: &[&str],
    precision: &str,
    grid: &[(usize, usize)],
) {
    let mut failures = vec![];
    for &(n, per_rank) in grid {
        let m = n * per_rank;
        let want = lesson01(m, precision, shared);
        for mode in MODES {
            let mut args = shape(m);
            args.extend(["--accumulate", mode].iter().chain(extra).chain(shared).map(|s| s.to_string()));
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let name = format!("acc-{package}-{precision}-{mode}-{n}-{per_rank}-{}", shared.join(""));
            let (o, out) = mpirun(package, n, &args, &name);
            let stdout = ok_stdout(&o);
            let said = stdout.lines().any(|l| l.contains("gradient accumulation") && l.contains(&format!("{mode}: ")));
            assert!(said, "{package} --accumulate {mode}: no config line\n{stdout}");
            let r = report(&out);
            let what = format!("{package} {precision} --accumulate {mode} {shared:?} at {n} ranks, M/N = {per_rank}");
            if digest(&out) != want {
                failures.push(format!("{what}: digest {} against lesson 01's {want}", digest(&out)));
            }
            let steps = r["steps"].as_u64().unwrap();
            let units = r["units"].as_array().unwrap().len() as u64;
            let (gathers, scatters) = calls(mode, units, per_rank as u64);
            for (kind, want_calls) in [("all_gather", gathers), ("reduce_scatter", scatters)] {
                let t = &r["traffic"][kind];
                let (got_calls, bytes) = (t["calls"].as_u64().unwrap() / steps, t["bytes_sent"].as_u64().unwrap());
                let theory = r["expected_bytes_per_step"][kind].as_u64().unwrap();
                if got_calls != want_calls || bytes != theory * steps {
                    failures.push(format!(
                        "{what}: {kind} {got_calls} calls, {} bytes per step; theory {want_calls} calls, {theory} bytes",
                        bytes / steps
                    ));
                }
            }
            let ratios = tally_ratios(&r);
            if ratios.iter().any(|x| !(0.98..=1.02).contains(x)) {
                failures.push(format!("{what}: measured / tally = {ratios:.3?}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Lesson 03 in fp32 at 1, 2 and 4 ranks, M/N = 1, 2 and 4 between them.
#[test]
fn lesson_03_every_mode_gives_lesson_01s_bits_its_bytes_and_its_tally() {
    let grid = [(1, 2), (2, 1), (2, 4), (4, 2)];
    every_mode_keeps_the_promises("step03-layerwise-shard", &["--no-plot"], &[], "fp32", &grid);
}

/// Several gradient sums per rank (`--sum-groups G`: G sums over the
/// micro-batches, each a tree of its own, then a tree over the sums): at 2
/// ranks a rank holds G/2 of them, so each rank's deferred shards
/// (reduce-every's `finish_deferred`) and held sums (no-sync's `push`) are
/// summed group by group — and at 3 ranks (G = 6) over a world that is not a
/// power of two. Lesson 01 is run with the same groups.
#[test]
fn several_sums_per_rank_keep_lesson_01s_bits_in_every_mode() {
    let l03 = "step03-layerwise-shard";
    every_mode_keeps_the_promises(l03, &["--no-plot"], &["--sum-groups", "4"], "fp32", &[(2, 4)]);
    every_mode_keeps_the_promises(l03, &["--no-plot"], &["--sum-groups", "6"], "fp32", &[(2, 3), (3, 2)]);
    let zero3 = "step04-optimizer-state-shard";
    every_mode_keeps_the_promises(zero3, &[], &["--sum-groups", "4"], "bf16", &[(2, 4)]);
}

/// ZeRO-3 (lesson 04's stage 3) in fp32 and in bf16, its default.
#[test]
fn zero_3_every_mode_gives_lesson_01s_bits_its_bytes_and_its_tally() {
    let zero3 = "step04-optimizer-state-shard";
    every_mode_keeps_the_promises(zero3, &["--precision", "fp32"], &[], "fp32", &[(1, 2), (2, 2), (4, 1)]);
    every_mode_keeps_the_promises(zero3, &["--precision", "bf16"], &[], "bf16", &[(1, 4), (2, 2), (4, 2)]);
}

/// The bf16 reduction (`--reduce-dtype bf16`) keeps its one tree in every
/// mode: reduce-every's shards cross as bf16 and are summed with bf16's
/// rounding at every node, as the unit-major reduce-scatter sums them.
#[test]
fn a_bf16_reduction_keeps_its_bits_in_every_mode() {
    let args = |mode: &str| -> Vec<String> {
        let mut a = shape(4);
        a.extend(["--reduce-dtype", "bf16", "--accumulate", mode].map(String::from));
        a
    };
    let (o, unit_major) = mpirun(
        "step04-optimizer-state-shard",
        2,
        &args("unit-major").iter().map(String::as_str).collect::<Vec<_>>(),
        "acc-rd-unit-major",
    );
    ok_stdout(&o);
    for mode in MODES {
        let a = args(mode);
        let (o, out) = mpirun(
            "step04-optimizer-state-shard",
            2,
            &a.iter().map(String::as_str).collect::<Vec<_>>(),
            &format!("acc-rd-{mode}"),
        );
        ok_stdout(&o);
        assert_eq!(digest(&out), digest(&unit_major), "--reduce-dtype bf16 --accumulate {mode}");
    }
}

/// The default prints no line and changes nothing; each other mode prints one.
#[test]
fn only_a_mode_other_than_the_default_says_so() {
    let (o, _) = mpirun("step03-layerwise-shard", 2, &["--steps", "1", "--no-plot"], "acc-default");
    assert!(!ok_stdout(&o).contains("gradient accumulation"));
    let (o, _) =
        mpirun("step03-layerwise-shard", 2, &["--steps", "1", "--no-plot", "--accumulate", "no-sync"], "acc-line");
    let stdout = ok_stdout(&o);
    let line = stdout.lines().find(|l| l.contains("gradient accumulation")).expect("the mode's line");
    assert!(line.contains("no-sync") && line.contains("set_requires_gradient_sync(False)"), "{line}");
}

/// What cannot run with a mode other than the default gets one line.
#[test]
fn bad_combinations_get_one_line() {
    let l03 = "step03-layerwise-shard";
    let cases: [(&str, &[&str], &str); 7] = [
        (l03, &["--accumulate", "no-sync", "--prefetch"], "leave out --prefetch, or --accumulate"),
        (l03, &["--accumulate", "reduce-every", "--hsdp", "1"], "leave out --hsdp, or --accumulate"),
        (l03, &["--accumulate", "keep-unsharded", "--check"], "leave out --check"),
        (l03, &["--accumulate", "no-sync", "--head-grad", "recompute"], "leave out --head-grad recompute"),
        (l03, &["--accumulate", "sometimes"], "pass one of unit-major, reduce-every, no-sync, keep-unsharded"),
        ("step04-optimizer-state-shard", &["--stage", "2", "--accumulate", "no-sync"], "applies to stage 3"),
        ("step04-optimizer-state-shard", &["--accumulate", "reduce-every", "--prefetch"], "leave out --prefetch"),
    ];
    for (i, (package, args, says)) in cases.iter().enumerate() {
        let e = fails(package, 2, args, &format!("acc-bad-{i}"));
        assert!(e.contains(says), "{args:?}: {e}");
    }
}
