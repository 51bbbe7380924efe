//! The exercises: each is a piece of a lesson's real step, and its check is
//! the lesson itself, run on 4 ranks (exercise 2.1 on 5) with the learner's code in that place
//! (`--mine K`): the losses, gradient norms, `--check` divergences, bytes
//! sent and final weights, bit for bit, against the committed snapshot.
//!
//! - `every_answer_gives_its_snapshot` (CI): the answers produce the
//!   snapshots — what a learner's code must produce.
//! - `every_stub_stops_with_one_line_naming_its_file` (CI): the committed
//!   stubs stop every rank with exit code 2 and one line naming the file.
//! - `exercise_N_K` (ignored; `just exercise 0N-K` runs one): the learner's
//!   code against the snapshot, with the reason when they differ.
use std::path::Path;

use crate::common::*;

/// One exercise: its id ("2.1"), the lesson's package, its check's world
/// size and the flags of its run.
struct Exercise {
    id: &'static str,
    package: &'static str,
    ranks: usize,
    args: &'static [&'static str],
}

/// The world size of most checks.
const RANKS: usize = 4;

/// Every run: the tiny preset, 3 steps of micro-batches of 2 × 16 tokens.
const BASE: &[&str] = &["--steps", "3", "--batch-size", "2", "--seq-len", "16", "--log-every", "1"];
/// 16 micro-batches: 4 per rank, a tree two levels deep on each rank and over the ranks.
const M16: [&str; 2] = ["--micro-batches", "16"];

const EXERCISES: &[Exercise] = &[
    // 12 sum groups, 3 per rank: the tree over the 12 parts splits 12, 6, 3 → 1 + 2, so a
    // split at the wrong half of an odd count shows (at 4 parts every split is even).
    Exercise {
        id: "1.1",
        package: "step01-data-parallel",
        ranks: RANKS,
        args: &["--micro-batches", "24", "--sum-groups", "12"],
    },
    Exercise { id: "1.2", package: "step01-data-parallel", ranks: RANKS, args: &M16 },
    // 5 ranks: 809,856 parameters do not divide by 5, so the last shard ends in padding and
    // a shard's start computed without it shows (every world size from 1 to 4 divides them).
    Exercise {
        id: "2.1",
        package: "step02-whole-model-shard",
        ranks: 5,
        args: &["--micro-batches", "20", "--no-plot"],
    },
    // A planted fault in the reference (the last rank's last parameter): --check must report it, NaN included.
    Exercise {
        id: "2.2",
        package: "step02-whole-model-shard",
        ranks: RANKS,
        args: &[M16[0], M16[1], "--no-plot", "--check-probe"],
    },
    // 3 micro-batches per rank: with 4 a reversed order pairs the same gradients (a + b = b + a)
    // and gives the same bits; with 3 the tree is g0 + (g1 + g2), reversed g2 + (g1 + g0).
    Exercise {
        id: "3.1",
        package: "step03-layerwise-shard",
        ranks: RANKS,
        args: &["--micro-batches", "12", "--no-plot", "--unit-digests"],
    },
    // 0.3 against norms of about 2 to 6: every step clips.
    Exercise {
        id: "3.2",
        package: "step03-layerwise-shard",
        ranks: RANKS,
        args: &[M16[0], M16[1], "--no-plot", "--grad-clip", "0.3", "--unit-digests"],
    },
    // No-sync's hand-off, 4 micro-batches per rank: every unit's sum two levels deep before its reduce-scatter.
    Exercise {
        id: "3.3",
        package: "step03-layerwise-shard",
        ranks: RANKS,
        args: &[M16[0], M16[1], "--no-plot", "--accumulate", "no-sync", "--unit-digests"],
    },
    Exercise {
        id: "4.1",
        package: "step04-optimizer-state-shard",
        ranks: RANKS,
        args: &[M16[0], M16[1], "--stage", "2"],
    },
    Exercise {
        id: "4.2",
        package: "step04-optimizer-state-shard",
        ranks: RANKS,
        args: &[M16[0], M16[1], "--stage", "3", "--precision", "bf16"],
    },
];

impl Exercise {
    fn k(&self) -> &'static str {
        self.id.split('.').nth(1).unwrap()
    }

    fn snapshot_name(&self) -> String {
        format!("exercise_{}", self.id.replace('.', "_"))
    }

    /// Runs the check's lesson, with the learner's code when `mine`.
    fn run(&self, mine: bool) -> (std::process::Output, std::path::PathBuf) {
        let mut args = [BASE, self.args].concat();
        if mine {
            args.extend(["--mine", self.k()]);
        }
        let name = format!("exercise-{}-{}", self.id, if mine { "mine" } else { "answer" });
        let (mut cmd, out) = mpirun_command(self.package, self.ranks, &args, &name);
        let o = if mine { with_timeout(cmd, 600) } else { cmd.output().expect("mpirun runs") };
        (o, out)
    }

    /// Whether the learner's file still holds this exercise's stub.
    fn is_stub(&self) -> bool {
        let dir = self.package.trim_start_matches("step");
        let path = crate::common::root().join("crates").join(dir).join("src/exercises.rs");
        std::fs::read_to_string(path).unwrap().contains(&format!("todo!(\"exercise {}", self.id))
    }

    /// What the check compares: one line per fact, exact bits beside a readable value.
    fn summary(&self, out: &Path) -> String {
        let r = report(out);
        let flags = [BASE, self.args].concat().join(" ");
        let mut s = format!("exercise {}: {} on {} ranks, {flags}\n", self.id, self.package, self.ranks);
        // JSON has no NaN: the report writes null.
        let f32s = |key: &str| -> Vec<f32> {
            let each = |x: &serde_json::Value| x.as_f64().map_or(f32::NAN, |x| x as f32);
            r[key].as_array().map(|a| a.iter().map(each).collect()).unwrap_or_default()
        };
        for (i, loss) in f32s("losses").iter().enumerate() {
            s += &format!("step {}: loss {:#010x} = {loss}\n", i + 1, loss.to_bits());
        }
        for (i, d) in f32s("divergence").iter().enumerate() {
            s += &format!("step {}: --check max |sharded − replicated| = {d:.2e}\n", i + 1);
        }
        if let Some(norms) = r["grad_norms"].as_array().filter(|a| !a.is_empty()) {
            for (i, n) in norms.iter().enumerate() {
                let n = n.as_f64().unwrap_or(f64::NAN); // a NaN norm is written as null
                s += &format!("step {}: gradient norm {:#018x} = {n}\n", i + 1, n.to_bits());
            }
        }
        // Lesson 03: each unit's gradient (rank 0's shard), so a check can name the first that differs.
        for (i, units) in r["unit_grad_digests"].as_array().into_iter().flatten().enumerate() {
            for u in units.as_array().unwrap() {
                s += &format!(
                    "step {}: gradient of {}, rank 0's shard: digest {}\n",
                    i + 1,
                    u[0].as_str().unwrap(),
                    u[1].as_str().unwrap()
                );
            }
        }
        let steps = r["steps"].as_u64().unwrap();
        let traffic = r["traffic"].as_object().unwrap();
        for (kind, t) in traffic.iter().filter(|(k, _)| k.as_str() != "control") {
            let sent = t["bytes_sent"].as_u64().unwrap();
            if sent > 0 {
                s += &format!("{kind}: {} bytes sent per step per rank\n", sent / steps);
            }
        }
        s += &format!("final weights digest: {}\n", r["weights_digest"].as_str().unwrap());
        s
    }
}

#[test]
fn every_answer_gives_its_snapshot() {
    for e in EXERCISES {
        let (o, out) = e.run(false);
        ok_stdout(&o);
        insta::assert_snapshot!(e.snapshot_name(), e.summary(&out));
    }
}

#[test]
fn every_stub_stops_with_one_line_naming_its_file() {
    for e in EXERCISES {
        if !e.is_stub() {
            // A learner's tree: their code replaced the stub. CI's tree must hold the stubs.
            assert!(
                std::env::var_os("CI").is_none(),
                "exercise {}: the committed stub is gone from src/exercises.rs",
                e.id
            );
            eprintln!("exercise {}: written (no stub in src/exercises.rs): not checked here", e.id);
            continue;
        }
        let (o, out) = e.run(true);
        let (code, lines) = failure(&o);
        let dir = e.package.trim_start_matches("step");
        let want = format!(
            "error: exercise {} is not written yet: replace the todo!() under `TODO(exercise): {}` in crates/{dir}/src/exercises.rs (hints in the book's chapter; leave out --mine {} to run the answer)",
            e.id,
            e.id,
            e.k()
        );
        assert_eq!((code, lines), (2, vec![want]), "exercise {}", e.id);
        assert!(!out.join("report.json").exists(), "exercise {}: a stopped run wrote its report", e.id);
    }
    // With --prefetch the stub is reached while the next units' all-gathers are in
    // flight: they are waited for, and the line is the same.
    let e = EXERCISES.iter().find(|e| e.id == "3.1").unwrap();
    if e.is_stub() {
        let args = [BASE, &M16, &["--prefetch", "--mine", "1"]].concat();
        let (cmd, _) = mpirun_command(e.package, RANKS, &args, "exercise-3.1-prefetch");
        let o = with_timeout(cmd, 300);
        let (code, lines) = failure(&o);
        assert_eq!(code, 2, "{lines:?}");
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].starts_with("error: exercise 3.1 is not written yet"), "{lines:?}");
    }
    // With DDP's buckets exercise 1.1's rank sum runs on the communication
    // stream's thread: its panic is raised where the compute thread waits.
    let e = EXERCISES.iter().find(|e| e.id == "1.1").unwrap();
    if e.is_stub() {
        let args = [BASE, &M16, &["--bucket-mb", "0.1", "--mine", "1"]].concat();
        let (cmd, _) = mpirun_command(e.package, RANKS, &args, "exercise-1.1-buckets");
        let (code, lines) = failure(&with_timeout(cmd, 300));
        assert_eq!(code, 2, "{lines:?}");
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].starts_with("error: exercise 1.1 is not written yet"), "{lines:?}");
    }
}

/// `--mine K` where the run would never call the learner's code is refused,
/// so an exercise cannot pass by not running; an unknown K likewise.
#[test]
fn mine_is_refused_where_the_exercise_does_not_run() {
    let fast = |extra: &[&'static str]| [BASE, &M16, extra].concat();
    let cases: &[(&str, usize, &[&str], &str)] = &[
        ("step01-data-parallel", 1, &["--mine", "1"], "--mine 1: exercise 1.1 runs only when sums are added"),
        ("step01-data-parallel", 2, &["--mine", "1", "--reduce", "native"], "--reduce ordered"),
        ("step02-whole-model-shard", 2, &["--mine", "2", "--no-check"], "leave out --no-check"),
        ("step02-whole-model-shard", 2, &["--check-probe", "--no-check"], "leave out --no-check"),
        ("step03-layerwise-shard", 2, &["--mine", "2"], "add --grad-clip"),
        ("step04-optimizer-state-shard", 2, &["--mine", "1", "--stage", "3"], "at --stage 2"),
        ("step04-optimizer-state-shard", 2, &["--mine", "2", "--precision", "fp32"], "under --precision bf16"),
        ("step03-layerwise-shard", 2, &["--mine", "3"], "under --accumulate no-sync"),
        ("step03-layerwise-shard", 2, &["--mine", "4"], "lesson 03 has exercises 3.1, 3.2, 3.3"),
    ];
    for (i, (package, ranks, extra, says)) in cases.iter().enumerate() {
        let line = fails(package, *ranks, &fast(extra), &format!("mine-refused-{i}"));
        assert!(line.contains(says), "{package} {extra:?}: {line}");
    }
}

/// The learner's code for exercise `id`, checked against its snapshot.
fn check_mine(id: &str) {
    let e = EXERCISES.iter().find(|e| e.id == id).expect("an exercise");
    let (o, out) = e.run(true);
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    if !o.status.success() {
        panic!("\nexercise {id}: the run with your code stopped:\n{}{stderr}", tail(&stdout, 15));
    }
    println!("{}", tail(&stdout, 12));
    let yours = e.summary(&out);
    if id == "4.2" {
        bf16_edges(); // NaN, ties, the largest finite values: cases training never meets
    }
    let path =
        crate::common::root().join("tests/e2e/snapshots").join(format!("e2e__exercises__{}.snap", e.snapshot_name()));
    let committed = std::fs::read_to_string(&path).expect("the committed snapshot");
    let want = committed.splitn(3, "---\n").nth(2).expect("a snapshot body").to_string();
    if yours.trim_end() != want.trim_end() {
        eprintln!("\n✗ exercise {id}: {}\n", why(&want, &yours));
    }
    insta::assert_snapshot!(e.snapshot_name(), yours);
}

/// Exercise 4.2's rounding against candle's where a run does not go.
fn bf16_edges() {
    if let Err(e) = step04_optimizer_state_shard::check_bf16_rounding(step04_optimizer_state_shard::mine::to_bf16_bits)
    {
        panic!("\n✗ exercise 4.2: {e}\n");
    }
}

/// Runs `cmd`, killing it after `secs` seconds (a hung collective).
fn with_timeout(mut cmd: std::process::Command, secs: u64) -> std::process::Output {
    use std::io::Read;
    let mut child = cmd
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("mpirun runs");
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let reader = std::thread::spawn(move || {
        let mut b = vec![];
        out.read_to_end(&mut b).unwrap();
        b
    });
    let err_reader = std::thread::spawn(move || {
        let mut b = vec![];
        err.read_to_end(&mut b).unwrap();
        b
    });
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed().as_secs() > secs {
            // SIGTERM: mpirun passes it on to the ranks, then SIGKILLs them
            // (OMPI_MCA_odls_base_sigkill_timeout apart); give it the time.
            signal(child.id() as i32, SIGTERM);
            for _ in 0..300 {
                if child.try_wait().unwrap().is_some() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            let _ = child.kill();
            panic!(
                "\nexercise: the run with your code stopped: it had not finished after {secs} s — a collective (gather_control, exact_sum, sum_f64, …) called on some ranks but not all?\n"
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    std::process::Output { status, stdout: reader.join().unwrap(), stderr: err_reader.join().unwrap() }
}

/// The last `n` lines or so of `text`, from the start of a block (after a
/// blank line, or a table's top border), never from the middle of a table.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let mut from = lines.len().saturating_sub(n.max(1)).min(lines.len().saturating_sub(1));
    while from > 0 && !(lines[from - 1].trim().is_empty() || lines[from].starts_with('┌')) {
        from -= 1;
    }
    lines[from..].join("\n") + "\n"
}

#[test]
fn a_tail_starts_at_a_block() {
    let text = "config\n\n┌──┐\n│ a │\n│ b │\n└──┘\nstep 1\nstep 2\n";
    assert_eq!(tail(text, 3), "┌──┐\n│ a │\n│ b │\n└──┘\nstep 1\nstep 2\n");
    assert_eq!(tail(text, 2), tail(text, 3), "two lines back is inside the table: from its top");
    assert_eq!(tail("a\n\nb\nc\n", 1), "b\nc\n");
}

/// Why two summaries differ, in words: other bytes, the same numbers in
/// another order, or other numbers.
fn why(want: &str, yours: &str) -> String {
    let values = |s: &str, what: &str| -> Vec<f64> {
        s.lines().filter(|l| l.contains(what)).filter_map(|l| l.rsplit("= ").next()?.parse().ok()).collect()
    };
    let bytes = |s: &str| s.lines().filter(|l| l.contains("bytes sent")).map(str::to_string).collect::<Vec<_>>();
    if bytes(want) != bytes(yours) {
        return format!(
            "your step sends other bytes: {:?} where the lesson sends {:?} (see the exercise's hint on what travels)",
            bytes(yours),
            bytes(want)
        );
    }
    // A wrong norm first (it scales every gradient), then the units' gradients, then the rest.
    let first_value = |what: &str| -> Option<String> {
        let (a, b) = (values(want, what), values(yours, what));
        if let Some(i) = a.iter().zip(&b).position(|(x, y)| x.to_bits() != y.to_bits()) {
            let rel = ((a[i] - b[i]) / a[i]).abs();
            return Some(if what == "max |sharded" {
                format!("your divergence differs at step {}: {} where the lesson has {}", i + 1, b[i], a[i])
            } else if rel < 1e-3 {
                format!(
                    "the {what} first differs at step {}, by {rel:.1e} of its value: nearly the same numbers, rounded otherwise — additions in another order (floating-point addition is not associative) or another rounding; see the exercise's hints",
                    i + 1
                )
            } else {
                format!(
                    "the {what} differs at step {} ({} where the lesson has {}): your code computes other numbers",
                    i + 1,
                    b[i],
                    a[i]
                )
            });
        }
        None
    };
    if let Some(line) = first_value("gradient norm") {
        return line;
    }
    // The units' gradients, in the order the backward finishes them: the first that differs.
    let grads = |s: &str| s.lines().filter(|l| l.contains(": gradient of ")).map(str::to_string).collect::<Vec<_>>();
    if let Some((w, _)) = grads(want).iter().zip(grads(yours)).find(|(a, b)| *a != b) {
        let (step, rest) = w.split_once(": gradient of ").unwrap_or_default();
        let unit = rest.split(',').next().unwrap_or_default();
        return format!(
            "at {step}, the gradient of unit {unit} is the first that differs from the lesson's (the units are listed in the order the backward finishes them): look at what your code does for that unit"
        );
    }
    for what in ["loss", "max |sharded"] {
        if let Some(line) = first_value(what) {
            return line;
        }
    }
    let digest = |s: &str| s.lines().find(|l| l.starts_with("final weights")).map(str::to_string);
    if digest(want) != digest(yours) {
        return "the losses match, but the final weights differ in their bits: the last update (or the gradient feeding it) was formed in another order".to_string();
    }
    let line = want.lines().zip(yours.lines()).find(|(a, b)| a != b).map_or("", |(a, _)| a);
    format!("your run differs from the snapshot at the line `{line}`")
}

macro_rules! exercise_checks {
    ($($name:ident => $id:literal),* $(,)?) => {$(
        /// The learner's code (`--mine K`) against the committed snapshot: `just exercise`.
        #[test]
        #[ignore = "checks your code: run it with `just exercise NN-K`"]
        fn $name() {
            check_mine($id);
        }
    )*};
}

exercise_checks! {
    exercise_1_1 => "1.1", exercise_1_2 => "1.2",
    exercise_2_1 => "2.1", exercise_2_2 => "2.2",
    exercise_3_1 => "3.1", exercise_3_2 => "3.2", exercise_3_3 => "3.3",
    exercise_4_1 => "4.1", exercise_4_2 => "4.2",
}

#[test]
fn why_says_order_or_other_numbers() {
    let want = "step 1: loss 0x40000000 = 2\nstep 2: loss 0x3f800000 = 1\nall_reduce: 8 bytes sent per step per rank\n";
    let order = want.replace("= 1\n", "= 1.0000001\n");
    assert!(why(want, &order).contains("rounded otherwise"), "{}", why(want, &order));
    let other = want.replace("= 1\n", "= 1.5\n");
    assert!(why(want, &other).contains("other numbers"));
    let bytes = want.replace("8 bytes", "16 bytes");
    assert!(why(want, &bytes).contains("other bytes"));
    let grads = format!(
        "{want}step 1: gradient of h.3, rank 0's shard: digest 01\nstep 1: gradient of h.2, rank 0's shard: digest 02\n"
    );
    assert_eq!(
        why(&grads, &grads.replace("digest 02", "digest 03")),
        "at step 1, the gradient of unit h.2 is the first that differs from the lesson's (the units are listed in the order the backward finishes them): look at what your code does for that unit"
    );
    let weights = format!("{want}final weights digest: 1\n");
    assert!(why(&weights, &weights.replace(": 1", ": 2")).contains("final weights"));
}
