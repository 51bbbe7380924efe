//! How the job ends: the error that ends a rank's setup ([`CommError`]), the
//! abort that ends every rank ([`abort_job`]), and the farewell that tells the
//! heartbeat ([`crate::heartbeat`]) a rank's end is no loss ([`farewell`]).
use std::io::Write;
use std::net::TcpStream;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use mpi::environment::Threading;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum CommError {
    #[error("MPI is already initialised in this process")]
    AlreadyInitialized,
    #[error(
        "this MPI grants thread level {0:?}, and overlapping communication needs MPI_THREAD_MULTIPLE (a thread of its own calls MPI): run without the overlap flags, or use an MPI built with thread support (Open MPI's default)"
    )]
    NoThreads(Threading),
    #[error("{0}")]
    BadKnob(String),
    /// The heartbeat could not start, the same line on every rank: only rank 0 prints it.
    #[error("{0}")]
    Heartbeat(String),
    /// The heartbeat could not start on this rank alone: it prints it.
    #[error("{0}")]
    HeartbeatHere(String),
}

/// Ends every rank of the job (`MPI_Abort` on the world) from a place that
/// has no [`crate::World`] at hand, such as a panic hook. MPI must be initialised.
pub fn abort_job(code: i32) -> ! {
    farewell(); // this rank's end is reported: no loss for the heartbeat
    // SAFETY: called only after `World::init`; MPI_Abort does not return.
    unsafe { mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, code) };
    std::process::exit(code)
}

/// "I end, and that is no loss": the job's end, or my own error, already reported.
pub(crate) const BYE: u8 = b'B';

/// The connections of this rank: rank 0's to every other rank, another rank's to rank 0.
/// `beat` holds the lock only while it reads and writes its beats, never while it reports.
pub(crate) static PEERS: Mutex<Vec<(usize, TcpStream)>> = Mutex::new(Vec::new());
pub(crate) static ENDING: AtomicBool = AtomicBool::new(false);

/// This rank ends and has said why, or the job ends normally: tells rank 0
/// (or, on rank 0, every rank) that what follows is no loss. Idempotent.
pub fn farewell() {
    if ENDING.swap(true, Ordering::SeqCst) {
        return;
    }
    tell(BYE);
}

/// Writes `byte` to every peer (the heartbeat thread holds the lock only
/// while it reads, never while it reports).
pub(crate) fn tell(byte: u8) {
    for (_, s) in PEERS.lock().unwrap_or_else(|p| p.into_inner()).iter() {
        let _ = (&*s).write_all(&[byte]);
    }
}
