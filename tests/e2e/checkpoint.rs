//! Checkpoints: resume is exact in every lesson; a checkpoint saved at N
//! ranks continues at M ranks bit for bit; a killed rank ends the job and the
//! last checkpoint resumes; a kill during a save leaves the previous one; a
//! damaged or mismatched checkpoint is refused with one line, touching nothing.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;

/// Small steps: 24 micro-batches of 2 × 16 tokens (1, 2, 3, 4 ranks divide them).
const RUN: &[&str] = &["--batch-size", "2", "--seq-len", "16", "--micro-batches", "24", "--log-every", "1"];

fn args<'a>(steps: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = RUN.to_vec();
    v.extend(["--steps", steps]);
    v.extend(extra);
    v
}

/// A checkpoint folder for a test (not created: the lesson creates it).
fn ckpt_dir(name: &str) -> PathBuf {
    let d = scratch().join("test-out").join(format!("{name}-ckpt"));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn train(package: &str, ranks: usize, steps: &str, extra: &[&str], name: &str) -> PathBuf {
    let (o, out) = mpirun(package, ranks, &args(steps, extra), name);
    ok_stdout(&o);
    out
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn latest(ck: &Path) -> String {
    std::fs::read_to_string(ck.join("latest")).unwrap().trim().to_string()
}

/// Every file under `dir` with its bytes: to prove a failed resume touched nothing.
fn files(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap().filter_map(Result::ok) {
        let p = e.path();
        if p.is_dir() {
            out.extend(files(&p));
        } else {
            out.insert(p.clone(), std::fs::read(&p).unwrap());
        }
    }
    out
}

fn copy_dir(from: &Path, to: &Path) {
    let _ = std::fs::remove_dir_all(to);
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().filter_map(Result::ok) {
        let dest = to.join(e.file_name());
        if e.path().is_dir() {
            copy_dir(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), dest).unwrap();
        }
    }
}

#[test]
fn resume_is_exact_in_every_lesson() {
    for (pkg, extra) in [
        ("step01-data-parallel", vec![]),
        ("step02-whole-model-shard", vec![]), // with its replicated --check reference, resumed too
        ("step03-layerwise-shard", vec!["--no-plot"]),
        ("step04-optimizer-state-shard", vec![]), // ZeRO-3, bf16
    ] {
        let tag = &pkg[..6];
        let full = train(pkg, 2, "4", &extra, &format!("resume-{tag}-full"));
        let ck = ckpt_dir(&format!("resume-{tag}"));
        let first: Vec<&str> = extra.iter().copied().chain(["--ckpt", s(&ck)]).collect();
        train(pkg, 2, "2", &first, &format!("resume-{tag}-first"));
        assert_eq!(latest(&ck), "step-000002", "{pkg}");
        let second: Vec<&str> = extra.iter().copied().chain(["--resume", s(&ck)]).collect();
        let resumed = train(pkg, 2, "4", &second, &format!("resume-{tag}-second"));
        assert_eq!(digest(&resumed), digest(&full), "{pkg}: stopped at step 2 and resumed, the weights differ");
        let bytes = |d: &Path| std::fs::read(d.join("weights.safetensors")).unwrap();
        assert!(bytes(&resumed) == bytes(&full), "{pkg}: weights files differ");
        // The resumed run trained steps 3 and 4, with the uninterrupted run's losses, bit for bit.
        let (r, f) = (report(&resumed), report(&full));
        assert_eq!(r["first_step"], 3, "{pkg}");
        assert_eq!(r["losses"].as_array().unwrap()[..], f["losses"].as_array().unwrap()[2..], "{pkg}");
        if pkg.starts_with("step02") {
            assert_eq!(r["max_divergence"], 0.0, "the resumed replicated reference agrees");
        }
    }
}

#[test]
fn a_checkpoint_reshards_to_any_world_size_bit_for_bit() {
    // With 12 sum groups the gradient sums round the same at 1, 2, 3 and 4 ranks,
    // and lessons 01–04 (fp32) all compute the same weights.
    let g = ["--sum-groups", "12"];
    let reference = digest(&train("step01-data-parallel", 1, "4", &g, "reshard-reference"));
    let at3 = train("step03-layerwise-shard", 3, "4", &[&g[..], &["--no-plot"]].concat(), "reshard-uninterrupted-3");
    assert_eq!(digest(&at3), reference, "one uninterrupted run at 3 ranks");
    // The price: each rank sends its 12 / 3 = 4 group sums, 4× the default reduce-scatter bytes.
    let r = report(&at3);
    assert_eq!(r["expected_bytes_per_step"]["reduce_scatter"], 4 * 2_159_632);
    assert_eq!(r["traffic"]["reduce_scatter"]["bytes_sent"], 4 * 4 * 2_159_632, "4 steps");
    let fp32_zero = ["--precision", "fp32"];
    for (pkg, before, after, first_extra, second_extra) in [
        ("step03-layerwise-shard", 2, 4, vec!["--no-plot"], vec!["--no-plot"]),
        ("step03-layerwise-shard", 4, 3, vec!["--no-plot"], vec!["--no-plot", "--blocks-per-unit", "2"]),
        ("step03-layerwise-shard", 3, 1, vec!["--no-plot"], vec!["--no-plot"]),
        ("step01-data-parallel", 2, 3, vec![], vec![]),
        ("step02-whole-model-shard", 1, 2, vec!["--no-check"], vec![]),
        // A ZeRO-1 checkpoint from 4 ranks continues as ZeRO-3 on 2: the stage is not in the arithmetic.
        ("step04-optimizer-state-shard", 4, 2, vec!["--stage", "1"], vec!["--stage", "3"]),
    ] {
        let name = format!("reshard-{}-{before}-{after}", &pkg[..6]);
        let ck = ckpt_dir(&name);
        let zero: &[&str] = if pkg.starts_with("step04") { &fp32_zero } else { &[] };
        let first: Vec<&str> = [&g[..], zero, &first_extra, &["--ckpt", s(&ck)]].concat();
        train(pkg, before, "2", &first, &format!("{name}-first"));
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(ck.join("step-000002/meta.json")).unwrap()).unwrap();
        assert_eq!(meta["world_size"], before);
        assert_eq!(meta["files"].as_array().unwrap().len(), before);
        // No --sum-groups here: the checkpoint's 12 groups are taken over.
        let second: Vec<&str> = [zero, &second_extra, &["--resume", s(&ck)]].concat();
        let out = train(pkg, after, "4", &second, &format!("{name}-second"));
        assert_eq!(digest(&out), reference, "{pkg}: saved at {before} ranks, resumed at {after}");
    }
}

/// The default flags but for a short step: M is the default (4) unless given.
fn small(steps: &str, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> =
        ["--batch-size", "2", "--seq-len", "16", "--log-every", "1", "--no-plot", "--steps", steps]
            .map(String::from)
            .to_vec();
    v.extend(extra.iter().map(|x| x.to_string()));
    v
}

fn train_small(package: &str, ranks: usize, args: &[String], name: &str) -> (String, PathBuf) {
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let (o, out) = mpirun(package, ranks, &a, name);
    (ok_stdout(&o), out)
}

#[test]
fn with_default_flags_a_checkpoint_resumes_bit_for_bit_on_power_of_two_world_sizes() {
    // Default: one gradient sum per rank, summed as the pairwise tree over
    // the micro-batches: 1, 2, 4 (and 8) ranks add the same numbers the same way.
    let pkg = "step03-layerwise-shard";
    for (from, to, m) in [(2, 4, None), (4, 1, None), (1, 8, Some("8"))] {
        let tag = format!("default-{from}to{to}");
        let mb: Vec<&str> = m.map(|m| vec!["--micro-batches", m]).unwrap_or_default();
        let (_, full) = train_small(pkg, from, &small("4", &mb), &format!("{tag}-full"));
        let ck = ckpt_dir(&tag);
        let mut first = mb.clone();
        first.extend(["--ckpt", s(&ck)]);
        train_small(pkg, from, &small("2", &first), &format!("{tag}-first"));
        // Resumed with no flag but --resume: M comes from the checkpoint.
        let (stdout, resumed) = train_small(pkg, to, &small("4", &["--resume", s(&ck)]), &format!("{tag}-resumed"));
        assert_eq!(digest(&resumed), digest(&full), "{from} → {to} ranks");
        assert!(!stdout.contains("note:"), "nothing differs, nothing to note: {stdout}");
        assert_eq!(report(&resumed)["resume_notes"], serde_json::json!([]));
        assert_eq!(
            report(&resumed)["losses"].as_array().unwrap()[..],
            report(&full)["losses"].as_array().unwrap()[2..],
            "{from} → {to}: losses of steps 3–4"
        );
    }
}

#[test]
fn other_world_sizes_resume_with_a_note_and_one_that_cannot_split_m_is_refused() {
    let pkg = "step02-whole-model-shard";
    let ck = ckpt_dir("default-2to3");
    train_small(pkg, 2, &small("2", &["--no-check", "--micro-batches", "12", "--ckpt", s(&ck)]), "default-2to3-first");
    // 3 ranks split 12 micro-batches 4 + 4 + 4: another order, said once.
    let (stdout, out) = train_small(pkg, 3, &small("4", &["--no-check", "--resume", s(&ck)]), "default-2to3-resumed");
    let notes: Vec<&str> = stdout.lines().filter(|l| l.starts_with("note:")).collect();
    assert_eq!(notes.len(), 1, "{stdout}");
    assert!(
        notes[0].contains("summed in another order")
            && notes[0].contains("differs from an uninterrupted run by rounding"),
        "{}",
        notes[0]
    );
    assert_eq!(report(&out)["resume_notes"].as_array().unwrap().len(), 1);
    assert_eq!(report(&out)["losses"].as_array().unwrap().len(), 2, "steps 3 and 4 trained");
    // 5 ranks cannot split 12: one line naming --micro-batches.
    let e = fails(pkg, 5, &["--steps", "4", "--resume", s(&ck)], "default-2to5");
    assert!(e.contains("--micro-batches 12 does not divide among 5 ranks") && e.contains("--micro-batches 15"), "{e}");
    // Passing --micro-batches on resume is allowed, and noted: the global batch changes.
    let (stdout, _) = train_small(
        pkg,
        2,
        &small("4", &["--no-check", "--micro-batches", "4", "--resume", s(&ck)]),
        "default-2to2-m4",
    );
    assert!(
        stdout.contains(
            "note: --micro-batches 4 where the checkpoint trained with 12: the global batch changes from step 3 on"
        ),
        "{stdout}"
    );
}

#[test]
fn save_every_and_keep_leave_the_newest_checkpoints_and_export_consolidates_them() {
    let ck = ckpt_dir("keep");
    let out = train(
        "step03-layerwise-shard",
        3,
        "5",
        &["--no-plot", "--ckpt", s(&ck), "--save-every", "1", "--keep", "2"],
        "keep",
    );
    let mut left: Vec<String> =
        std::fs::read_dir(&ck).unwrap().filter_map(Result::ok).map(|e| e.file_name().into_string().unwrap()).collect();
    left.sort();
    assert_eq!(left, ["latest", "step-000004", "step-000005"]);
    assert_eq!(latest(&ck), "step-000005");
    let shards: Vec<String> = std::fs::read_dir(ck.join("step-000005"))
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.file_name().into_string().unwrap())
        .collect();
    assert_eq!(shards.len(), 4, "meta.json and three shards: {shards:?}");

    // fsdp-export: one nanoGPT-named file with the run's final weights.
    let exported = out.join("exported.safetensors");
    let o = Command::new(binary("fsdp-export")).args(["--ckpt", s(&ck), "--out", s(&exported)]).output().unwrap();
    let stdout = ok_stdout(&o);
    assert!(stdout.contains("step03-layerwise-shard at step 5, 3 shard file(s) from 3 rank(s)"), "{stdout}");
    let w = fsdp_gpt::weights_file::load(&exported).unwrap(); // checks every nanoGPT name and shape
    assert_eq!(format!("{:016x}", fsdp_gpt::params::digest_f32(&w.flat)), digest(&out));
    assert!(
        std::fs::read(&exported).unwrap() == std::fs::read(out.join("weights.safetensors")).unwrap(),
        "the same file as the run's own weights"
    );
    // A folder with no checkpoint: one line, exit 2, nothing written.
    let nothing = out.join("not-exported.safetensors");
    let o = Command::new(binary("fsdp-export")).args(["--ckpt", s(&out), "--out", s(&nothing)]).output().unwrap();
    let (code, lines) = failure(&o);
    assert_eq!((code, lines.len()), (2, 1), "{lines:?}");
    assert!(
        lines[0].contains("no checkpoint there (no meta.json, no `latest` pointer)") && !nothing.exists(),
        "{lines:?}"
    );
}

/// The rank processes mpirun started (its children), from /proc.
fn children(pid: u32) -> Vec<u32> {
    let mut v = vec![];
    for e in std::fs::read_dir("/proc").unwrap().filter_map(Result::ok) {
        let Ok(child) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else { continue };
        // pid (comm) state ppid …: comm may hold spaces, so split after its ')'.
        let ppid = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
        if ppid == Some(pid) {
            v.push(child);
        }
    }
    v.sort();
    v
}

/// A running mpirun job in its own process group: dropped (a failed assert
/// included), the whole group — mpirun and every rank — is killed.
struct Job(std::process::Child);

impl Drop for Job {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            for rank in children(self.0.id()) {
                signal(rank as i32, SIGKILL);
            }
            signal(-(self.0.id() as i32), SIGKILL); // the group: mpirun and what it started
            let _ = self.0.wait();
        }
    }
}

/// Waits for a job to end, at most `limit`; a job still running then is a hang.
fn wait_at_most(job: &mut Job, limit: Duration) -> (Output, Duration) {
    let t0 = Instant::now();
    while job.0.try_wait().unwrap().is_none() {
        assert!(t0.elapsed() < limit, "the job was still running {limit:?} after the fault: a hung rank");
        std::thread::sleep(Duration::from_millis(50));
    }
    let elapsed = t0.elapsed();
    let mut out = Output { status: job.0.wait().unwrap(), stdout: vec![], stderr: vec![] };
    use std::io::Read;
    job.0.stderr.take().map(|mut e| e.read_to_end(&mut out.stderr));
    (out, elapsed)
}

fn spawn(package: &str, ranks: usize, args: &[&str], name: &str, env: &[(&str, &str)]) -> Job {
    use std::os::unix::process::CommandExt;
    let (mut cmd, _) = mpirun_command(package, ranks, args, name);
    cmd.envs(env.iter().copied()).stdout(Stdio::null()).stderr(Stdio::piped()).process_group(0);
    Job(cmd.spawn().expect("mpirun starts"))
}

/// Which of mpirun's children is MPI rank `rank` (from its environment).
fn rank_pid(ranks: &[u32], rank: usize) -> u32 {
    let wanted = format!("OMPI_COMM_WORLD_RANK={rank}");
    *ranks
        .iter()
        .find(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|&b| b == 0).any(|v| v == wanted.as_bytes()))
        })
        .expect("a child with that rank")
}

#[test]
fn a_rank_killed_mid_run_ends_the_job_and_the_last_checkpoint_resumes_exactly() {
    let ck = ckpt_dir("sigkill");
    // Open MPI's default teardown interval (1 s), whatever the caller's environment says (`just` sets 3).
    let mut job = spawn(
        "step03-layerwise-shard",
        2,
        &args("100000", &["--no-plot", "--ckpt", s(&ck), "--save-every", "2"]),
        "sigkill",
        &[("OMPI_MCA_odls_base_sigkill_timeout", "1")],
    );
    // Wait for the checkpoint of step 4, then SIGKILL rank 1 (found by its OMPI_COMM_WORLD_RANK) while it trains.
    let t0 = Instant::now();
    while !std::fs::read_to_string(ck.join("latest")).is_ok_and(|l| l.trim() >= "step-000004") {
        assert!(t0.elapsed() < Duration::from_secs(120), "no checkpoint of step 4 after 120 s");
        assert!(job.0.try_wait().unwrap().is_none(), "the job ended before the kill");
        std::thread::sleep(Duration::from_millis(20));
    }
    let ranks = children(job.0.id());
    assert_eq!(ranks.len(), 2, "mpirun's children: {ranks:?}");
    assert!(signal(rank_pid(&ranks, 1) as i32, SIGKILL));
    let (o, took) = wait_at_most(&mut job, Duration::from_secs(30));
    assert!(!o.status.success(), "a job with a killed rank must fail");
    eprintln!("SIGKILL of rank 1: the job ended {took:?} later");
    // mpirun's teardown: SIGCONT, SIGTERM after 1 s (ignored: a rank cannot
    // tell it from a stop), SIGKILL 1 s later.
    assert!(took < Duration::from_secs(5), "a killed rank ends the job within mpirun's teardown: {took:?}");

    // The newest complete checkpoint loads and continues the uninterrupted run exactly.
    let step: u64 = latest(&ck)["step-".len()..].parse().unwrap();
    let until = (step + 2).to_string();
    let resumed = train("step03-layerwise-shard", 2, &until, &["--no-plot", "--resume", s(&ck)], "sigkill-resumed");
    let full = train("step03-layerwise-shard", 2, &until, &["--no-plot"], "sigkill-uninterrupted");
    assert_eq!(digest(&resumed), digest(&full), "resumed from step {step}");
}

/// Open MPI's interval between the SIGCONT it sends on a signal, its SIGTERM
/// (which the ranks stop on) and its SIGKILL, in seconds (default 1; the
/// justfile sets 3). mpirun sits out the whole sequence, about twice this.
const GRACE: (&str, &str) = ("OMPI_MCA_odls_base_sigkill_timeout", "3");

/// Seconds until every rank of `job` has exited (mpirun may linger after,
/// its exited ranks zombies it has not reaped yet).
fn ranks_gone_after(job: &Job, t0: Instant) -> Duration {
    let running = |pid: &u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|st| st.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z')))
    };
    while children(job.0.id()).iter().any(running) {
        assert!(t0.elapsed() < Duration::from_secs(30), "ranks still running 30 s after the signal");
        std::thread::sleep(Duration::from_millis(20));
    }
    t0.elapsed()
}

#[test]
fn sigterm_to_mpirun_finishes_the_step_saves_and_the_checkpoint_resumes_exactly() {
    let ck = ckpt_dir("sigterm");
    let mut job = spawn(
        "step03-layerwise-shard",
        2,
        &args("100000", &["--no-plot", "--ckpt", s(&ck), "--save-every", "1000"]),
        "sigterm",
        &[GRACE],
    );
    std::thread::sleep(Duration::from_secs(3)); // a few steps in, no checkpoint yet
    assert!(!ck.join("latest").exists() && job.0.try_wait().unwrap().is_none());
    assert!(signal(job.0.id() as i32, SIGTERM));
    let (o, took) = wait_at_most(&mut job, Duration::from_secs(30));
    let (code, lines) = failure(&o);
    assert_ne!(code, 0, "a stopped job exits non-zero");
    assert_eq!(lines.len(), 1, "one line: {lines:?}");
    let step: u64 = latest(&ck)["step-".len()..].parse().unwrap();
    assert!(step >= 1, "a checkpoint of the step it was in");
    let want = format!(
        "after step {step}: checkpoint {}; resume with --resume {}",
        s(&ck.join(format!("step-{step:06}"))),
        s(&ck)
    );
    assert!(lines[0].starts_with("stopped by mpirun") && lines[0].ends_with(&want), "{lines:?}");
    assert!(
        !std::fs::read_dir(&ck)
            .unwrap()
            .filter_map(Result::ok)
            .any(|e| e.file_name().to_string_lossy().starts_with('.')),
        "no partial save left"
    );
    eprintln!("SIGTERM to mpirun: stopped after step {step}, the job ended {took:?} later");
    // Resumed at 4 ranks (default flags: the same order), exactly the uninterrupted run.
    let until = (step + 2).to_string();
    let resumed = train("step03-layerwise-shard", 4, &until, &["--no-plot", "--resume", s(&ck)], "sigterm-resumed");
    let full = train("step03-layerwise-shard", 2, &until, &["--no-plot"], "sigterm-uninterrupted");
    assert_eq!(digest(&resumed), digest(&full), "resumed from step {step}");
}

#[test]
fn a_second_job_on_a_ckpt_folder_is_refused_and_a_dead_jobs_lock_is_taken_over() {
    let ck = ckpt_dir("lock");
    let lock = ck.join(".lock");
    // Job A trains on, holding the folder from its start.
    let mut a = spawn("step01-data-parallel", 2, &args("100000", &["--ckpt", s(&ck)]), "lock-a", &[]);
    let t0 = Instant::now();
    while !std::fs::read_to_string(&lock).is_ok_and(|l| l.ends_with('\n')) {
        assert!(t0.elapsed() < Duration::from_secs(60), "job A took no lock in 60 s");
        assert!(a.0.try_wait().unwrap().is_none(), "job A ended before the test");
        std::thread::sleep(Duration::from_millis(20));
    }
    let a0 = rank_pid(&children(a.0.id()), 0);
    let holder = format!("pid {a0}, step01-data-parallel on 2 rank(s)");
    // Job B, the same folder: refused at start, one line naming A's host and process.
    let line = fails("step01-data-parallel", 2, &args("3", &["--ckpt", s(&ck)]), "lock-b");
    let want = format!("error: --ckpt {} is in use by another job (host ", s(&ck));
    assert!(line.starts_with(&want) && line.contains(&holder), "{line}");
    assert!(line.ends_with("): wait for it to end, or pass another folder"), "{line}");
    // A dies without releasing it (every process SIGKILLed): its file stays, its flock is gone.
    drop(a);
    assert!(std::fs::read_to_string(&lock).unwrap().contains(&holder), "a killed job cannot remove its lock file");
    // Job C takes it over with a note naming A, trains, saves, and removes the lock as it ends.
    let (o, _) = mpirun("step01-data-parallel", 2, &args("2", &["--ckpt", s(&ck)]), "lock-c");
    let out = ok_stdout(&o);
    let note = format!("note: --ckpt {}: its lock was left by a job that ended without releasing it (host ", s(&ck));
    let note_line = out.lines().find(|l| l.starts_with(&note)).unwrap_or_else(|| panic!("no takeover note in:\n{out}"));
    assert!(note_line.ends_with(&format!("{holder}): taken over")), "{note_line}");
    assert!(!lock.exists(), "a job that ends normally removes its lock");
    assert_eq!(latest(&ck), "step-000002");
}

#[test]
fn sigint_without_ckpt_ends_after_the_step_with_one_line_and_writes_nothing() {
    let (mut cmd, out) = mpirun_command("step01-data-parallel", 2, &args("100000", &[]), "sigint");
    use std::os::unix::process::CommandExt;
    cmd.env(GRACE.0, GRACE.1).stdout(Stdio::null()).stderr(Stdio::piped()).process_group(0);
    let mut job = Job(cmd.spawn().unwrap());
    std::thread::sleep(Duration::from_secs(3));
    let t0 = Instant::now();
    assert!(signal(job.0.id() as i32, SIGINT));
    let took = ranks_gone_after(&job, t0);
    let (o, _) = wait_at_most(&mut job, Duration::from_secs(30));
    let (code, lines) = failure(&o);
    assert_ne!(code, 0);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].starts_with("stopped by mpirun")
            && lines[0].contains(" after step ")
            && lines[0].contains("nothing saved (pass --ckpt DIR"),
        "{lines:?}"
    );
    // SIGTERM reaches the ranks 3 s after mpirun's SIGINT, SIGKILL 3 s later:
    // they must be gone before it, having finished their step.
    assert!(
        took < Duration::from_millis(5500),
        "the ranks end after the step they are in, not at SIGKILL (6 s): {took:?}"
    );
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 0, "nothing written to --out");
    // Without mpirun the process ends at once, from the signal handler.
    let out = out_dir("sigterm-direct");
    let child = Command::new(binary("step01-data-parallel"))
        .args(args("100000", &["--out", s(&out)]))
        .env("RAYON_NUM_THREADS", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(2));
    assert!(signal(child.id() as i32, SIGTERM));
    let o = child.wait_with_output().unwrap();
    let (code, lines) = failure(&o);
    assert_eq!(code, 128 + 15, "{lines:?}");
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].starts_with("stopped by SIGTERM during step ")
            && lines[0].ends_with("nothing saved (pass --ckpt DIR to save a checkpoint when stopped)"),
        "{lines:?}"
    );
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 0);
}

#[test]
fn a_save_that_fails_on_a_full_disk_frees_its_space_and_keeps_the_last_checkpoint() {
    const TEST: &str = "checkpoint::a_save_that_fails_on_a_full_disk_frees_its_space_and_keeps_the_last_checkpoint";
    let Ok(unshare) = private_mounts() else {
        skip(TEST, &namespaces().unwrap_err());
        return;
    };
    // A 12 MB disk: a tmpfs in a mount namespace of the job's own (so nothing outlives it), where
    // one checkpoint of the tiny model (9.72 MB) fits and a second does not. After the job, the
    // shell lists what the checkpoint folder holds, before the namespace and its tmpfs are gone.
    let disk = out_dir("full-disk");
    let ck = disk.join("ckpt");
    let (job, _) = mpirun_command(
        "step01-data-parallel",
        2,
        &args("2", &["--ckpt", s(&ck), "--save-every", "1", "--keep", "2"]),
        "full-disk-run",
    );
    let script = r#"mount -t tmpfs -o size=12m tmpfs "$0" || exit 99
"$@"; rc=$?
echo "left: $(ls "$0/ckpt" | tr '\n' ' ')"
echo "latest: $(cat "$0/ckpt/latest")"
exit $rc"#;
    let o = Command::new("unshare")
        .args(unshare)
        .args(["sh", "-c", script])
        .arg(&disk)
        .arg(job.get_program())
        .args(job.get_args())
        .envs(job.get_envs().filter_map(|(k, v)| Some((k, v?))))
        .output()
        .expect("unshare runs (util-linux)");
    assert_ne!(o.status.code(), Some(99), "the tmpfs mounts: {}", String::from_utf8_lossy(&o.stderr));
    let (code, lines) = failure(&o);
    assert_eq!((code, lines.len()), (2, 1), "{lines:?}");
    assert!(lines[0].contains("No space left on device"), "{lines:?}");
    let stdout = String::from_utf8_lossy(&o.stdout);
    let said = |key: &str| stdout.lines().find_map(|l| l.strip_prefix(key)).unwrap_or_default().trim().to_string();
    assert_eq!(said("left: "), "latest step-000001", "the failed save's partial folder is gone");
    assert_eq!(said("latest: "), "step-000001");
}

#[test]
fn a_kill_during_a_save_leaves_the_previous_checkpoint_valid() {
    let ck = ckpt_dir("kill-in-save");
    let run = args("6", &["--no-plot", "--ckpt", s(&ck), "--save-every", "2"]);
    let mut job = spawn("step03-layerwise-shard", 2, &run, "kill-in-save", &[("FSDP_FAILPOINT", "kill-during-save:4")]);
    let (o, _) = wait_at_most(&mut job, Duration::from_secs(120));
    assert!(!o.status.success());
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains("failpoint: rank 1 kills itself (SIGKILL) during the save of step 4"), "{stderr}");
    // Step 4's shards were half written; `latest` still names step 2, complete.
    assert_eq!(latest(&ck), "step-000002");
    assert!(ck.join(".step-000004.partial").is_dir(), "the killed save's partial folder");
    assert!(!ck.join("step-000004").exists());
    let resumed = train(
        "step03-layerwise-shard",
        2,
        "6",
        &["--no-plot", "--resume", s(&ck), "--ckpt", s(&ck)],
        "kill-in-save-resumed",
    );
    let full = train("step03-layerwise-shard", 2, "6", &["--no-plot"], "kill-in-save-uninterrupted");
    assert_eq!(digest(&resumed), digest(&full));
    assert!(!ck.join(".step-000004.partial").exists(), "the next save cleared the partial folder");
    assert_eq!(latest(&ck), "step-000006");
}

/// A good checkpoint of lesson 03 (2 ranks, step 2), copied to `name` for damaging.
fn good_checkpoint(name: &str) -> PathBuf {
    let ck = ckpt_dir(&format!("{name}-good"));
    train("step03-layerwise-shard", 2, "2", &["--no-plot", "--ckpt", s(&ck)], &format!("{name}-good"));
    let copy = ckpt_dir(name);
    copy_dir(&ck, &copy);
    copy
}

/// Resuming `ck` with `extra` must fail with one line containing `expect`, and leave `ck` as it was.
fn refused(package: &str, ck: &Path, extra: &[&str], name: &str, expect: &str) -> String {
    let before = files(ck);
    let mut a: Vec<&str> = extra.to_vec();
    a.extend(["--resume", s(ck), "--ckpt", s(ck)]); // saving back into it is allowed, and must not happen
    let e = fails(package, 2, &args("4", &a), name);
    assert!(e.contains(expect), "{name}: {e}");
    assert!(files(ck) == before, "{name}: the checkpoint folder changed");
    e
}

#[test]
fn damaged_checkpoints_are_refused_with_one_line_and_left_untouched() {
    let ck = good_checkpoint("damaged");
    let step = ck.join("step-000002");
    let shard1 = step.join("shard-001-of-002.safetensors");

    // One flipped byte in the middle of a shard.
    let mut data = std::fs::read(&shard1).unwrap();
    let original = data.clone();
    let mid = data.len() / 2;
    data[mid] ^= 0x40;
    std::fs::write(&shard1, &data).unwrap();
    refused(
        "step03-layerwise-shard",
        &ck,
        &["--no-plot"],
        "damaged-flip",
        "shard shard-001-of-002.safetensors fails its SHA-256 check: the file is corrupt",
    );
    std::fs::write(&shard1, &original).unwrap();

    // A truncated shard.
    std::fs::write(&shard1, &original[..original.len() / 3]).unwrap();
    refused("step03-layerwise-shard", &ck, &["--no-plot"], "damaged-truncated", "the file is truncated or replaced");
    std::fs::write(&shard1, &original).unwrap();

    // A checksum in meta.json that does not match.
    let meta_path = step.join("meta.json");
    let meta = std::fs::read_to_string(&meta_path).unwrap();
    let v: serde_json::Value = serde_json::from_str(&meta).unwrap();
    let sha = v["files"][0]["sha256"].as_str().unwrap();
    std::fs::write(&meta_path, meta.replace(sha, &"0".repeat(64))).unwrap();
    refused(
        "step03-layerwise-shard",
        &ck,
        &["--no-plot"],
        "damaged-checksum",
        "shard shard-000-of-002.safetensors fails its SHA-256 check",
    );

    // meta.json that is not JSON; and a missing shard.
    std::fs::write(&meta_path, "{ not json").unwrap();
    refused("step03-layerwise-shard", &ck, &["--no-plot"], "damaged-meta", "meta.json is not valid");
    std::fs::write(&meta_path, &meta).unwrap();
    std::fs::remove_file(&shard1).unwrap();
    refused(
        "step03-layerwise-shard",
        &ck,
        &["--no-plot"],
        "damaged-missing",
        "cannot read shard shard-001-of-002.safetensors",
    );
    std::fs::write(&shard1, &original).unwrap();

    // A file list out of order (shards would land in the wrong place).
    let swapped = meta
        .replacen("shard-000-of-002", "shard-XXX-of-002", 1)
        .replacen("shard-001-of-002", "shard-000-of-002", 1)
        .replacen("shard-XXX-of-002", "shard-001-of-002", 1);
    std::fs::write(&meta_path, swapped).unwrap();
    refused(
        "step03-layerwise-shard",
        &ck,
        &["--no-plot"],
        "damaged-order",
        "lists shard-001-of-002.safetensors as rank 0's shard at position 0",
    );
    // A meta.json that claims another step than its shards were written at.
    std::fs::write(&meta_path, meta.replace("\"step\": 2", "\"step\": 3").replace("\"t\": 2", "\"t\": 3")).unwrap();
    refused("step03-layerwise-shard", &ck, &["--no-plot"], "damaged-step", "was not written by rank 0 of 2 at step 3");
    std::fs::write(&meta_path, &meta).unwrap();

    // Restored, it resumes.
    train("step03-layerwise-shard", 2, "3", &["--no-plot", "--resume", s(&ck)], "damaged-restored");
}

#[test]
fn mismatched_checkpoints_are_refused_naming_the_flag() {
    let ck = good_checkpoint("mismatch");
    let e = refused(
        "step03-layerwise-shard",
        &ck,
        &["--preset", "small"],
        "mismatch-preset",
        "pass --preset tiny to resume it",
    );
    assert_eq!(
        e,
        format!(
            "error: checkpoint {} was trained with --preset tiny; this run has --preset small: pass --preset tiny to resume it",
            ck.display()
        )
    );
    refused(
        "step03-layerwise-shard",
        &ck,
        &["--weight-decay", "0.1"],
        "mismatch-decay",
        "was trained with --weight-decay 0.01; this run has --weight-decay 0.1",
    );
    // --grad-clip changes the arithmetic: refused both ways
    refused(
        "step03-layerwise-shard",
        &ck,
        &["--grad-clip", "1"],
        "mismatch-clip-on",
        "was trained without --grad-clip; this run has --grad-clip 1: leave --grad-clip out to resume it",
    );
    let other_batch = [
        "--batch-size",
        "4",
        "--seq-len",
        "16",
        "--micro-batches",
        "24",
        "--steps",
        "4",
        "--no-plot",
        "--resume",
        s(&ck),
    ];
    let e = fails("step03-layerwise-shard", 2, &other_batch, "mismatch-batch");
    assert!(
        e.contains("was trained with --batch-size 2; this run has --batch-size 4: pass --batch-size 2 to resume it"),
        "{e}"
    );
    refused("step03-layerwise-shard", &ck, &["--seed", "7"], "mismatch-seed", "pass --seed 1337");
    refused("step03-layerwise-shard", &ck, &["--lr", "0.002"], "mismatch-lr", "pass --lr 0.001");
    let text = scratch().join("test-out").join("mismatch-data.txt");
    std::fs::write(&text, "To be, or not to be, that is the question. ".repeat(40)).unwrap();
    refused(
        "step03-layerwise-shard",
        &ck,
        &["--data", s(&text)],
        "mismatch-data",
        "was trained on other data (generated: 262200 chars, vocab 65)",
    );
    // A checkpoint of another lesson — also at a world size its grouping cannot take: the lesson is named first.
    refused(
        "step02-whole-model-shard",
        &ck,
        &[],
        "mismatch-lesson",
        "was written by step03-layerwise-shard, not step02-whole-model-shard",
    );
    let e = fails("step02-whole-model-shard", 4, &args("4", &["--resume", s(&ck)]), "mismatch-lesson-4");
    assert!(e.contains("was written by step03-layerwise-shard"), "{e}");
    // Nothing left to train.
    let e = fails("step03-layerwise-shard", 2, &args("2", &["--resume", s(&ck)]), "mismatch-steps");
    assert!(e.contains("is at step 2; --steps 2 leaves nothing to train: pass --steps 3 or more"), "{e}");
    // Lesson 04's precision is part of its arithmetic.
    let ck4 = ckpt_dir("mismatch-precision");
    train("step04-optimizer-state-shard", 2, "2", &["--ckpt", s(&ck4)], "mismatch-precision-good");
    refused(
        "step04-optimizer-state-shard",
        &ck4,
        &["--precision", "fp32"],
        "mismatch-precision",
        "was trained with --precision bf16; this run has --precision fp32",
    );
    // So is the reduce dtype: refused both ways (an fp32 checkpoint records no flag).
    refused(
        "step04-optimizer-state-shard",
        &ck4,
        &["--reduce-dtype", "bf16"],
        "mismatch-reduce-on",
        "was trained without --reduce-dtype; this run has --reduce-dtype bf16: leave --reduce-dtype out to resume it",
    );
    let ck16 = ckpt_dir("mismatch-reduce");
    train(
        "step04-optimizer-state-shard",
        2,
        "2",
        &["--ckpt", s(&ck16), "--reduce-dtype", "bf16"],
        "mismatch-reduce-good",
    );
    refused(
        "step04-optimizer-state-shard",
        &ck16,
        &[],
        "mismatch-reduce-off",
        "was trained with --reduce-dtype bf16; this run has no --reduce-dtype: pass --reduce-dtype bf16 to resume it",
    );
}

#[test]
fn checkpoint_flags_out_of_range() {
    let e = fails("step01-data-parallel", 2, &args("2", &["--save-every", "1"]), "ckflag-no-ckpt");
    assert_eq!(e, "error: --save-every needs --ckpt DIR: the folder to write checkpoints into");
    let e = fails("step02-whole-model-shard", 2, &args("2", &["--ckpt", "x", "--keep", "0"]), "ckflag-keep");
    assert!(e.contains("'0' for '--keep <N>'"), "{e}");
    let e = fails("step03-layerwise-shard", 2, &args("2", &["--resume", "/nonexistent/ckpt"]), "ckflag-resume-missing");
    assert!(e.contains("--resume /nonexistent/ckpt: no such folder"), "{e}");
    let empty = ckpt_dir("ckflag-empty");
    std::fs::create_dir_all(&empty).unwrap();
    let e = fails("step04-optimizer-state-shard", 2, &args("2", &["--resume", s(&empty)]), "ckflag-resume-empty");
    assert!(e.contains("no checkpoint there (no meta.json, no `latest` pointer)"), "{e}");
    let e = fails("step01-data-parallel", 2, &args("2", &["--ckpt", "/proc/no-such-place"]), "ckflag-unwritable");
    assert!(e.contains("--ckpt /proc/no-such-place: cannot write there"), "{e}");
    let e = fails("step03-layerwise-shard", 2, &args("2", &["--sum-groups", "5"]), "ckflag-groups-divide");
    assert!(e.contains("--sum-groups 5 must divide --micro-batches 24"), "{e}");
    let e = fails("step02-whole-model-shard", 2, &args("2", &["--sum-groups", "3"]), "ckflag-groups-split");
    assert!(e.contains("--sum-groups 3 does not split among 2 ranks"), "{e}");
    let e = fails(
        "step01-data-parallel",
        2,
        &args("2", &["--sum-groups", "4", "--reduce", "native"]),
        "ckflag-groups-native",
    );
    assert!(e.contains("--reduce native sums one buffer per rank"), "{e}");
    // A fresh run must not write over another run's checkpoints.
    let ck = ckpt_dir("ckflag-occupied");
    train("step01-data-parallel", 1, "1", &["--ckpt", s(&ck)], "ckflag-occupied-first");
    let before = files(&ck);
    let e = fails("step01-data-parallel", 2, &args("2", &["--ckpt", s(&ck)]), "ckflag-occupied");
    assert!(e.contains("already holds checkpoints of another run: pass --resume"), "{e}");
    assert!(files(&ck) == before);
}

#[test]
fn resuming_an_older_checkpoint_into_its_folder_abandons_the_later_ones() {
    let ck = ckpt_dir("older");
    train(
        "step03-layerwise-shard",
        2,
        "4",
        &["--no-plot", "--ckpt", s(&ck), "--save-every", "1", "--keep", "10"],
        "older-first",
    );
    assert_eq!(latest(&ck), "step-000004");
    let from = ck.join("step-000002");
    let out = train(
        "step03-layerwise-shard",
        2,
        "3",
        &["--no-plot", "--resume", s(&from), "--ckpt", s(&ck), "--keep", "10"],
        "older-resumed",
    );
    let full = train("step03-layerwise-shard", 2, "3", &["--no-plot"], "older-uninterrupted");
    assert_eq!(digest(&out), digest(&full));
    // Step 4 belonged to the abandoned future: gone; step 3 is the new latest.
    let mut left: Vec<String> =
        std::fs::read_dir(&ck).unwrap().filter_map(Result::ok).map(|e| e.file_name().into_string().unwrap()).collect();
    left.sort();
    assert_eq!(left, ["latest", "step-000001", "step-000002", "step-000003"]);
    assert_eq!(latest(&ck), "step-000003");
}

#[test]
fn a_budget_that_fits_training_also_fits_a_resumed_run() {
    // ZeRO-3 under a budget 5% above its own measured peak: a resume reads
    // only each rank's shard of the checkpoint, so it fits the same budget.
    let full = train("step04-optimizer-state-shard", 2, "4", &[], "budget-full");
    let peak =
        report(&full)["measured_peak_bytes"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).max().unwrap();
    let budget = format!("{}", peak + peak / 20);
    let ck = ckpt_dir("budget");
    train("step04-optimizer-state-shard", 2, "2", &["--mem-budget", &budget, "--ckpt", s(&ck)], "budget-first");
    let resumed =
        train("step04-optimizer-state-shard", 2, "4", &["--mem-budget", &budget, "--resume", s(&ck)], "budget-resumed");
    assert_eq!(digest(&resumed), digest(&full));
}
