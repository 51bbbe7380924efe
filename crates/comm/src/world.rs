//! The MPI world and the collectives, each recorded in [`Traffic`].
use std::cell::{Cell, RefCell};
use std::time::Instant;

use mpi::collective::SystemOperation;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::*;
use thiserror::Error;

use crate::ExactSquares;
use crate::layout::ShardLayout;
use crate::reduce::{MicroBatchSum, sum_pairwise};
use crate::traffic::{Collective, Traffic};

#[derive(Debug, Error)]
pub enum CommError {
    #[error("MPI is already initialised in this process")]
    AlreadyInitialized,
}

/// This process's place in the MPI world, and the collectives over it.
pub struct World {
    // Dropping the universe finalises MPI; it lives as long as the world.
    _universe: mpi::environment::Universe,
    comm: SimpleCommunicator,
    rank: usize,
    size: usize,
    traffic: RefCell<Traffic>,
    /// Reused by the ordered reductions: everyone's copy of my shard, N × shard.
    scratch: RefCell<Vec<f32>>,
    /// How the ordered reductions add the N parts the all-to-all delivered
    /// (see [`World::set_rank_sum`]).
    rank_sum: Cell<fn(&mut [&mut [f32]])>,
    /// `FSDP_SYNC_COLLECTIVES=1`: a barrier before every timed collective, so
    /// that its time is the data's alone and the wait for the slowest rank is
    /// counted apart (`just alpha-beta`). Off by default: it costs a message.
    sync: bool,
}

const F32: usize = std::mem::size_of::<f32>();

impl World {
    /// Joins the MPI world: under `mpirun -n N` a world of N, run directly a world of 1.
    pub fn init() -> Result<Self, CommError> {
        let universe = mpi::initialize().ok_or(CommError::AlreadyInitialized)?;
        let comm = universe.world();
        let (rank, size) = (comm.rank() as usize, comm.size() as usize);
        // FSDP_SYNC_COLLECTIVES: every rank must agree, or a barrier would meet
        // a collective (a rank on another machine may not see the variable).
        let mine = u8::from(std::env::var_os("FSDP_SYNC_COLLECTIVES").is_some_and(|v| v == "1"));
        let mut all = vec![0u8; size];
        comm.all_gather_into(&[mine][..], &mut all[..]);
        let sync = all.contains(&1);
        Ok(Self {
            _universe: universe,
            comm,
            rank,
            size,
            traffic: Default::default(),
            scratch: Default::default(),
            rank_sum: Cell::new(sum_pairwise),
            sync,
        })
    }

    /// Replaces how the ordered reduce-scatter adds what the all-to-all
    /// delivered: `f(parts)` must leave in `parts[0]` the sum of the parts,
    /// which arrive in global order (rank 0's first). The default is
    /// [`sum_pairwise`], the tree every lesson's bits rely on; a lesson may
    /// pass its own (a learner's, in an exercise).
    pub fn set_rank_sum(&self, f: fn(&mut [&mut [f32]])) {
        self.rank_sum.set(f);
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn size(&self) -> usize {
        self.size
    }
    pub fn is_root(&self) -> bool {
        self.rank == 0
    }

    /// What this rank has sent and received so far, per collective kind.
    pub fn traffic(&self) -> Traffic {
        self.traffic.borrow().clone()
    }
    pub fn reset_traffic(&self) {
        *self.traffic.borrow_mut() = Traffic::default();
    }

    /// Runs `f` without counting its collectives in [`Traffic`]: for a check
    /// that runs beside training but is not part of the algorithm.
    pub fn untracked<R>(&self, f: impl FnOnce() -> R) -> R {
        let saved = self.traffic();
        let r = f();
        *self.traffic.borrow_mut() = saved;
        r
    }

    fn timed<R>(&self, kind: Collective, sent: usize, received: usize, f: impl FnOnce() -> R) -> R {
        let waited = match self.sync && self.size > 1 {
            false => 0.0,
            true => {
                let t0 = Instant::now();
                self.comm.barrier();
                t0.elapsed().as_secs_f64()
            }
        };
        let t0 = Instant::now();
        let r = f();
        self.traffic.borrow_mut().record(kind, sent, received, t0.elapsed().as_secs_f64(), waited);
        r
    }

    /// **all-gather**: every rank contributes `mine` (one shard); afterwards
    /// `all` holds every rank's shard in rank order (`all.len() == N · mine.len()`).
    pub fn all_gather<T: Equivalence + Copy>(&self, mine: &[T], all: &mut [T]) {
        assert_eq!(all.len(), mine.len() * self.size, "all_gather: output must hold N shards");
        let bytes = (self.size - 1) * std::mem::size_of_val(mine);
        self.timed(Collective::AllGather, bytes, bytes, || {
            if self.size == 1 {
                all.copy_from_slice(mine);
            } else {
                self.comm.all_gather_into(mine, all);
            }
        });
    }

    // ANCHOR: overlapped_gather
    /// **all-gather, overlapped**: starts the all-gather of `mine` into `all`
    /// with MPI's non-blocking `MPI_Iallgather`, runs `work` while it is in
    /// flight, then waits for it. `work` cannot touch `all` (the borrow checker
    /// sees to it) and must not call collectives itself. The seconds recorded
    /// are the *exposed* ones: the wait after `work`, not the whole flight.
    pub fn all_gather_overlapped<T: Equivalence + Copy, R>(
        &self,
        mine: &[T],
        all: &mut [T],
        work: impl FnOnce() -> R,
    ) -> R {
        assert_eq!(all.len(), mine.len() * self.size, "all_gather: output must hold N shards");
        let bytes = (self.size - 1) * std::mem::size_of_val(mine);
        if self.size == 1 {
            self.timed(Collective::AllGather, 0, 0, || all.copy_from_slice(mine));
            return work();
        }
        let (r, waited) = mpi::request::scope(|scope| {
            let request = self.comm.immediate_all_gather_into(scope, mine, all);
            // A panic in `work` (an exercise's stub, which every rank reaches)
            // must not drop the request in flight: wait for it, then go on unwinding.
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work));
            let t0 = Instant::now();
            request.wait();
            (r, t0.elapsed().as_secs_f64())
        });
        self.traffic.borrow_mut().record(Collective::AllGather, bytes, bytes, waited, 0.0);
        r.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    }
    // ANCHOR_END: overlapped_gather

    /// **reduce-scatter**, ordered: `full` is this rank's contribution to the
    /// whole (padded) vector, N shards long; afterwards `mine` holds the sum
    /// over ranks of this rank's shard, added as the pairwise tree over ranks
    /// 0..N−1 (see [`crate::reduce`]) by the world's rank sum
    /// ([`World::set_rank_sum`]).
    ///
    /// Implemented as an all-to-all (rank j receives everyone's shard j),
    /// then a local pairwise sum: the same bytes on the wire as a ring
    /// reduce-scatter, but a summation order that never depends on N's
    /// factorisation or on MPI's choice of algorithm.
    pub fn reduce_scatter(&self, full: &[f32], mine: &mut [f32]) {
        let n = mine.len();
        assert_eq!(full.len(), n * self.size, "reduce_scatter: input must hold N shards");
        let bytes = (self.size - 1) * n * F32;
        self.timed(Collective::ReduceScatter, bytes, bytes, || self.reduce_scatter_untimed(full, mine));
    }

    /// Allocates now the buffer the ordered reduce-scatter receives into,
    /// `len` elements (it grows to the largest call's and is kept): a lesson
    /// that counts it among what it keeps makes it exist from its first step.
    pub fn reserve_receive_buffer(&self, len: usize) {
        let mut scratch = self.scratch.borrow_mut();
        if scratch.len() < len {
            scratch.resize(len, 0.0);
        }
    }

    // ANCHOR: ordered_reduce_scatter
    fn reduce_scatter_untimed(&self, full: &[f32], mine: &mut [f32]) {
        if self.size == 1 {
            mine.copy_from_slice(full);
            return;
        }
        let mut scratch = self.scratch.borrow_mut();
        scratch.resize(full.len(), 0.0);
        self.comm.all_to_all_into(full, &mut scratch[..]);
        let mut parts: Vec<&mut [f32]> = scratch.chunks_exact_mut(mine.len()).collect();
        (self.rank_sum.get())(&mut parts); // in place, into the first: the pairwise tree
        mine.copy_from_slice(parts[0]);
    }
    // ANCHOR_END: ordered_reduce_scatter

    // ANCHOR: grouped_reduce_scatter
    /// **reduce-scatter of several sums per rank** (`--sum-groups`): this
    /// rank's `groups` are the gradient sums of its consecutive groups of
    /// micro-batches, each a whole padded vector. Afterwards `mine` holds my
    /// shard of the sum of *all* groups of all ranks, added as the pairwise
    /// tree over the groups in global order (rank 0's, then rank 1's, …). With one group per rank it
    /// is [`World::reduce_scatter`], bit for bit and byte for byte; with G
    /// groups in all, the sum no longer depends on how many ranks hold them.
    fn reduce_scatter_groups(&self, groups: &[Vec<f32>], mine: &mut [f32]) {
        if let [only] = groups {
            return self.reduce_scatter(only, mine);
        }
        let (k, n) = (groups.len(), mine.len());
        let bytes = k * (self.size - 1) * n * F32;
        self.timed(Collective::ReduceScatter, bytes, bytes, || self.reduce_scatter_groups_untimed(groups, mine));
    }

    fn reduce_scatter_groups_untimed(&self, groups: &[Vec<f32>], mine: &mut [f32]) {
        let (k, n) = (groups.len(), mine.len());
        assert!(
            groups.iter().all(|g| g.len() == n * self.size),
            "reduce_scatter_groups: each group must hold N shards"
        );
        // Send buffer laid out [destination rank][my group][shard]: rank j
        // receives [source rank][its group][shard j], i.e. global group order.
        let mut send = Vec::with_capacity(k * n * self.size);
        for j in 0..self.size {
            for g in groups {
                send.extend_from_slice(&g[j * n..(j + 1) * n]);
            }
        }
        let mut scratch = self.scratch.borrow_mut();
        scratch.resize(send.len(), 0.0);
        if self.size == 1 {
            scratch.copy_from_slice(&send);
        } else {
            self.comm.all_to_all_into(&send[..], &mut scratch[..]);
        }
        let mut parts: Vec<&mut [f32]> = scratch.chunks_exact_mut(n).collect();
        (self.rank_sum.get())(&mut parts); // in place, into the first: the pairwise tree
        mine.copy_from_slice(parts[0]);
    }
    // ANCHOR_END: grouped_reduce_scatter

    /// **all-reduce of several sums per rank**: `reduce_scatter_groups`
    /// into `shard`, then an all-gather into `groups[0]`, which ends up holding
    /// the sum over all groups of all ranks. With one group it is [`World::all_reduce`].
    fn all_reduce_groups(&self, groups: &mut [Vec<f32>], shard: &mut [f32]) {
        if let [only] = groups {
            return self.all_reduce(only, shard);
        }
        let k = groups.len();
        let bytes = (k + 1) * (self.size - 1) * shard.len() * F32;
        self.timed(Collective::AllReduce, bytes, bytes, || {
            self.reduce_scatter_groups_untimed(groups, shard);
            if self.size == 1 {
                groups[0].copy_from_slice(shard);
            } else {
                self.comm.all_gather_into(&shard[..], &mut groups[0][..]);
            }
        });
    }

    /// **reduce-scatter of a gradient sum**: `grads` is this rank's sum of
    /// its micro-batches' gradients (whole, padded vectors); afterwards
    /// `mine` holds my shard of the sum over all ranks, in the step's one order.
    pub fn reduce_scatter_sum(&self, grads: &mut MicroBatchSum, mine: &mut [f32]) {
        self.reduce_scatter_groups(grads.sums(), mine);
    }

    /// **all-reduce of a gradient sum**: as [`World::reduce_scatter_sum`],
    /// then an all-gather; returns the whole sum over all ranks (padded),
    /// which `grads` holds. `shard` is the reduce-scatter's 1/N of it.
    pub fn all_reduce_sum<'a>(&self, grads: &'a mut MicroBatchSum, shard: &mut [f32]) -> &'a mut [f32] {
        let sums = grads.sums();
        self.all_reduce_groups(sums, shard);
        &mut sums[0]
    }

    /// **all-reduce**, ordered: `buf` becomes the element-wise sum over ranks,
    /// bit for bit equal to `reduce_scatter` followed by `all_gather`, because
    /// that is how it is done. `buf.len()` must be a multiple of N (pad it; see
    /// [`ShardLayout`]).
    pub fn all_reduce(&self, buf: &mut [f32], shard: &mut [f32]) {
        let layout = ShardLayout::new(buf.len(), self.size);
        assert_eq!(layout.padding(), 0, "all_reduce: pad the buffer to a multiple of the world size");
        assert_eq!(shard.len(), layout.shard_len, "all_reduce: shard buffer must be 1/N of the vector");
        let bytes = 2 * (self.size - 1) * layout.shard_len * F32;
        self.timed(Collective::AllReduce, bytes, bytes, || {
            self.reduce_scatter_untimed(buf, shard);
            if self.size == 1 {
                buf.copy_from_slice(shard);
            } else {
                self.comm.all_gather_into(&shard[..], buf);
            }
        });
    }

    /// MPI's own `MPI_Allreduce(SUM)`: typically faster, but its summation
    /// order is MPI's choice and differs between world sizes and from
    /// `MPI_Reduce_scatter` — kept only to measure against the ordered one.
    pub fn all_reduce_native<'a>(&self, buf: &'a mut [f32]) -> &'a mut [f32] {
        let bytes = 2 * (self.size - 1) * buf.len().div_ceil(self.size) * F32;
        self.timed(Collective::AllReduce, bytes, bytes, || {
            if self.size > 1 {
                let send = buf.to_vec();
                self.comm.all_reduce_into(&send[..], &mut *buf, SystemOperation::sum());
            }
        });
        buf
    }

    /// The exact sum of every rank's [`ExactSquares`]: an all-gather of 56
    /// bytes per rank, merged on every rank (in any order: the same bits).
    pub fn exact_sum(&self, mine: &ExactSquares) -> ExactSquares {
        if self.size == 1 {
            return *mine; // nothing to gather, nothing to record
        }
        let words = mine.to_words();
        let mut all = vec![0u64; words.len() * self.size];
        let bytes = (self.size - 1) * std::mem::size_of_val(&words);
        self.timed(Collective::GradNorm, bytes, bytes, || self.comm.all_gather_into(&words[..], &mut all[..]));
        let mut total = ExactSquares::default();
        all.chunks_exact(ExactSquares::WORDS).for_each(|w| total.merge(&ExactSquares::from_words(w)));
        total
    }

    /// Sum of a few `f64` control values (losses, counters) in rank order.
    pub fn sum_f64(&self, values: &[f64]) -> Vec<f64> {
        let all = self.gather_control(values);
        let mut out = vec![0.0; values.len()];
        for chunk in all.chunks_exact(values.len()) {
            out.iter_mut().zip(chunk).for_each(|(o, x)| *o += x);
        }
        out
    }

    /// Every rank's `values`, concatenated in rank order (small control data).
    pub fn gather_control<T: Equivalence + Copy + Default>(&self, values: &[T]) -> Vec<T> {
        let mut all = vec![T::default(); values.len() * self.size];
        let bytes = (self.size - 1) * std::mem::size_of_val(values);
        self.timed(Collective::Control, bytes, bytes, || {
            if self.size == 1 {
                all.copy_from_slice(values);
            } else {
                self.comm.all_gather_into(values, &mut all[..]);
            }
        });
        all
    }

    /// Ends every rank of the job at once with `code` (`MPI_Abort`): for a
    /// failure on one rank while the others may be waiting in a collective.
    pub fn abort(&self, code: i32) -> ! {
        self.comm.abort(code)
    }
}

/// Ends every rank of the job (`MPI_Abort` on the world) from a place that
/// has no [`World`] at hand, such as a panic hook. MPI must be initialised.
pub fn abort_job(code: i32) -> ! {
    // SAFETY: called only after `World::init`; MPI_Abort does not return.
    unsafe { mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, code) };
    std::process::exit(code)
}
