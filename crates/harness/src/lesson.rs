//! What a lesson is (its name, its exercises) and how its ranks agree during
//! setup: every rank learns whether every rank succeeded, and rank 0 alone
//! reports ([`is_root`], [`agree`]); an error line is one write (`say!`).
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

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
static SETUP_DONE: AtomicBool = AtomicBool::new(false);

/// True on rank 0 (and before MPI is up): the rank that reports.
pub fn is_root() -> bool {
    IS_ROOT.load(Relaxed)
}

/// From here on, an error may leave other ranks waiting in a collective.
pub(crate) fn mark_setup_done() {
    SETUP_DONE.store(true, Relaxed);
}

/// Whether setup is over ([`mark_setup_done`]).
pub(crate) fn setup_done() -> bool {
    SETUP_DONE.load(Relaxed)
}

/// Rank 0 reports (`launch` sets it once MPI is up).
pub(crate) fn set_root(root: bool) {
    IS_ROOT.store(root, Relaxed);
}

/// One line on stderr, in one write: `eprintln!` writes a line piece by
/// piece, and the lines of ranks failing together (mpirun forwards every
/// rank's stderr to one terminal) then print into each other.
macro_rules! say {
    ($($t:tt)*) => {{
        let _ = $crate::lesson::one_write(&mut std::io::stderr(), &format!("{}", format_args!($($t)*)));
    }};
}
pub(crate) use say;

/// `line` and its newline in one `write_all` (one `write(2)` on stderr, which
/// Rust does not buffer).
pub(crate) fn one_write(w: &mut impl std::io::Write, line: &str) -> std::io::Result<()> {
    w.write_all(format!("{line}\n").as_bytes())
}

/// Fault injection for the tests: `FSDP_FAILPOINT=panic-after-step:STEP`
/// makes every rank panic at the end of step STEP, all at about the same
/// moment (to show each rank's error line stays whole).
pub fn failpoint_panic(step: u64) {
    let Ok(spec) = std::env::var("FSDP_FAILPOINT") else { return };
    if spec.strip_prefix("panic-after-step:").and_then(|s| s.parse::<u64>().ok()) == Some(step) {
        panic!("failpoint panic-after-step:{step}");
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
            0 => say!("error: {msg}"),
            r => say!("error (rank {r}): {msg}"),
        }
    }
    Err(Stop::Reported.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_line_is_one_write() {
        // What reaches a pipe shared by every rank: one write per line, never
        // a line in pieces that another rank's pieces can fall between.
        struct Writes(Vec<Vec<u8>>);
        impl std::io::Write for Writes {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.push(b.to_vec());
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let mut w = Writes(vec![]);
        one_write(&mut w, &format!("error (rank {}): {}", 3, "internal error: boom")).unwrap();
        assert_eq!(w.0, vec![b"error (rank 3): internal error: boom\n".to_vec()]);
        // eprintln!'s way, write_fmt, writes the same line in pieces (arguments the
        // compiler cannot fold into the text: a rank and a message known at run time).
        let (rank, msg) = (std::hint::black_box(3), std::hint::black_box("boom"));
        let mut pieces = Writes(vec![]);
        std::io::Write::write_fmt(&mut pieces, format_args!("error (rank {rank}): {msg}\n")).unwrap();
        assert!(pieces.0.len() > 1, "{:?}", pieces.0);
    }
}
