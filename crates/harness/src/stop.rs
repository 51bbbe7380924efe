//! A stopped job saves before it dies.
//!
//! Schedulers send SIGTERM before SIGKILL, and people press Ctrl-C. Under
//! `mpirun` (Open MPI 4.1) the ranks never see the Ctrl-C: mpirun sends each
//! rank SIGCONT at once, SIGTERM `odls_base_sigkill_timeout` seconds later
//! (default 1; the justfile sets 3) and SIGKILL as long again after that.
//! SIGCONT alone is no stop (it also resumes a suspended job, and mpirun
//! forwards it), so a rank stops on SIGTERM or SIGINT, and has the second
//! interval to finish its step and save.
//!
//! The handler only records the signal: every rank finishes the step it is
//! in, the ranks agree at the step's end ([`agreed`]), save a checkpoint
//! with `--ckpt`, rank 0 prints one line, and all exit. A rank cannot tell
//! mpirun's stop from mpirun tearing the job down because another rank
//! failed (the same signals), so under mpirun it never exits from the
//! handler: a torn-down job's ranks never reach the agreement, the one line
//! stays the failed rank's, and they end at the SIGKILL. Run without mpirun
//! and without `--ckpt`, there is nothing to save or agree on: the process
//! ends at once with one line, unless it is writing its outputs
//! ([`while_writing`]), which finish first. A stop agreed after the last
//! step changes nothing: the run is done, and finishes.
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering::SeqCst};

use fsdp_comm::World;

static SIGNAL: AtomicI32 = AtomicI32::new(0);
static SAVE_FIRST: AtomicBool = AtomicBool::new(false);
static WRITING: AtomicBool = AtomicBool::new(false);
static ROOT: AtomicBool = AtomicBool::new(true);
static UNDER_MPIRUN: AtomicBool = AtomicBool::new(false);
static STEP: AtomicU64 = AtomicU64::new(0);

/// Installs the handlers for SIGTERM and SIGINT.
pub(crate) fn install(is_root: bool, under_mpirun: bool) {
    ROOT.store(is_root, SeqCst);
    UNDER_MPIRUN.store(under_mpirun, SeqCst);
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: the handler only touches atomics and calls async-signal-safe
        // functions (write, raise, _exit).
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
            sa.sa_flags = libc::SA_RESTART; // MPI calls in flight carry on
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

/// The step being trained.
pub(crate) fn step() -> u64 {
    STEP.load(SeqCst)
}

/// `--ckpt` given: a stop waits for the step's end and saves first.
pub(crate) fn save_first(on: bool) {
    SAVE_FIRST.store(on, SeqCst);
}

/// The step being trained (for the line a stop prints).
pub(crate) fn step_started(step: u64) {
    STEP.store(step, SeqCst);
}

/// Runs `f` (writing report files, a checkpoint) without being cut short by
/// a stop: what is started is finished, nothing is left half-written; a
/// stop that came meanwhile (run without mpirun and `--ckpt`) ends the
/// process right after, as the handler would have.
pub fn while_writing<R>(f: impl FnOnce() -> R) -> R {
    let before = WRITING.swap(true, SeqCst);
    let r = f();
    WRITING.store(before, SeqCst);
    let alone = !before && !UNDER_MPIRUN.load(SeqCst) && !SAVE_FIRST.load(SeqCst);
    if let Some(sig) = requested().filter(|_| alone) {
        if ROOT.load(SeqCst) {
            eprintln!("stopped {} during step {}: {NOTHING_SAVED}", cause(sig), STEP.load(SeqCst));
        }
        exit_now(exit_code(sig));
    }
    r
}

pub(crate) const NOTHING_SAVED: &str = "nothing saved (pass --ckpt DIR to save a checkpoint when stopped)";

/// The signal that asked this rank to stop, if any (this rank only).
fn requested() -> Option<i32> {
    match SIGNAL.load(SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// Whether any rank was asked to stop: every rank calls it at the same
/// point of every step (a one-byte exchange, not counted as training traffic).
pub(crate) fn agreed(world: &World) -> Option<i32> {
    let mine = requested().unwrap_or(0);
    let all = world.untracked(|| world.gather_control(&[mine]));
    all.into_iter().find(|&s| s != 0)
}

/// Who stopped the run, as a person knows it: under mpirun, the SIGTERM
/// stands for the SIGTERM or SIGINT (Ctrl-C) mpirun itself received.
pub(crate) fn cause(sig: i32) -> &'static str {
    match sig {
        _ if UNDER_MPIRUN.load(SeqCst) => "by mpirun (it got SIGTERM or SIGINT)",
        libc::SIGINT => "by SIGINT",
        _ => "by SIGTERM",
    }
}

/// The exit code of a run ended by `sig`: 128 + the signal, as a shell reports it.
pub(crate) fn exit_code(sig: i32) -> i32 {
    128 + sig
}

/// Ends this process now, without MPI's finalisation (which, while mpirun
/// is killing the job, stalls for seconds): every rank has saved and agreed.
pub(crate) fn exit_now(code: i32) -> ! {
    use std::io::Write;
    crate::resume::release_ckpt_lock(); // _exit runs no destructor
    fsdp_comm::job::farewell(); // an agreed end, across machines no loss
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: _exit ends the process; nothing is left to run.
    unsafe { libc::_exit(code) }
}

extern "C" fn on_signal(sig: libc::c_int) {
    let _ = SIGNAL.compare_exchange(0, sig, SeqCst, SeqCst);
    if UNDER_MPIRUN.load(SeqCst) || SAVE_FIRST.load(SeqCst) || WRITING.load(SeqCst) {
        return; // the step's end (or the writer) takes it from here
    }
    if ROOT.load(SeqCst) {
        let mut line = [0u8; 160];
        let mut at = 0;
        let mut put = |bytes: &[u8]| {
            let n = bytes.len().min(line.len() - at);
            line[at..at + n].copy_from_slice(&bytes[..n]);
            at += n;
        };
        put(b"stopped ");
        put(cause(sig).as_bytes());
        put(b" during step ");
        let mut digits = [0u8; 20];
        let (mut v, mut d) = (STEP.load(SeqCst), 20);
        loop {
            d -= 1;
            digits[d] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        put(&digits[d..]);
        put(b": ");
        put(NOTHING_SAVED.as_bytes());
        put(b"\n");
        // SAFETY: write(2) is async-signal-safe; `line` outlives the call.
        unsafe { libc::write(2, line.as_ptr().cast(), at) };
    }
    // SAFETY: _exit is async-signal-safe.
    unsafe { libc::_exit(exit_code(sig)) }
}
