//! The edge of every binary: MPI up, one thread per rank, errors reported
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
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};

use fsdp_comm::World;

/// What a lesson's binary is called and what it teaches.
#[derive(Debug, Clone, Copy)]
pub struct Lesson {
    /// The package and binary name, e.g. `step02-whole-model-shard`.
    pub package: &'static str,
    pub title: &'static str,
    /// How many exercises run inside its step (`--mine K`, K from 1).
    pub exercises: u8,
}

impl Lesson {
    /// `step02-whole-model-shard` → `02-whole-model-shard` (the crate folder and out/ subfolder).
    pub fn short(&self) -> &'static str {
        self.package.trim_start_matches("step")
    }

    /// `step02-whole-model-shard` → 2: the lesson's number.
    pub fn number(&self) -> u8 {
        self.short().split('-').next().and_then(|n| n.parse().ok()).unwrap_or(0)
    }
}

/// Ends the run early without an error (e.g. after `--help`).
#[derive(Debug, thiserror::Error)]
pub enum Stop {
    #[error("done")]
    Success,
    /// Some rank failed in a step every rank took together; the message was already printed.
    #[error("failed")]
    Reported,
}

static IS_ROOT: AtomicBool = AtomicBool::new(true);
static RANK: AtomicUsize = AtomicUsize::new(0);
static SIZE: AtomicUsize = AtomicUsize::new(1);
static SETUP_DONE: AtomicBool = AtomicBool::new(false);

/// True on rank 0 (and before MPI is up): the rank that reports.
pub fn is_root() -> bool {
    IS_ROOT.load(Relaxed)
}

/// From here on, an error may leave other ranks waiting in a collective.
pub(crate) fn mark_setup_done() {
    SETUP_DONE.store(true, Relaxed);
}

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
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    IS_ROOT.store(world.is_root(), Relaxed);
    // The measuring knobs, before any other collective. Each rank reads its own
    // environment (mpirun passes a variable to another machine's ranks only with
    // -x), so the ranks agree: if any has one set wrong, all stop here, and the
    // first such rank alone says why.
    let knobs = fsdp_gpt::kernels::check_matmul_env().and_then(|()| fsdp_comm::stream::Policy::check_env());
    let bad = world.gather_control(&[u8::from(knobs.is_err())]);
    if let Some(first) = bad.iter().position(|&b| b == 1) {
        if let (true, Err(line)) = (world.rank() == first, &knobs) {
            match first {
                0 => eprintln!("error: {line}"),
                r => eprintln!("error (rank {r}): {line} (pass the same FSDP_* variables to every rank: mpirun -x)"),
            }
        }
        return ExitCode::from(2);
    }
    crate::stop::install(world.is_root(), std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some());
    RANK.store(world.rank(), Relaxed);
    SIZE.store(world.size(), Relaxed);
    std::panic::set_hook(Box::new(|info| {
        let msg = panic_text(info.payload());
        if crate::exercise::is_stub(&msg) {
            return; // an exercise's stub: `main` reports it once, on rank 0
        }
        let at = info.location().map(|l| format!(" at {}:{}", l.file(), l.line())).unwrap_or_default();
        eprintln!("error (rank {}): internal error: {msg}{at}", RANK.load(Relaxed));
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
                    eprintln!("error: {line}");
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
            None if SETUP_DONE.load(Relaxed) && world.size() > 1 => {
                eprintln!("error (rank {}): {e:#}", world.rank());
                world.abort(2)
            }
            None => {
                if world.is_root() {
                    eprintln!("error: {e:#}");
                }
                ExitCode::from(2)
            }
        },
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

/// Setup's agreement: every rank learns whether every rank succeeded, and
/// rank 0 prints one line: its own error, or else the first failed rank's
/// ("error (rank 1): …"), sent to it with the agreement. All ranks then
/// return an error together.
pub fn agree<T>(world: &World, result: anyhow::Result<T>) -> anyhow::Result<T> {
    // One fixed-size record per rank: a failure flag, then the message.
    const RECORD: usize = 1024;
    let mut mine = [0u8; RECORD];
    if let Err(e) = &result {
        let msg = format!("{e:#}");
        let mut end = msg.len().min(RECORD - 1);
        while !msg.is_char_boundary(end) {
            end -= 1;
        }
        mine[0] = 1;
        mine[1..1 + end].copy_from_slice(&msg.as_bytes()[..end]);
    }
    let all = world.gather_control(&mine);
    let Some((rank, record)) = all.chunks_exact(RECORD).enumerate().find(|(_, r)| r[0] == 1) else { return result };
    if world.is_root() {
        let text = &record[1..];
        let msg = String::from_utf8_lossy(&text[..text.iter().position(|&b| b == 0).unwrap_or(text.len())]);
        match rank {
            0 => eprintln!("error: {msg}"),
            r => eprintln!("error (rank {r}): {msg}"),
        }
    }
    Err(Stop::Reported.into())
}

/// The edge of a tool that runs without MPI (`fsdp-eval`, `fsdp-export`):
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
            eprintln!("error: {} (see --help)", first.join(" ").trim_start_matches("error: "));
            return ExitCode::from(2);
        }
    };
    match body(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}
