//! How every binary starts and ends: MPI up, one thread per rank, errors reported
//! once, every rank ended.
//!
//! - Errors during setup are agreed on by all ranks ([`crate::Session::new`]
//!   ends with an agreement), so every rank returns and exits cleanly with
//!   code 2 after rank 0 prints one line naming what to fix.
//! - Errors or panics after setup, when other ranks may be waiting inside a
//!   collective, print one line from the rank that failed and end the whole
//!   job with `MPI_Abort`, so no rank is left hanging.
//! - An exercise's stub (`todo!("exercise N.K …")`, see [`crate::exercise`])
//!   is reached by every rank at the same point of the step: each unwinds
//!   (waiting first for a collective in flight on the stream) to [`main`],
//!   rank 0 names the file to edit, every rank exits with code 2.
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use fsdp_comm::World;

use crate::lesson::{Lesson, Stop, say};

static RANK: AtomicUsize = AtomicUsize::new(0);
static SIZE: AtomicUsize = AtomicUsize::new(1);

/// Runs a lesson: sets one compute thread per rank (unless `RAYON_NUM_THREADS`
/// says otherwise), joins MPI, runs `body`, and turns its error into one line
/// and exit code 2.
pub fn main(lesson: Lesson, body: impl FnOnce(&World, &Lesson) -> anyhow::Result<()>) -> ExitCode {
    crate::alloc::keep_freed_memory();
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        // SAFETY: no other thread exists yet (MPI and candle start theirs later).
        unsafe { std::env::set_var("RAYON_NUM_THREADS", "1") };
    }
    let world = match World::init() {
        Ok(w) => w,
        Err(e) => {
            // An error every rank got alike is rank 0's to print.
            let root = std::env::var("OMPI_COMM_WORLD_RANK").map_or(true, |r| r == "0");
            if root || !matches!(e, fsdp_comm::CommError::Heartbeat(_)) {
                say!("error: {e}");
            }
            return ExitCode::from(2);
        }
    };
    crate::lesson::set_root(world.is_root());
    // The measuring knobs, before any other collective. Each rank reads its own
    // environment (mpirun passes a variable to another machine's ranks only with
    // -x), so the ranks agree: if any has one set wrong, all stop here, and the
    // first such rank alone says why.
    let knobs = fsdp_gpt::kernels::check_matmul_env()
        .and_then(|()| fsdp_comm::progress::PollPolicy::check_env())
        .and_then(|()| fsdp_comm::heartbeat::timeout_from_env().map(|_| ()));
    let bad = world.gather_control(&[u8::from(knobs.is_err())]);
    if let Some(first) = bad.iter().position(|&b| b == 1) {
        if let (true, Err(line)) = (world.rank() == first, &knobs) {
            match first {
                0 => say!("error: {line}"),
                r => say!("error (rank {r}): {line} (pass the same FSDP_* variables to every rank: mpirun -x)"),
            }
        }
        return ExitCode::from(2);
    }
    crate::stop::install(world.is_root(), std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some());
    // The --ckpt folder's lock goes with the job, on every way out of `main`.
    struct ReleaseLock;
    impl Drop for ReleaseLock {
        fn drop(&mut self) {
            crate::resume::release_ckpt_lock();
        }
    }
    let _release = ReleaseLock;
    RANK.store(world.rank(), Relaxed);
    SIZE.store(world.size(), Relaxed);
    fsdp_comm::heartbeat::on_loss(lost);
    std::panic::set_hook(Box::new(|info| {
        let msg = panic_text(info.payload());
        if crate::exercise::is_stub(&msg) {
            return; // an exercise's stub: `main` reports it once, on rank 0
        }
        let at = info.location().map(|l| (l.file().to_string(), l.line()));
        say!("{}", panic_line(RANK.load(Relaxed), &msg, at, &crate::exercise::mine_list()));
        crate::resume::release_ckpt_lock();
        if SIZE.load(Relaxed) > 1 {
            fsdp_comm::abort_job(3);
        }
    }));

    // Every rank reaches an exercise's stub at the same point of the step
    // (the step is the same program on every rank), so all unwind to here
    // (a collective in flight on the stream is waited for first, `Pending`'s drop):
    // rank 0 names the file to edit, all exit with code 2.
    let result = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(&world, &lesson))) {
        Ok(r) => r,
        Err(payload) => match crate::exercise::stub_message(&panic_text(&*payload), lesson.short()) {
            Some(line) => {
                if world.is_root() {
                    say!("error: {line}");
                }
                return ExitCode::from(2);
            }
            None => std::panic::resume_unwind(payload),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => match e.downcast_ref::<Stop>() {
            Some(Stop::Success) => ExitCode::SUCCESS,
            Some(Stop::Reported) => ExitCode::from(2),
            None if crate::lesson::setup_done() && world.size() > 1 => {
                say!("error (rank {}): {e:#}", world.rank());
                crate::resume::release_ckpt_lock();
                world.abort(2)
            }
            None => {
                if world.is_root() {
                    say!("error: {e:#}");
                }
                ExitCode::from(2)
            }
        },
    }
}

/// Rank 0's line when the heartbeat loses a node (across machines): what
/// was lost, in which step, and where the last checkpoint is (mpirun then ends the job).
fn lost(what: &str) {
    let saved = match crate::save::last_checkpoint() {
        Some((dir, ckpt)) => {
            format!("the last checkpoint, {}, is whole: resume with --resume {}", dir.display(), ckpt.display())
        }
        None => "this run saved no checkpoint (pass --ckpt DIR --save-every K)".to_string(),
    };
    say!("error: {what}, during step {}: the job ends; {saved}", crate::stop::step());
    crate::resume::release_ckpt_lock();
}

/// The one line a panic prints: a learner's own code (a panic in an
/// `exercises.rs`) is named as theirs, with their file and line; a panic
/// elsewhere while their code runs (`--mine`) says so; anything else is an
/// internal error.
fn panic_line(rank: usize, msg: &str, at: Option<(String, u32)>, mine: &[String]) -> String {
    let theirs = at.as_ref().is_some_and(|(f, _)| f.ends_with("src/exercises.rs"));
    let at = at.map(|(f, l)| format!(" at {f}:{l}")).unwrap_or_default();
    match (theirs, mine.is_empty()) {
        (true, _) => format!("error (rank {rank}): your code panicked: {msg}{at}"),
        (false, false) => format!(
            "error (rank {rank}): a panic while your code runs (exercise {}): {msg}{at}; look at what your code hands on",
            mine.join(", ")
        ),
        (false, true) => format!("error (rank {rank}): internal error: {msg}{at}"),
    }
}

/// A panic's message: `panic!` with a literal carries a `&str`, with
/// arguments a `String` (`todo!("…")` the latter).
fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    match payload.downcast_ref::<&str>() {
        Some(s) => s.to_string(),
        None => payload.downcast_ref::<String>().cloned().unwrap_or_default(),
    }
}

/// How a tool that runs without MPI starts and ends (`fsdp-eval`, `fsdp-export`):
/// one compute thread, `--help` on stdout, any error as one line and exit 2.
pub fn tool_main<P: clap::Parser>(body: impl FnOnce(P) -> anyhow::Result<()>) -> ExitCode {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        // SAFETY: no other thread exists yet.
        unsafe { std::env::set_var("RAYON_NUM_THREADS", "1") };
    }
    let args = match P::try_parse() {
        Ok(a) => a,
        Err(e) if !e.use_stderr() => {
            print!("{}", e.render());
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            // clap's first paragraph, on one line ("… not provided: --ckpt <CKPT>").
            let text = e.render().to_string();
            let first: Vec<&str> = text.lines().take_while(|l| !l.trim().is_empty()).map(str::trim).collect();
            say!("error: {} (see --help)", first.join(" ").trim_start_matches("error: "));
            return ExitCode::from(2);
        }
    };
    match body(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            say!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_learners_panic_is_named_as_theirs() {
        let at = |f: &str| Some((f.to_string(), 42));
        let mine = vec!["2.1".to_string()];
        assert_eq!(
            panic_line(1, "index out of bounds", at("crates/02-whole-model-shard/src/exercises.rs"), &mine),
            "error (rank 1): your code panicked: index out of bounds at crates/02-whole-model-shard/src/exercises.rs:42"
        );
        assert_eq!(
            panic_line(0, "lengths differ", at("crates/gpt/src/adamw.rs"), &mine),
            "error (rank 0): a panic while your code runs (exercise 2.1): lengths differ at crates/gpt/src/adamw.rs:42; look at what your code hands on"
        );
        assert_eq!(
            panic_line(3, "boom", at("crates/gpt/src/adamw.rs"), &[]),
            "error (rank 3): internal error: boom at crates/gpt/src/adamw.rs:42"
        );
    }
}
