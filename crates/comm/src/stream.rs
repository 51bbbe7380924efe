//! The communication stream: collectives on a thread of their own, the CPU
//! analogue of FSDP2's all-gather and reduce-scatter CUDA streams.
//!
//! The compute thread hands a collective over with its buffers (owned
//! `Vec`s: nothing is borrowed across threads), goes on computing, and waits
//! only where it needs the result ([`Pending::wait`]). The stream's thread
//! runs the collectives one after another, in the order they were handed
//! over, on its own duplicate of the world's communicator, with the same
//! code as the blocking calls ([`Comm`]): the same sums, only earlier or
//! later, so the same bits.
//!
//! How its thread polls MPI meanwhile: [`crate::progress`].
//!
//! Two rules keep the heap a function of the program's order, so that the
//! lessons' tallies still explain the measured peak: the stream's thread
//! never allocates or frees (buffers come with the collective and go back
//! with its result; its receive buffer is reserved up front), and the slots
//! collectives travel in are allocated once, when the stream starts.
use std::any::Any;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

use crate::comm::{Comm, RankSum};
use crate::progress::{PollPolicy, Progress, enter_stream_thread};
use crate::reduce::ReduceDtype;
use crate::trace::Lane;
use crate::traffic::{Collective, Times};

/// Which communicator a collective runs over: on the stream, its
/// duplicate of the world's, or under HSDP its own shard or replica group
/// (split from that duplicate, as the compute thread's [`crate::Mesh`] is from the world).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommOf {
    World = 0,
    Shard = 1,
    Replica = 2,
}

/// A collective and its buffers, as it travels to the stream's thread and back.
#[doc(hidden)]
pub enum Op {
    Empty,
    Reserve(usize, usize),
    /// HSDP's mesh for the stream: shard groups of this many ranks.
    Split(usize),
    /// HSDP's gradient reduction of a unit: the reduce-scatter in the shard
    /// group into `mine[..shard]`, then the all-reduce of `mine` (padded to
    /// R equal parts, zeros past `shard`) across the replica group, `part`
    /// its 1/R; `mid` is when the first ended.
    HsdpReduce {
        send: Vec<f32>,
        groups: usize,
        mine: Vec<f32>,
        shard: usize,
        part: Vec<f32>,
        rank_sum: RankSum,
        mid: Option<Instant>,
    },
    GatherF32 {
        mine: Vec<f32>,
        all: Vec<f32>,
    },
    GatherU16 {
        mine: Vec<u16>,
        all: Vec<u16>,
    },
    ReduceScatter {
        send: Vec<f32>,
        groups: usize,
        mine: Vec<f32>,
        rank_sum: RankSum,
        dtype: ReduceDtype,
    },
    AllReduce {
        buf: Vec<f32>,
        groups: usize,
        shard: Vec<f32>,
        rank_sum: RankSum,
    },
}

impl Op {
    fn run(&mut self, comms: &mut Vec<Comm>, over: CommOf) {
        let g = over as usize;
        match self {
            Op::Empty => {}
            Op::Split(size) => {
                let mesh = crate::mesh::Mesh::split(&comms[0], *size);
                comms.extend([mesh.shard, mesh.replica]);
            }
            Op::HsdpReduce { send, groups, mine, shard, part, rank_sum, mid } => {
                comms[CommOf::Shard as usize].reduce_scatter_packed(send, *groups, &mut mine[..*shard], *rank_sum);
                *mid = Some(Instant::now());
                comms[CommOf::Replica as usize].all_reduce_packed(mine, 1, part, *rank_sum)
            }
            Op::Reserve(len, parts) => comms[g].reserve_receive_buffer(*len, *parts),
            Op::GatherF32 { mine, all } => comms[g].all_gather_untimed(&mine[..], &mut all[..]),
            Op::GatherU16 { mine, all } => comms[g].all_gather_untimed(&mine[..], &mut all[..]),
            Op::ReduceScatter { send, groups, mine, rank_sum, dtype } => match dtype {
                ReduceDtype::F32 => comms[g].reduce_scatter_packed(send, *groups, mine, *rank_sum),
                ReduceDtype::Bf16 => comms[g].reduce_scatter_packed_bf16(send, *groups, mine),
            },
            Op::AllReduce { buf, groups, shard, rank_sum } => {
                comms[g].all_reduce_packed(buf, *groups, shard, *rank_sum)
            }
        }
    }
}

/// The element types an all-gather on the stream moves.
pub trait Wire: Equivalence + Copy + Default + Send + 'static {
    #[doc(hidden)]
    fn gather(mine: Vec<Self>, all: Vec<Self>) -> Op;
    #[doc(hidden)]
    fn gathered(op: Op) -> Vec<Self>;
}

impl Wire for f32 {
    fn gather(mine: Vec<Self>, all: Vec<Self>) -> Op {
        Op::GatherF32 { mine, all }
    }
    fn gathered(op: Op) -> Vec<Self> {
        match op {
            Op::GatherF32 { all, .. } => all,
            _ => unreachable!("an f32 all-gather's slot holds its op"),
        }
    }
}

impl Wire for u16 {
    fn gather(mine: Vec<Self>, all: Vec<Self>) -> Op {
        Op::GatherU16 { mine, all }
    }
    fn gathered(op: Op) -> Vec<Self> {
        match op {
            Op::GatherU16 { all, .. } => all,
            _ => unreachable!("a u16 all-gather's slot holds its op"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Free,
    Queued,
    Done,
}

struct SlotState {
    phase: Phase,
    op: Op,
    over: CommOf,
    /// When the stream's thread ran it, and its CPU seconds.
    ran: (Instant, Instant, f64),
    panic: Option<Box<dyn Any + Send>>,
}

struct Slot {
    state: Mutex<SlotState>,
    done: Condvar,
}

/// Collectives in flight at once, at most: lessons 03 and 04 keep two or
/// three, lesson 01's buckets one per bucket.
pub const SLOTS: usize = 64;

struct Queue {
    order: VecDeque<usize>,
    stop: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    work: Condvar,
    slots: Vec<Slot>,
    progress: Arc<Progress>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The communication thread of one rank, and its communicator.
pub struct Stream {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    /// Whether its thread got the real-time policy ([`first_in_line`]).
    pub realtime: bool,
    /// Whether it polls eagerly while the compute thread waits ([`PollPolicy::eager`]).
    pub eager: bool,
}

impl Stream {
    /// Starts the thread, which duplicates the world's communicator (a
    /// collective over the world: every rank starts its stream together)
    /// while this thread waits for it.
    pub(crate) fn start(policy: PollPolicy) -> Self {
        let progress = Arc::new(Progress { waiting_for: AtomicUsize::new(0), thread: OnceLock::new(), policy });
        let slots = (0..SLOTS)
            .map(|_| Slot {
                state: Mutex::new(SlotState {
                    phase: Phase::Free,
                    op: Op::Empty,
                    over: CommOf::World,
                    ran: (Instant::now(), Instant::now(), 0.0),
                    panic: None,
                }),
                done: Condvar::new(),
            })
            .collect();
        let queue = Queue { order: VecDeque::with_capacity(SLOTS), stop: false };
        let shared = Arc::new(Shared { queue: Mutex::new(queue), work: Condvar::new(), slots, progress });
        let (ready, started) = std::sync::mpsc::channel();
        let on_thread = shared.clone();
        let thread = std::thread::Builder::new()
            .name("fsdp-comm".into())
            .spawn(move || {
                enter_stream_thread();
                precise_sleeps();
                let _ = on_thread.progress.thread.set(std::thread::current());
                // The dup is a blocking collective, which Open MPI spins in: at the default
                // priority, so that it cannot take the core from the compute thread of a rank
                // that shares it; real-time only afterwards.
                let comm = Comm::new(SimpleCommunicator::world().duplicate(), false, Some(on_thread.progress.clone()));
                let realtime = policy.eager && first_in_line();
                let _ = ready.send(realtime);
                serve(&mut vec![comm], &on_thread);
            })
            .expect("the communication thread starts");
        let realtime = started.recv().expect("the communication thread reports its communicator");
        Self { shared, thread: Some(thread), realtime, eager: policy.eager }
    }

    /// Hands `op` over, to run on communicator `over`; it runs after every collective handed over before it.
    fn submit(&self, op: Op, over: CommOf) -> usize {
        let mut op = Some(op);
        let slot = self.shared.slots.iter().position(|s| {
            let mut st = lock(&s.state);
            if st.phase != Phase::Free {
                return false;
            }
            (st.phase, st.op, st.over, st.panic) = (Phase::Queued, op.take().expect("one op"), over, None);
            true
        });
        let slot = slot.unwrap_or_else(|| panic!("more than {SLOTS} collectives in flight on the stream"));
        lock(&self.shared.queue).order.push_back(slot); // within its capacity: no allocation
        self.shared.work.notify_one();
        slot
    }
}

impl Shared {
    /// Blocks until `slot` is done; returns its op, when it ran, and a panic it raised.
    #[allow(clippy::type_complexity)]
    fn finish(&self, slot: usize) -> (Op, (Instant, Instant, f64), Option<Box<dyn Any + Send>>) {
        let s = &self.slots[slot];
        let mut st = lock(&s.state);
        if st.phase != Phase::Done {
            let p = &self.progress;
            p.waiting_for.store(slot + 1, Ordering::Release);
            if let Some(t) = p.thread.get() {
                t.unpark(); // from its sleep between polls: we wait now
            }
            while st.phase != Phase::Done {
                st = s.done.wait(st).unwrap_or_else(|poisoned| poisoned.into_inner());
            }
            let _ = p.waiting_for.compare_exchange(slot + 1, 0, Ordering::AcqRel, Ordering::Acquire);
        }
        st.phase = Phase::Free;
        (std::mem::replace(&mut st.op, Op::Empty), st.ran, st.panic.take())
    }
}

impl Stream {
    /// Allocates the stream's receive buffer for the ordered reductions now
    /// (see [`Comm::reserve_receive_buffer`]), so that its thread never allocates later.
    pub(crate) fn reserve_receive_buffer(&self, len: usize, parts: usize, over: CommOf) {
        self.run_now(Op::Reserve(len, parts), over);
    }

    /// Splits the stream's own HSDP mesh (every rank's stream together).
    pub(crate) fn split(&self, shard: usize) {
        self.run_now(Op::Split(shard), CommOf::World);
    }

    /// Runs `op` and waits for it.
    fn run_now(&self, op: Op, over: CommOf) {
        let slot = self.submit(op, over);
        let (_, _, panic) = self.shared.finish(slot);
        if let Some(p) = panic {
            std::panic::resume_unwind(p);
        }
    }

    /// Hands over an all-gather of `mine` into `all` (N · `mine.len()`)
    /// on communicator `over`, whose compute-thread twin `rec` records it.
    pub(crate) fn all_gather<T: Wire>(&self, rec: &Comm, over: CommOf, mine: Vec<T>, all: Vec<T>) -> Pending<Vec<T>> {
        assert_eq!(all.len(), mine.len() * rec.size(), "all_gather: output must hold N shards");
        let bytes = rec.all_gather_bytes(&mine);
        self.pending(T::gather(mine, all), over, Collective::AllGather, bytes, T::gathered)
    }

    /// Hands `op` over and returns its [`Pending`].
    fn pending<T>(&self, op: Op, over: CommOf, kind: Collective, bytes: usize, take: fn(Op) -> T) -> Pending<T> {
        let issued = Instant::now(); // before the stream's thread may start it
        let slot = self.submit(op, over);
        Pending {
            shared: self.shared.clone(),
            slot,
            over,
            kind,
            bytes,
            then: None,
            label: None,
            take,
            waited: false,
            issued,
        }
    }

    /// Hands over HSDP's reduction of a unit's `groups` packed sums: the
    /// reduce-scatter in the shard group (`shard_rec` records it) into my
    /// `shard` elements of `mine`, then their all-reduce across the replica
    /// group (`replica_rec`). `mine` and `part` come allocated (R · `part.len()`
    /// elements, zeros past `shard`): the stream's thread allocates nothing.
    /// Its [`Pending::wait`] gives `mine`, cut to `shard`.
    pub(crate) fn hsdp_reduce(
        &self,
        (shard_rec, replica_rec): (&Comm, &Comm),
        send: Vec<f32>,
        groups: usize,
        mine: Vec<f32>,
        shard: usize,
        part: Vec<f32>,
    ) -> Pending<Vec<f32>> {
        let first = shard_rec.reduce_scatter_bytes(groups, shard);
        let second = replica_rec.all_reduce_bytes(1, part.len());
        let op = Op::HsdpReduce { send, groups, mine, shard, part, rank_sum: shard_rec.rank_sum(), mid: None };
        let mut p = self.pending(op, CommOf::Shard, Collective::ReduceScatter, first, |op| match op {
            Op::HsdpReduce { mut mine, shard, .. } => {
                mine.truncate(shard); // the padding goes; the buffer stays (as the unit's shard)
                mine
            }
            _ => unreachable!("an HSDP reduction's slot holds its op"),
        });
        p.then = Some((Collective::AllReduce, second));
        p
    }

    /// Hands over an ordered reduce-scatter of `groups` sums packed in `send`
    /// (see `Comm::reduce_scatter_packed`), in `dtype`; returns `mine`, my shard of the sum.
    pub(crate) fn reduce_scatter(
        &self,
        rec: &Comm,
        send: Vec<f32>,
        groups: usize,
        mine: Vec<f32>,
        dtype: ReduceDtype,
    ) -> Pending<Vec<f32>> {
        let bytes = rec.reduce_scatter_bytes_in(dtype, groups, mine.len());
        let op = Op::ReduceScatter { send, groups, mine, rank_sum: rec.rank_sum(), dtype };
        self.pending(op, CommOf::World, Collective::ReduceScatter, bytes, |op| match op {
            // `send` is freed here, in the wait, on the compute thread.
            Op::ReduceScatter { mine, .. } => mine,
            _ => unreachable!("a reduce-scatter's slot holds its op"),
        })
    }

    /// Hands over an ordered all-reduce of `groups` sums packed in `buf`:
    /// returns (`buf`, whose first N · `shard.len()` elements are the sum, `shard`).
    pub(crate) fn all_reduce(
        &self,
        rec: &Comm,
        buf: Vec<f32>,
        groups: usize,
        shard: Vec<f32>,
    ) -> Pending<(Vec<f32>, Vec<f32>)> {
        let bytes = rec.all_reduce_bytes(groups, shard.len());
        let op = Op::AllReduce { buf, groups, shard, rank_sum: rec.rank_sum() };
        self.pending(op, CommOf::World, Collective::AllReduce, bytes, |op| match op {
            Op::AllReduce { buf, shard, .. } => (buf, shard),
            _ => unreachable!("an all-reduce's slot holds its op"),
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        lock(&self.shared.queue).stop = true;
        self.shared.work.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The stream's thread: runs what is handed over, in order, until stopped.
/// `comms` starts as its duplicate of the world's communicator.
fn serve(comms: &mut Vec<Comm>, shared: &Shared) {
    loop {
        let slot = {
            let mut q = lock(&shared.queue);
            loop {
                if let Some(i) = q.order.pop_front() {
                    break i;
                }
                if q.stop {
                    return;
                }
                q = shared.work.wait(q).unwrap_or_else(|poisoned| poisoned.into_inner());
            }
        };
        let s = &shared.slots[slot];
        let (mut op, over) = {
            let mut st = lock(&s.state);
            (std::mem::replace(&mut st.op, Op::Empty), st.over)
        };
        let (t0, cpu0) = (Instant::now(), thread_cpu_seconds());
        // A panic inside (an exercise's stub in the rank sum) goes back to
        // the compute thread, which raises it where it waits.
        let panic = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| op.run(comms, over))).err();
        let ran = (t0, Instant::now(), thread_cpu_seconds() - cpu0);
        let mut st = lock(&s.state);
        (st.op, st.ran, st.panic, st.phase) = (op, ran, panic, Phase::Done);
        // The compute thread, if it waits for this one, wakes now: it is not blocked any more.
        let _ = shared.progress.waiting_for.compare_exchange(slot + 1, 0, Ordering::AcqRel, Ordering::Acquire);
        s.done.notify_all();
    }
}

/// A collective in flight on the stream. [`Pending::wait`] gives its result
/// and records its bytes and times in the world's traffic; dropped without
/// a wait (a step unwinding), it is still waited for, so no buffer is freed
/// while MPI may write it.
#[must_use = "a collective in flight must be waited for"]
pub struct Pending<T> {
    shared: Arc<Shared>,
    slot: usize,
    /// The communicator it runs over (its compute-thread twin records it).
    pub(crate) over: CommOf,
    kind: Collective,
    bytes: usize,
    /// A second collective the same op runs after the first (HSDP's
    /// all-reduce after its reduce-scatter): its kind and bytes.
    pub(crate) then: Option<(Collective, usize)>,
    label: Option<String>,
    take: fn(Op) -> T,
    waited: bool,
    /// When it was handed over.
    issued: Instant,
}

impl<T> Pending<T> {
    /// Names the collective in the trace (`label` runs only when `rec` traces).
    pub fn label(mut self, rec: &Comm, label: impl FnOnce() -> String) -> Self {
        if rec.trace.borrow().is_on() {
            self.label = Some(label());
        }
        self
    }

    pub(crate) fn wait_both(mut self, rec: &Comm, rec2: &Comm) -> T {
        self.waited = true;
        let t0 = Instant::now();
        let (op, (start, end, cpu), panic) = self.shared.finish(self.slot);
        let t1 = Instant::now();
        if let Some(p) = panic {
            std::panic::resume_unwind(p);
        }
        let exposed = (t1 - t0).as_secs_f64();
        let (seconds, first) = (
            (end - start).as_secs_f64(),
            match &op {
                Op::HsdpReduce { mid: Some(mid), .. } => (*mid - start).as_secs_f64(),
                _ => (end - start).as_secs_f64(),
            },
        );
        let share = if seconds > 0.0 { first / seconds } else { 1.0 };
        let times = Times { seconds: first, waited: 0.0, exposed: exposed * share, cpu: cpu * share };
        rec.record(self.kind, self.bytes, self.bytes, times);
        if let Some((kind, bytes)) = self.then {
            let rest = 1.0 - share;
            let times = Times { seconds: seconds - first, waited: 0.0, exposed: exposed * rest, cpu: cpu * rest };
            rec2.record(kind, bytes, bytes, times);
        }
        let mut trace = rec.trace.borrow_mut();
        if trace.is_on() {
            // Its span on the communication lane, and the wait for it on the
            // compute thread's (however short: where the step needed it).
            let (name, op) = (self.label.as_deref().unwrap_or(self.kind.name()), trace.next_op());
            trace.span_of(Lane::Comm, name, start, end, self.bytes as u64, op, self.issued);
            trace.span_of(Lane::Compute, &format!("wait {name}"), t0, t1, 0, op, self.issued);
        }
        drop(trace);
        (self.take)(op)
    }
}

impl<T> Drop for Pending<T> {
    fn drop(&mut self) {
        if !self.waited {
            let _ = self.shared.finish(self.slot); // its buffers are dropped here, on this thread
        }
    }
}

/// This thread's CPU time, in seconds (Linux's per-thread clock).
pub fn thread_cpu_seconds() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Asks the scheduler to run this thread the moment it wakes
/// (`SCHED_FIFO`, the lowest real-time priority): it sleeps nearly always,
/// and each time it wakes MPI has something to do for a few microseconds.
/// Under Linux's default policy a thread woken on a core where the compute
/// thread runs waited up to 9 ms for its turn (measured here), with the
/// wire idle meanwhile. It needs root or CAP_SYS_NICE; without, the thread
/// keeps the default policy (and the config table says so).
fn first_in_line() -> bool {
    if std::env::var_os("FSDP_STREAM_NORMAL").is_some() {
        return false;
    }
    let p = libc::sched_param { sched_priority: 1 };
    // SAFETY: sets this thread's own scheduling policy.
    unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &p) == 0 }
}

/// Sleeps of this thread end within a microsecond of their time, not
/// Linux's default 50 µs later: the sleeps between polls are that short.
fn precise_sleeps() {
    // SAFETY: prctl with PR_SET_TIMERSLACK only sets this thread's slack.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000u64) };
}
