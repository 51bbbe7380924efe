//! The MPI world: this process's [`Comm`] over every rank, and, when a
//! lesson overlaps communication with compute, its [`Stream`].
use std::cell::{OnceCell, Ref};
use std::ops::Deref;
use std::time::Instant;

use mpi::environment::Threading;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

use crate::comm::{Comm, pack_groups};
use crate::heartbeat;
use crate::job::CommError;
use crate::layout::grow_exact;
use crate::mesh::Mesh;
use crate::progress::PollPolicy;
use crate::reduce::MicroBatchSum;
use crate::stream::{CommOf, Pending, Stream, Wire};
use crate::trace::{Lane, Trace};

/// This process's place in the MPI world, and the collectives over it
/// (through `Deref` to its [`Comm`]).
pub struct World {
    comm: Comm,
    /// The communication stream, once a lesson starts it ([`World::start_stream`]).
    stream: OnceCell<Stream>,
    threading: Threading,
    /// HSDP's groups, once a lesson splits the world ([`World::mesh`]).
    mesh: OnceCell<Mesh>,
    // Dropped last: MPI_Finalize runs after the stream's thread has ended
    // and every communicator is freed (fields drop in declaration order).
    _universe: mpi::environment::Universe,
}

impl Drop for World {
    fn drop(&mut self) {
        crate::job::farewell(); // the job's normal end (or an error every rank agreed on)
    }
}

impl Deref for World {
    type Target = Comm;
    fn deref(&self) -> &Comm {
        &self.comm
    }
}

impl World {
    /// Joins the MPI world: under `mpirun -n N` a world of N, run directly a
    /// world of 1. Asks for `MPI_THREAD_MULTIPLE`, which a [`Stream`] needs;
    /// without a stream only this thread calls MPI. Between machines, a
    /// unit's shard goes in one eager message ([`tcp_eager_by_default`]).
    /// Call it first, before the process starts other threads.
    pub fn init() -> Result<Self, CommError> {
        tcp_eager_by_default();
        let (universe, threading) =
            mpi::initialize_with_threading(Threading::Multiple).ok_or(CommError::AlreadyInitialized)?;
        let world = SimpleCommunicator::world();
        // FSDP_SYNC_COLLECTIVES: every rank must agree, or a barrier would meet
        // a collective (a rank on another machine may not see the variable).
        let mine = u8::from(std::env::var_os("FSDP_SYNC_COLLECTIVES").is_some_and(|v| v == "1"));
        let mut all = vec![0u8; world.size() as usize];
        world.all_gather_into(&[mine][..], &mut all[..]); // the first collective, untimed
        let sync = all.contains(&1);
        let comm = Comm::new(world, sync, None);
        // Which machine each rank runs on, by host name, numbered in order of first rank.
        let name = mpi::environment::processor_name().unwrap_or_default();
        let names = comm.gather_varying(name.as_bytes());
        let mut distinct: Vec<&[u8]> = vec![];
        for n in &names {
            if !distinct.contains(&n.as_slice()) {
                distinct.push(n);
            }
        }
        let node = distinct.iter().position(|d| *d == names[comm.rank()].as_slice()).expect("my own name");
        let comm = comm.with_nodes(node);
        if distinct.len() > 1 {
            // Across machines: a heartbeat to rank 0 (rank 0's FSDP_HEARTBEAT_TIMEOUT decides;
            // an invalid one is reported by the lesson's check of its knobs, right after).
            let names: Vec<String> = names.iter().map(|n| String::from_utf8_lossy(n).into_owned()).collect();
            heartbeat::start(&comm, &names)?;
        }
        Ok(Self { comm, stream: OnceCell::new(), threading, mesh: OnceCell::new(), _universe: universe })
    }

    /// HSDP's mesh with shard groups of `shard` consecutive ranks (every
    /// rank together, on the first call; `shard` must divide N).
    pub fn mesh(&self, shard: usize) -> &Mesh {
        let mesh = self.mesh.get_or_init(|| {
            if let Some(stream) = self.stream.get() {
                stream.split(shard); // the stream's own groups, from its duplicate of the world's
            }
            Mesh::split(&self.comm, shard)
        });
        assert_eq!(mesh.shard.size(), shard, "one mesh per run");
        mesh
    }

    /// [`Comm::untracked`] over the world and, once split, the mesh's groups:
    /// a check beside training counts in none of them.
    pub fn untracked<R>(&self, f: impl FnOnce() -> R) -> R {
        let Some(mesh) = self.mesh.get() else { return self.comm.untracked(f) };
        let saved = (mesh.shard.traffic(), mesh.replica.traffic());
        let r = self.comm.untracked(f);
        mesh.shard.set_traffic(saved.0);
        mesh.replica.set_traffic(saved.1);
        r
    }

    /// [`Comm::reset_traffic`] of the world and, once split, the mesh's groups.
    pub fn reset_traffic(&self) {
        self.comm.reset_traffic();
        if let Some(mesh) = self.mesh.get() {
            mesh.shard.reset_traffic();
            mesh.replica.reset_traffic();
        }
    }

    /// The mesh, if split.
    pub fn mesh_if_split(&self) -> Option<&Mesh> {
        self.mesh.get()
    }

    /// Starts the communication stream (every rank together: its thread
    /// duplicates the world's communicator). Idempotent.
    pub fn start_stream(&self) -> Result<&Stream, CommError> {
        if let Some(s) = self.stream.get() {
            return Ok(s);
        }
        if self.threading != Threading::Multiple {
            return Err(CommError::NoThreads(self.threading));
        }
        let policy = PollPolicy::from_env().map_err(CommError::BadKnob)?;
        Ok(self.stream.get_or_init(|| {
            let stream = Stream::start(policy);
            if let Some(mesh) = self.mesh.get() {
                stream.split(mesh.shard.size()); // a mesh split before the stream: its groups too
            }
            stream
        }))
    }

    /// The communication stream, if started.
    pub fn stream(&self) -> Option<&Stream> {
        self.stream.get()
    }

    fn started(&self) -> &Stream {
        self.stream.get().expect("the communication stream is started first (World::start_stream)")
    }

    /// Allocates now the ordered reductions' receive buffer (`len` elements
    /// in `parts` parts) on the communication stream's thread, for the
    /// reductions handed to it (the compute thread's own is
    /// [`Comm::reserve_receive_buffer`]).
    pub fn reserve_stream_receive_buffer(&self, len: usize, parts: usize) {
        self.reserve_stream_receive_buffer_in(CommOf::World, len, parts);
    }

    /// The same, for the stream's communicator `over` (HSDP's shard or replica group).
    pub fn reserve_stream_receive_buffer_in(&self, over: CommOf, len: usize, parts: usize) {
        self.started().reserve_receive_buffer(len, parts, over);
    }

    /// The compute thread's communicator `over`: the world's, or the mesh's.
    pub(crate) fn comm_of(&self, over: CommOf) -> &Comm {
        match (over, self.mesh.get()) {
            (CommOf::World, _) => &self.comm,
            (CommOf::Shard, Some(m)) => &m.shard,
            (CommOf::Replica, Some(m)) => &m.replica,
            (g, None) => panic!("{g:?}: the mesh is split first (World::mesh)"),
        }
    }

    /// **all-gather on the stream**: `mine` (copied in by the caller, as
    /// FSDP2 copies into its all-gather input) into `all`, N shards long.
    pub fn all_gather_async<T: Wire>(&self, mine: Vec<T>, all: Vec<T>) -> Pending<Vec<T>> {
        self.all_gather_async_in(CommOf::World, mine, all)
    }

    /// The same on communicator `over` (HSDP's shard group: `all` holds S shards).
    pub fn all_gather_async_in<T: Wire>(&self, over: CommOf, mine: Vec<T>, all: Vec<T>) -> Pending<Vec<T>> {
        self.started().all_gather(self.comm_of(over), over, mine, all)
    }

    /// **HSDP's reduction on the stream** of my gradient sums (their
    /// buffers travel with it, `grads` is left empty): the reduce-scatter in
    /// my shard group, then the all-reduce of my `shard`-long part across my
    /// replica group, in one op — the bits of the blocking pair. Its buffers
    /// are made here, on the compute thread: `mine` is my shard's buffer,
    /// grown to R equal parts (its capacity stays so: the result is cut back
    /// to its length, so from the second step on nothing is allocated for it).
    pub fn hsdp_reduce_async(&self, grads: &mut MicroBatchSum, mine: Vec<f32>) -> Pending<Vec<f32>> {
        let mesh = self.mesh.get().expect("the mesh is split first (World::mesh)");
        let shard = mine.len();
        let (send, groups) = packed(grads.take_sums(), mesh.shard.size(), shard);
        let r = mesh.replica.size();
        let mine = grow_exact(mine, shard.next_multiple_of(r), 0.0); // R equal parts for the all-reduce, zeros past my shard
        let part = vec![0.0; mine.len() / r];
        self.started().hsdp_reduce((&mesh.shard, &mesh.replica), send, groups, mine, shard, part)
    }

    /// **reduce-scatter on the stream** of my gradient sums: their buffers
    /// travel with it (packed first when there are several), and `grads`
    /// is left empty; the result is `mine`, holding my shard of the sum
    /// over all ranks — the bits of [`Comm::reduce_scatter_sum`].
    pub fn reduce_scatter_sum_async(&self, grads: &mut MicroBatchSum, mine: Vec<f32>) -> Pending<Vec<f32>> {
        let dtype = grads.dtype();
        let (send, groups) = packed(grads.take_sums(), self.size(), mine.len());
        self.started().reduce_scatter(&self.comm, send, groups, mine, dtype)
    }

    /// **all-reduce on the stream** of `groups` sums packed in `buf` (one
    /// sum: the vector itself, N · `shard.len()` long): returns `buf`, whose
    /// first N · `shard.len()` elements are then the sum over all ranks, and `shard`
    /// (unwritten at one rank with one sum: `buf` already is the sum).
    pub fn all_reduce_async(&self, buf: Vec<f32>, groups: usize, shard: Vec<f32>) -> Pending<(Vec<f32>, Vec<f32>)> {
        self.started().all_reduce(&self.comm, buf, groups, shard)
    }

    /// Starts the trace (`--trace`): time zero is the end of a barrier, so
    /// every rank's spans share one time axis (to within the barrier's skew).
    pub fn start_trace(&self) {
        self.comm.barrier_untimed();
        self.comm.trace.borrow_mut().start();
    }

    /// Stops the trace; what it recorded stays.
    pub fn stop_trace(&self) {
        self.comm.trace.borrow_mut().stop();
    }

    /// Whether a trace is recording.
    pub fn tracing(&self) -> bool {
        self.comm.trace.borrow().is_on()
    }

    /// The trace so far.
    pub fn trace(&self) -> Ref<'_, Trace> {
        self.comm.trace.borrow()
    }

    /// The step the next spans belong to.
    pub fn trace_step(&self, step: u64) {
        self.comm.trace.borrow_mut().set_step(step);
    }

    /// Records the compute from `since` to now as one span named by `label`
    /// (only called when tracing); returns now, where the next span starts.
    pub fn traced_since(&self, since: Instant, label: impl FnOnce() -> String) -> Instant {
        let now = Instant::now();
        if self.tracing() {
            self.comm.trace.borrow_mut().span(Lane::Compute, &label(), since, now, 0);
        }
        now
    }

    /// Runs `f` as one span of compute in the trace, named by `label` (only
    /// called when tracing). Waits inside it show nested in it.
    pub fn traced<R>(&self, label: impl FnOnce() -> String, f: impl FnOnce() -> R) -> R {
        if !self.tracing() {
            return f();
        }
        let t0 = Instant::now();
        let r = f();
        let label = label();
        self.comm.trace.borrow_mut().span(Lane::Compute, &label, t0, Instant::now(), 0);
        r
    }
}

impl<T> Pending<T> {
    /// Blocks until the collective has finished; returns its buffers, and
    /// records it in the traffic of the compute thread's communicator of its
    /// group (the world's, or the mesh's shard or replica group). The time
    /// blocked is its *exposed* time; a panic on the stream is raised here.
    /// An op of two collectives (HSDP's reduction) records the second in the
    /// replica group, each with its share of the time (the exposed wait and
    /// the CPU split as their times are).
    pub fn wait(self, w: &World) -> T {
        let rec = w.comm_of(self.over);
        match self.then {
            None => self.wait_both(rec, rec),
            Some(_) => self.wait_both(rec, w.comm_of(CommOf::Replica)),
        }
    }
}

// ANCHOR: tcp_eager
/// The largest message Open MPI's TCP transport (its path between machines)
/// sends eagerly here: at once, whole, whether or not the receiver has
/// asked for it yet. Above its default of 64 KiB it sends by *rendezvous*:
/// a first fragment, then the rest only once the receiver has answered.
/// Every peer pair shares one TCP connection, and that answer queues behind
/// whatever the receiver is itself sending down it — under overlap, when
/// the two ranks hand the same collective over a little apart, the other
/// rank's whole shard of the same unit. Measured on two simulated nodes at
/// 250 Mbit/s (lesson 03 `--prefetch`, 396,544-byte shards): collectives
/// took one or two shards' wire time longer (24 and 35 ms instead of 12.7)
/// at any limit below the message, none above it; the step went from 203–241
/// to 168 ms. 16 MiB holds a unit's shard up to the gpt2 preset at two
/// ranks; shared memory (one machine) has transports of its own and is not
/// affected.
pub const TCP_EAGER_LIMIT: usize = 16 << 20;

/// Sets Open MPI's `btl_tcp_eager_limit` to [`TCP_EAGER_LIMIT`] unless it is
/// set already (`mpirun --mca btl_tcp_eager_limit …` or its `OMPI_MCA_`
/// variable): read by MPI when it starts, so this runs before it does.
fn tcp_eager_by_default() {
    if let Some((var, value)) = tcp_eager_setting(std::env::var_os(TCP_EAGER_VAR).is_some()) {
        // SAFETY: World::init runs before the process starts threads (MPI's and candle's come later).
        unsafe { std::env::set_var(var, value) };
    }
}

const TCP_EAGER_VAR: &str = "OMPI_MCA_btl_tcp_eager_limit";

/// The TCP eager limit this process's MPI runs with, in bytes: after
/// [`World::init`], [`TCP_EAGER_LIMIT`] or the value it was started with.
pub fn tcp_eager_limit() -> Option<u64> {
    std::env::var(TCP_EAGER_VAR).ok().and_then(|v| v.trim().parse().ok())
}

/// What [`tcp_eager_by_default`] sets, given whether the variable is set already.
fn tcp_eager_setting(already: bool) -> Option<(&'static str, String)> {
    (!already).then(|| (TCP_EAGER_VAR, TCP_EAGER_LIMIT.to_string()))
}
// ANCHOR_END: tcp_eager

/// One sum as it is; several packed per destination (see [`Comm`]'s grouped reductions).
fn packed(mut sums: Vec<Vec<f32>>, size: usize, shard: usize) -> (Vec<f32>, usize) {
    match sums.len() {
        1 => (sums.pop().expect("one sum"), 1),
        k => (pack_groups(&sums, size, shard), k), // the sums are freed here, the packed copy travels
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The limit is set only where nobody chose one: an `mpirun --mca
    /// btl_tcp_eager_limit …` (or its variable) is left as it is.
    #[test]
    fn the_tcp_eager_limit_is_ours_unless_set() {
        assert_eq!(tcp_eager_setting(false), Some(("OMPI_MCA_btl_tcp_eager_limit", "16777216".to_string())));
        assert_eq!(tcp_eager_setting(true), None);
        // Above the largest unit shard a lesson sends between two ranks at the gpt2
        // preset (a block of 7,087,872 fp32 parameters, half of it per rank).
        const { assert!(TCP_EAGER_LIMIT >= 7_087_872 / 2 * 4) };
    }
}
