//! How a communication stream's thread waits for MPI: its poll policy
//! ([`PollPolicy`]) and the driver that polls a request to completion ([`Progress`]).
//!
//! Open MPI moves a non-blocking collective only inside MPI calls made by
//! some thread of the process (it has no progress thread of its own), so the
//! stream's thread must keep calling `MPI_Test`. A blocking call would spin
//! inside MPI and take half of the core the compute thread runs on; here the
//! thread polls, then sleeps between polls — 10 µs, doubling up to 200 µs
//! while the compute thread computes ([`PollPolicy`]; `FSDP_POLL_US=FIRST,MOST`
//! to measure others), every 10 µs while it is blocked waiting
//! ([`Progress`]). It asks for the real-time policy, so that it runs the
//! moment it wakes instead of after the compute thread's time slice (without
//! root it keeps the default; `FSDP_STREAM_NORMAL` set to any value
//! declines it, to measure). Its CPU time per collective is measured with the thread's own
//! clock and reported.
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::Thread;
use std::time::Duration;

use mpi::request::{Request, Scope};

/// How the stream's thread waits for MPI while a collective is in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PollPolicy {
    /// The first sleep between two polls …
    pub first: Duration,
    /// … doubled after each poll, up to this.
    pub most: Duration,
    /// Whether the thread has a core to itself while the compute thread
    /// waits: then it polls every `first` and runs at real-time priority.
    /// Not when the node runs more ranks than it has cores (oversubscribed):
    /// a poll every 10 µs at real-time priority would take the core from
    /// the other rank's compute — measured here, 4 ranks on 2 cores ran 4×
    /// slower — so it backs off then as well, at the default priority.
    pub eager: bool,
}

impl Default for PollPolicy {
    fn default() -> Self {
        Self { first: Duration::from_micros(10), most: Duration::from_micros(200), eager: !oversubscribed() }
    }
}

impl PollPolicy {
    /// The default, or `FSDP_POLL_US=FIRST,MOST` (microseconds; for
    /// measuring other policies); an error line if that is set wrong (the
    /// lessons check it before their first collective, [`PollPolicy::check_env`]).
    pub fn from_env() -> Result<Self, String> {
        let d = Self::default();
        let Ok(v) = std::env::var("FSDP_POLL_US") else { return Ok(d) };
        let us: Vec<u64> = v.split(',').filter_map(|x| x.trim().parse().ok()).collect();
        match us[..] {
            [first, most] if first > 0 && most >= first && v.split(',').count() == 2 => {
                Ok(Self { first: Duration::from_micros(first), most: Duration::from_micros(most), ..d })
            }
            _ => Err(format!(
                "FSDP_POLL_US={v}: give FIRST,MOST in microseconds, 0 < FIRST ≤ MOST (e.g. 10,200), or unset it"
            )),
        }
    }

    /// The line to print if `FSDP_POLL_US` is set wrong.
    pub fn check_env() -> Result<(), String> {
        Self::from_env().map(|_| ())
    }
}

/// Whether this node runs more ranks (Open MPI's `OMPI_COMM_WORLD_LOCAL_SIZE`)
/// than it gives them cores. The node's cores are those its launcher (my
/// parent, `mpirun` or its daemon) may run on: under `--bind-to core` my
/// own mask is one core even when every rank has its own.
fn oversubscribed() -> bool {
    let local: usize = std::env::var("OMPI_COMM_WORLD_LOCAL_SIZE").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    let mine = std::thread::available_parallelism().map_or(1, |n| n.get());
    local > mine.max(cores_of(unsafe { libc::getppid() }))
}

/// How many cores process `pid` may run on (0 if unknown).
fn cores_of(pid: libc::pid_t) -> usize {
    // SAFETY: a zeroed cpu_set_t is valid; the kernel fills at most its size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    match unsafe { libc::sched_getaffinity(pid, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } {
        0 => unsafe { libc::CPU_COUNT(&set) as usize },
        _ => 0,
    }
}

thread_local! {
    static ON_STREAM: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the calling thread is a communication stream's: a counting
/// allocator asks, to show that the stream allocates nothing while it runs.
pub fn on_stream_thread() -> bool {
    ON_STREAM.try_with(|on| on.get()).unwrap_or(false)
}

/// Marks the calling thread as a stream's (its first act).
pub(crate) fn enter_stream_thread() {
    ON_STREAM.with(|on| on.set(true));
}

/// Drives a stream's non-blocking collectives to completion.
pub struct Progress {
    /// The slot (+ 1) the compute thread is blocked on, 0 while it computes.
    /// While it is blocked the core is idle but for us, and the polls come
    /// close together; the stream's thread clears it when it finishes that
    /// slot, since the compute thread is then waking, and wants the core back.
    pub(crate) waiting_for: AtomicUsize,
    /// The stream's thread, woken from its sleep when a wait begins.
    pub(crate) thread: OnceLock<Thread>,
    pub(crate) policy: PollPolicy,
}

impl Progress {
    /// Polls `request` until it completes.
    pub(crate) fn drive<'a, D: ?Sized, S: Scope<'a>>(&self, mut request: Request<'a, D, S>) {
        let mut sleep = self.policy.first;
        loop {
            match request.test() {
                Ok(_) => return,
                Err(r) => request = r,
            }
            if self.policy.eager && self.waiting_for.load(Ordering::Acquire) > 0 {
                // The compute thread waits for us: poll often — but sleep between polls,
                // never spin, so that a rank sharing the core (oversubscribed) still runs.
                std::thread::park_timeout(self.policy.first);
            } else {
                std::thread::park_timeout(sleep); // the compute thread computes: leave it the core
                sleep = (sleep * 2).min(self.policy.most);
            }
        }
    }
}
