//! Helpers shared by the end-to-end tests: run a lesson binary as a real MPI
//! job, read its report, mask what varies from run to run.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The small, fast configuration every end-to-end test trains with: the tiny
/// preset (809,856 params), 24 micro-batches of 2 × 16 tokens per step, so
/// that 1, 2, 3, 4 and 8 ranks all divide the global batch.
pub const FAST: &[&str] =
    &["--steps", "3", "--batch-size", "2", "--seq-len", "16", "--micro-batches", "24", "--log-every", "1"];

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The release binary of a lesson package (built by `just test` before the tests run).
pub fn binary(package: &str) -> PathBuf {
    let dir = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root().join("target"));
    let p = dir.join("release").join(package);
    assert!(
        p.exists(),
        "{} is missing: run `cargo build --release --workspace --bins` first (`just test` does)",
        p.display()
    );
    p
}

/// Where the tests write: this checkout's `target/`, or `$FSDP_TEST_OUT` (CI
/// runs the tests that make namespaces once more as a normal user, who may
/// not write the checkout).
pub fn scratch() -> PathBuf {
    std::env::var_os("FSDP_TEST_OUT").map(PathBuf::from).unwrap_or_else(|| root().join("target"))
}

/// A fresh folder for one run's outputs.
pub fn out_dir(name: &str) -> PathBuf {
    let d = scratch().join("test-out").join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// As the justfile: libevent's poll backend in mpirun and the ranks' PMIx,
/// not epoll, whose race with a rank's sockets closing on MPI_Abort once,
/// under CI's load, added a second stderr line ("[warn] Epoll MOD(1) on fd
/// 25 failed …"; cf. open-mpi/ompi#2004). Every test that checks an mpirun's
/// stderr sets it.
pub const NO_EPOLL: (&str, &str) = ("EVENT_NOEPOLL", "1");

/// What every test's mpirun runs with: root allowed, one compute thread per
/// rank, Open MPI's own teardown interval (not the justfile's 3 s: when a
/// rank exits non-zero, mpirun sends the ranks it has not yet seen end
/// SIGTERM after this interval and SIGKILL one interval later, even if they
/// were ending anyway — a refused run takes 1.5 s instead of 5.8; the tests
/// that stop a run with a signal and need time to save set their own), and
/// [`NO_EPOLL`].
pub const MPIRUN_ENV: [(&str, &str); 5] = [
    ("OMPI_ALLOW_RUN_AS_ROOT", "1"),
    ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
    ("RAYON_NUM_THREADS", "1"),
    ("OMPI_MCA_odls_base_sigkill_timeout", "1"),
    NO_EPOLL,
];

/// The mpirun command for `package` on `ranks` ranks with `args`, and its
/// fresh `--out` folder (added unless `args` name one).
pub fn mpirun_command(package: &str, ranks: usize, args: &[&str], name: &str) -> (Command, PathBuf) {
    let out = out_dir(name);
    // Each job gets its own TMPDIR: Open MPI creates its session directory
    // there, and concurrent mpiruns sharing one race on creating it
    // ("ORTE_ERROR_LOG: Error in file orte/util/session_dir.c").
    let tmp = scratch().join("test-tmp").join(name);
    std::fs::create_dir_all(&tmp).unwrap();
    let mut cmd = Command::new("mpirun");
    cmd.args(["-q", "--oversubscribe", "-n", &ranks.to_string()])
        .arg(binary(package))
        .args(args)
        .envs(MPIRUN_ENV)
        .env("TMPDIR", &tmp);
    if !args.contains(&"--out") {
        cmd.arg("--out").arg(&out);
    }
    (cmd, out)
}

/// Runs `package` on `ranks` MPI ranks with `args`; `--out` is set to a fresh folder.
pub fn mpirun(package: &str, ranks: usize, args: &[&str], name: &str) -> (Output, PathBuf) {
    let (mut cmd, out) = mpirun_command(package, ranks, args, name);
    let o = cmd.output().expect("mpirun runs (install Open MPI: `just setup`)");
    (o, out)
}

/// Runs a binary directly, without mpirun (a world of one).
pub fn run_direct(package: &str, args: &[&str], name: &str) -> (Output, PathBuf) {
    let out = out_dir(name);
    let o = Command::new(binary(package))
        .args(args)
        .arg("--out")
        .arg(&out)
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .expect("binary runs");
    (o, out)
}

/// Stdout of a run that must have succeeded.
pub fn ok_stdout(o: &Output) -> String {
    let stdout = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        o.status.success(),
        "run failed ({:?})\nstdout:\n{stdout}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    stdout
}

/// The report's deterministic part: drops every block (paragraph) that holds
/// a measured quantity and masks throughput on the step lines. What is left —
/// config, losses, tallies from shapes, bytes on the wire, digest — is pinned.
pub fn deterministic(stdout: &str) -> String {
    stdout
        .split("\n\n")
        .filter(|block| !block.contains("measured"))
        .map(|block| {
            block
                .lines()
                .map(|l| match l.find(" | ").zip(l.rfind(" tok/s")) {
                    Some(_) if l.starts_with("step ") => format!("{} | [tok/s]", &l[..l.rfind(" | ").unwrap()]),
                    _ => l.to_string(),
                })
                .collect::<Vec<_>>()
                .join("\n")
        })
        .collect::<Vec<_>>()
        .join("\n\n")
}

pub fn report(out: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(out.join("report.json")).expect("report.json written");
    serde_json::from_str(&text).expect("report.json parses")
}

/// The exact digest of the final weights' f32 bits, from the report.
pub fn digest(out: &Path) -> String {
    report(out)["weights_digest"].as_str().expect("digest present").to_string()
}

/// A failing run: exit code, and stderr's lines.
pub fn failure(o: &Output) -> (i32, Vec<String>) {
    let code = o.status.code().unwrap_or(-1);
    let err = String::from_utf8_lossy(&o.stderr).lines().map(str::to_string).filter(|l| !l.trim().is_empty()).collect();
    (code, err)
}

/// A bad-input case: exit code 2, exactly one line on stderr (rank 0's,
/// starting `error: `, or `error (rank R): ` when rank R found it — e.g. the
/// rank that checked a damaged file), no panic or backtrace, and nothing
/// written to the run's --out folder. Returns the error line.
pub fn fails(package: &str, ranks: usize, args: &[&str], name: &str) -> String {
    fails_with_env(package, ranks, args, &[], name)
}

/// [`fails`], with environment variables set for every rank.
pub fn fails_with_env(package: &str, ranks: usize, args: &[&str], env: &[(&str, &str)], name: &str) -> String {
    let (mut cmd, out) = mpirun_command(package, ranks, args, name);
    cmd.envs(env.iter().copied());
    let o = cmd.output().expect("mpirun runs (install Open MPI: `just setup`)");
    let (code, lines) = failure(&o);
    assert_eq!(code, 2, "{name}: exit code; stderr {lines:?}");
    assert_eq!(lines.len(), 1, "{name}: exactly one line on stderr, got {lines:?}");
    assert!(lines[0].starts_with("error: ") || lines[0].starts_with("error (rank "), "{name}: {lines:?}");
    assert!(!lines[0].contains("panicked") && !lines[0].contains("backtrace"), "{name}: {lines:?}");
    let left: Vec<_> =
        std::fs::read_dir(&out).map(|d| d.filter_map(Result::ok).map(|e| e.file_name()).collect()).unwrap_or_default();
    assert!(left.is_empty(), "{name}: a failed run left files in its --out folder: {left:?}");
    lines[0].clone()
}

unsafe extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

pub const SIGINT: i32 = 2;
pub const SIGKILL: i32 = 9;
pub const SIGTERM: i32 = 15;

/// kill(2), straight: `pid` < 0 is a process group. Not the `kill` program:
/// procps-ng 4.0.2's reads a negative pid by its first digit alone —
/// `kill -KILL -424242` calls kill(-4, SIGKILL) (strace) — so a group whose
/// id starts with 1 became kill(-1): every process on the machine, the CI
/// runner with them (seen with ftrace's signal_generate). Whether it was sent.
pub fn signal(pid: i32, sig: i32) -> bool {
    assert!(pid != 0 && pid != -1, "signal({pid}): not a process or group of ours");
    // SAFETY: kill(2) with a pid of one of our children or their group.
    unsafe { libc_kill(pid, sig) == 0 }
}

/// Every rank's measured peak heap over the tally's peak, from a report.
pub fn tally_ratios(r: &serde_json::Value) -> Vec<f64> {
    let expected = r["tally_expected_peak_bytes"].as_f64().unwrap();
    r["measured_peak_bytes"].as_array().unwrap().iter().map(|p| p.as_f64().unwrap() / expected).collect()
}

/// Whether this process runs as root.
pub fn is_root() -> bool {
    unsafe extern "C" {
        fn geteuid() -> u32;
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { geteuid() == 0 }
}

/// Whether this user may make namespaces of its own — network and mount, as
/// scripts/cluster.sh and the fake-CPU tests need: root may; any other user
/// inside a user namespace that maps it to root there (`unshare --user
/// --map-root-user`, which Debian 12's kernel allows a normal user). Why not,
/// where it may not.
pub fn namespaces() -> Result<(), String> {
    if is_root() {
        return Ok(());
    }
    // scripts/cluster.sh's own probe: a private /run and a veth pair, in namespaces of one's own.
    match Command::new("bash").arg(root().join("scripts/cluster.sh")).arg("--probe").output() {
        Ok(o) if o.status.success() => Ok(()),
        _ => Err("not root, and this kernel does not let a normal user make namespaces with a \
                  private mount and a veth pair (`unshare --user --map-root-user --net --mount` failed: \
                  kernel.unprivileged_userns_clone=0 or user.max_user_namespaces=0?)"
            .into()),
    }
}

/// The `unshare` arguments for a mount namespace of one's own (see [`namespaces`]).
pub fn private_mounts() -> Result<Vec<&'static str>, String> {
    namespaces()?;
    Ok(if is_root() {
        vec!["-m", "--propagation", "private"]
    } else {
        vec!["--user", "--map-root-user", "--mount", "--propagation", "private"]
    })
}

/// Whether `test`, which needs namespaces of its own, can run here; if not, it is
/// recorded as skipped ([`skip`]).
pub fn namespaces_or_skip(test: &str) -> bool {
    match namespaces() {
        Ok(()) => true,
        Err(why) => {
            skip(test, &why);
            false
        }
    }
}

/// Records that `test` was skipped and why: one line on stderr, and one file in
/// `scratch()/test-skips/`, which `just test` lists and counts at its end. With
/// `FSDP_TEST_NO_SKIP=1` (CI's run as a normal user) a skip fails the test instead:
/// there, every test must run.
pub fn skip(test: &str, why: &str) {
    assert!(
        std::env::var_os("FSDP_TEST_NO_SKIP").is_none(),
        "{test} would be skipped (FSDP_TEST_NO_SKIP is set): {why}"
    );
    eprintln!("skipped: {test}: {why}");
    let dir = scratch().join("test-skips");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(format!("{test}.txt")), format!("{test}: {why}\n")).unwrap();
}
