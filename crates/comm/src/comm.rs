//! One communicator and the collectives over it, each recorded in [`Traffic`].
//!
//! The same code runs on two threads: the compute thread's [`Comm`] (the
//! world's, inside [`crate::World`]) makes MPI's blocking calls, as every
//! lesson always has; a [`crate::Stream`]'s thread owns a duplicate of the
//! world's communicator and makes MPI's non-blocking calls, then drives
//! them to completion without spinning ([`crate::stream`]). The arithmetic —
//! the copies, the pairwise sums — is one function either way, so a
//! collective gives the same bits on either thread.
use std::cell::{Cell, RefCell};
use std::sync::Arc;
use std::time::Instant;

use mpi::collective::SystemOperation;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::*;

use crate::ExactSquares;
use crate::layout::ShardLayout;
use crate::progress::Progress;
use crate::reduce::{MicroBatchSum, ReduceDtype, bf16_bits, bf16_value, sum_pairwise, sum_pairwise_bf16};
use crate::trace::{Lane, Trace};
use crate::traffic::{Collective, Times, Traffic};

/// How the ordered reductions add the N parts an all-to-all delivered
/// (see [`Comm::set_rank_sum`]).
pub type RankSum = fn(&mut [&mut [f32]]);

/// A communicator, its rank and size, and the collectives over it.
pub struct Comm {
    comm: SimpleCommunicator,
    rank: usize,
    size: usize,
    traffic: RefCell<Traffic>,
    /// Reused by the ordered reductions: everyone's copy of my shard, N × shard.
    scratch: RefCell<Vec<f32>>,
    /// The pointers to the parts of `scratch` the rank sum adds, kept for
    /// reuse (empty between calls), so a reduction allocates nothing.
    parts: RefCell<Vec<&'static mut [f32]>>,
    rank_sum: Cell<RankSum>,
    /// `FSDP_SYNC_COLLECTIVES=1`: a barrier before every timed collective, so
    /// that its time is the data's alone and the wait for the slowest rank is
    /// counted apart (`just alpha-beta`). Off by default: it costs a message.
    sync: bool,
    /// On a stream's thread: non-blocking calls, driven to completion by
    /// polling MPI without taking the core ([`Progress`]). `None`: blocking calls.
    progress: Option<Arc<Progress>>,
    /// The compute thread's timeline (`--trace`); never recording on a stream.
    pub(crate) trace: RefCell<Trace>,
    /// The node (machine) each of this communicator's ranks runs on, as an
    /// index into the world's distinct host names in order of first rank:
    /// what splits the bytes sent into those that stay on my node and
    /// those that cross to another ([`TrafficStats::bytes_remote`]).
    nodes: Vec<usize>,
}

const F32: usize = std::mem::size_of::<f32>();

impl Comm {
    pub(crate) fn new(comm: SimpleCommunicator, sync: bool, progress: Option<Arc<Progress>>) -> Self {
        let (rank, size) = (comm.rank() as usize, comm.size() as usize);
        Self {
            comm,
            rank,
            size,
            traffic: Default::default(),
            scratch: Default::default(),
            parts: Default::default(),
            rank_sum: Cell::new(sum_pairwise),
            sync,
            progress,
            trace: Default::default(),
            nodes: vec![0; size],
        }
    }

    /// This communicator with its ranks' nodes learned (every rank calls): each
    /// rank's `node` (an index into the world's host names) gathered, untimed.
    pub(crate) fn with_nodes(mut self, node: usize) -> Self {
        let mut all = vec![0u64; self.size];
        self.all_gather_untimed(&[node as u64][..], &mut all[..]);
        self.nodes = all.into_iter().map(|n| n as usize).collect();
        self
    }

    /// The node this rank runs on (0 on one machine).
    pub fn node(&self) -> usize {
        self.nodes[self.rank]
    }

    /// The node each rank of this communicator runs on.
    pub fn nodes(&self) -> &[usize] {
        &self.nodes
    }

    /// Of `bytes` sent equally to every other rank, those addressed to ranks
    /// on other nodes: what crosses between machines if each peer gets its
    /// share directly — as the all-to-all of the ordered reductions does, and
    /// as Open MPI's recursive-doubling all-gather does in bytes. A model: a
    /// ring all-gather would carry fewer across. The tests hold it to the
    /// link's counter on 2 nodes × 2 ranks, fully sharded and under HSDP.
    fn remote_share(&self, bytes: usize) -> usize {
        let remote = self.nodes.iter().filter(|&&n| n != self.node()).count();
        if self.size > 1 { bytes * remote / (self.size - 1) } else { 0 }
    }

    /// A new communicator over some of this one's ranks (every rank calls,
    /// `MPI_Comm_split`): the ranks of one `color` form it, ranked by `key`.
    /// It keeps this one's rank sum and `FSDP_SYNC_COLLECTIVES`, and counts
    /// its own [`Traffic`]: the bytes that travel inside the group.
    pub fn split(&self, color: usize, key: usize) -> Comm {
        let color = mpi::topology::Color::with_value(color as i32);
        let comm = self.comm.split_by_color_with_key(color, key as i32).expect("a rank with a colour is in its group");
        let group = Comm::new(comm, self.sync, self.progress.clone()).with_nodes(self.node()); // a stream's: non-blocking too
        group.rank_sum.set(self.rank_sum.get());
        group
    }

    /// Replaces how the ordered reduce-scatter adds what the all-to-all
    /// delivered: `f(parts)` must leave in `parts[0]` the sum of the parts,
    /// which arrive in global order (rank 0's first). The default is
    /// [`sum_pairwise`], the tree every lesson's bits rely on; a lesson may
    /// pass its own (a learner's, in an exercise). Collectives handed to a
    /// [`crate::Stream`] take the one set when they are handed over.
    pub fn set_rank_sum(&self, f: RankSum) {
        self.rank_sum.set(f);
    }

    pub(crate) fn rank_sum(&self) -> RankSum {
        self.rank_sum.get()
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
    pub(crate) fn set_traffic(&self, t: Traffic) {
        *self.traffic.borrow_mut() = t;
    }
    pub(crate) fn record(&self, kind: Collective, sent: usize, received: usize, times: Times) {
        self.traffic.borrow_mut().record(kind, sent, self.remote_share(sent), received, times);
    }

    /// Runs `f` without counting its collectives in [`Traffic`] (nor tracing
    /// them): for a check that runs beside training but is not part of the algorithm.
    pub fn untracked<R>(&self, f: impl FnOnce() -> R) -> R {
        let saved = self.traffic();
        let tracing = self.trace.borrow().is_on();
        self.trace.borrow_mut().stop();
        let r = f();
        *self.traffic.borrow_mut() = saved;
        if tracing {
            self.trace.borrow_mut().resume();
        }
        r
    }

    fn timed<R>(&self, kind: Collective, sent: usize, received: usize, f: impl FnOnce() -> R) -> R {
        let waited = match self.sync && self.size > 1 {
            false => 0.0,
            true => {
                let t0 = Instant::now();
                self.barrier();
                t0.elapsed().as_secs_f64()
            }
        };
        let t0 = Instant::now();
        let r = f();
        let t1 = Instant::now();
        self.record(kind, sent, received, Times::blocking((t1 - t0).as_secs_f64(), waited));
        let mut trace = self.trace.borrow_mut();
        if trace.is_on() {
            // A blocking call: the bytes move while the compute thread waits.
            let op = trace.next_op();
            trace.span_of(Lane::Comm, kind.name(), t0, t1, sent as u64, op, t0);
            trace.span_of(Lane::Compute, &format!("wait {}", kind.name()), t0, t1, 0, op, t0);
        }
        r
    }

    /// A barrier, not recorded in the traffic.
    pub fn barrier_untimed(&self) {
        if self.size > 1 {
            self.barrier();
        }
    }

    // The MPI calls everything below is made of: blocking on the compute
    // thread; the data movers non-blocking, driven by `Progress`, on a stream.
    fn barrier(&self) {
        self.comm.barrier(); // only ever on the compute thread: the stream runs no barriers
    }

    fn raw_all_gather<T: Equivalence>(&self, mine: &[T], all: &mut [T]) {
        match &self.progress {
            None => self.comm.all_gather_into(mine, all),
            Some(p) => mpi::request::scope(|sc| p.drive(self.comm.immediate_all_gather_into(sc, mine, all))),
        }
    }

    fn raw_all_to_all<T: Equivalence>(&self, send: &[T], recv: &mut [T]) {
        match &self.progress {
            None => self.comm.all_to_all_into(send, recv),
            Some(p) => mpi::request::scope(|sc| p.drive(self.comm.immediate_all_to_all_into(sc, send, recv))),
        }
    }

    /// **all-gather**: every rank contributes `mine` (one shard); afterwards
    /// `all` holds every rank's shard in rank order (`all.len() == N · mine.len()`).
    pub fn all_gather<T: Equivalence + Copy>(&self, mine: &[T], all: &mut [T]) {
        let bytes = self.all_gather_bytes(mine);
        self.timed(Collective::AllGather, bytes, bytes, || self.all_gather_untimed(mine, all));
    }

    pub(crate) fn all_gather_bytes<T>(&self, mine: &[T]) -> usize {
        (self.size - 1) * std::mem::size_of_val(mine)
    }

    /// Bytes each rank sends in a reduce-scatter of `groups` f32 sums packed
    /// per rank, each rank keeping `shard` elements: its all-to-all.
    pub(crate) fn reduce_scatter_bytes(&self, groups: usize, shard: usize) -> usize {
        self.reduce_scatter_bytes_in(ReduceDtype::F32, groups, shard)
    }

    /// The same in `dtype`: 2 bytes per element under bf16.
    pub(crate) fn reduce_scatter_bytes_in(&self, dtype: ReduceDtype, groups: usize, shard: usize) -> usize {
        groups * (self.size - 1) * shard * dtype.bytes()
    }

    /// Bytes each rank sends in an ordered all-reduce of `groups` sums: their
    /// reduce-scatter, then one all-gather of the `shard`.
    pub(crate) fn all_reduce_bytes(&self, groups: usize, shard: usize) -> usize {
        (groups + 1) * (self.size - 1) * shard * F32
    }

    pub(crate) fn all_gather_untimed<T: Equivalence + Copy>(&self, mine: &[T], all: &mut [T]) {
        assert_eq!(all.len(), mine.len() * self.size, "all_gather: output must hold N shards");
        if self.size == 1 {
            all.copy_from_slice(mine);
        } else {
            self.raw_all_gather(mine, all);
        }
    }

    /// **reduce-scatter**, ordered: `full` is this rank's contribution to the
    /// whole (padded) vector, N shards long; afterwards `mine` holds the sum
    /// over ranks of this rank's shard, added as the pairwise tree over ranks
    /// 0..N−1 (see [`crate::reduce`]) by the rank sum ([`Comm::set_rank_sum`]).
    ///
    /// Implemented as an all-to-all (rank j receives everyone's shard j),
    /// then a local pairwise sum: the same bytes on the wire as a ring
    /// reduce-scatter, but a summation order that never depends on N's
    /// factorisation or on MPI's choice of algorithm.
    pub fn reduce_scatter(&self, full: &[f32], mine: &mut [f32]) {
        let bytes = self.reduce_scatter_bytes(1, mine.len());
        self.timed(Collective::ReduceScatter, bytes, bytes, || {
            self.reduce_scatter_packed(full, 1, mine, self.rank_sum())
        });
    }

    /// Allocates now the buffer the ordered reduce-scatter receives into,
    /// `len` elements in `parts` parts (N, or N · G with several sums per
    /// rank; it grows to the largest call's and is kept): a lesson that
    /// counts it among what it keeps makes it exist from its first step.
    pub fn reserve_receive_buffer(&self, len: usize, parts: usize) {
        let mut scratch = self.scratch.borrow_mut();
        if scratch.len() < len {
            scratch.resize(len, 0.0);
        }
        self.parts.borrow_mut().reserve(parts);
    }

    // ANCHOR: ordered_reduce_scatter
    /// The ordered reduce-scatter of `groups` sums per rank, packed for the
    /// all-to-all: `send` is laid out [destination rank][my group][shard],
    /// so rank j receives [source rank][its group][shard j] — every group
    /// of every rank in global order. Afterwards `mine` holds my shard of
    /// the sum of all of them, added by `rank_sum` as the pairwise tree over
    /// the groups. With one group the packing is the vector itself.
    pub(crate) fn reduce_scatter_packed(&self, send: &[f32], groups: usize, mine: &mut [f32], rank_sum: RankSum) {
        let n = mine.len();
        assert_eq!(send.len(), groups * n * self.size, "reduce_scatter: input must hold N shards per group");
        if self.size == 1 && groups == 1 {
            mine.copy_from_slice(send);
            return;
        }
        let mut scratch = self.scratch.borrow_mut();
        if scratch.len() < send.len() {
            scratch.resize(send.len(), 0.0); // only when not reserved: kept for the next call
        }
        let received = &mut scratch[..send.len()];
        if self.size == 1 {
            received.copy_from_slice(send);
        } else {
            self.raw_all_to_all(send, received);
        }
        let mut kept = self.parts.borrow_mut();
        let mut parts = reuse(&mut kept);
        parts.extend(received.chunks_exact_mut(n));
        rank_sum(&mut parts); // in place, into the first: the pairwise tree
        mine.copy_from_slice(parts[0]);
        *kept = reuse(&mut parts);
    }
    // ANCHOR_END: ordered_reduce_scatter

    // ANCHOR: grouped_reduce_scatter
    /// **reduce-scatter of several sums per rank** (`--sum-groups`): this
    /// rank's `groups` are the gradient sums of its consecutive groups of
    /// micro-batches, each a whole padded vector. Afterwards `mine` holds my
    /// shard of the sum of *all* groups of all ranks, added as the pairwise
    /// tree over the groups in global order (rank 0's, then rank 1's, …). With one group per rank it
    /// is [`Comm::reduce_scatter`], bit for bit and byte for byte; with G
    /// groups in all, the sum no longer depends on how many ranks hold them.
    fn reduce_scatter_groups(&self, groups: &[Vec<f32>], mine: &mut [f32]) {
        if let [only] = groups {
            return self.reduce_scatter(only, mine);
        }
        let (k, n) = (groups.len(), mine.len());
        let bytes = self.reduce_scatter_bytes(k, n);
        self.timed(Collective::ReduceScatter, bytes, bytes, || {
            let send = pack_groups(groups, self.size, n);
            self.reduce_scatter_packed(&send, k, mine, self.rank_sum())
        });
    }
    // ANCHOR_END: grouped_reduce_scatter

    /// **all-reduce of several sums per rank**: `reduce_scatter_groups`
    /// into `shard`, then an all-gather into `groups[0]`, which ends up holding
    /// the sum over all groups of all ranks. With one group it is [`Comm::all_reduce`].
    fn all_reduce_groups(&self, groups: &mut [Vec<f32>], shard: &mut [f32]) {
        if let [only] = groups {
            return self.all_reduce(only, shard);
        }
        let k = groups.len();
        let bytes = self.all_reduce_bytes(k, shard.len());
        self.timed(Collective::AllReduce, bytes, bytes, || {
            let send = pack_groups(groups, self.size, shard.len());
            self.reduce_scatter_packed(&send, k, shard, self.rank_sum());
            drop(send);
            self.all_gather_untimed(&shard[..], &mut groups[0][..]);
        });
    }

    /// The all-reduce of `groups` packed sums (see [`Comm::reduce_scatter_packed`])
    /// into `buf[..N · shard]`, `shard` holding my part of it: what a stream runs.
    /// At one rank with one sum nothing moves and `shard` is left unwritten.
    pub(crate) fn all_reduce_packed(&self, buf: &mut [f32], groups: usize, shard: &mut [f32], rank_sum: RankSum) {
        if self.size == 1 && groups == 1 {
            // One rank, one sum: `buf` already is the sum over ranks. The round trip through
            // `shard` (a copy there and back) would leave every bit as it is; at the tiny preset
            // it was 1.6% of lesson 01's step at one rank (perf, an Intel Xeon's AVX2 path).
            assert_eq!(buf.len(), shard.len(), "all_reduce: input must hold N shards per group");
            return;
        }
        let len = shard.len() * self.size;
        self.reduce_scatter_packed(buf, groups, shard, rank_sum);
        self.all_gather_untimed(&shard[..], &mut buf[..len]);
    }

    /// **reduce-scatter of a gradient sum**: `grads` is this rank's sum of
    /// its micro-batches' gradients (whole, padded vectors); afterwards
    /// `mine` holds my shard of the sum over all ranks, in the step's one
    /// order — in the sum's dtype ([`MicroBatchSum::in_dtype`]): under bf16,
    /// 2-byte elements on the wire, each sum across ranks rounded too (the
    /// sums' buffers are the send buffer then, and hold no values after).
    pub fn reduce_scatter_sum(&self, grads: &mut MicroBatchSum, mine: &mut [f32]) {
        match grads.dtype() {
            ReduceDtype::F32 => self.reduce_scatter_groups(grads.sums(), mine),
            ReduceDtype::Bf16 => self.reduce_scatter_groups_bf16(grads.sums(), mine),
        }
    }

    // ANCHOR: deferred_reduce_scatter
    /// **reduce-scatter, its sum deferred**: the all-to-all of the ordered
    /// reduce-scatter alone, for one micro-batch's gradient `leaf` (whole,
    /// padded, in `dtype`'s values: 2 bytes per element on the wire under
    /// bf16, and `leaf` holds no values after). `received` (the same length)
    /// gets every rank's shard of mine of its leaf, in rank order:
    /// [source rank][shard]. Counted as the reduce-scatter it is; its sum
    /// is [`Comm::finish_deferred`]'s, once every micro-batch has arrived.
    pub fn reduce_scatter_deferred(&self, leaf: &mut [f32], dtype: ReduceDtype, received: &mut [f32]) {
        assert_eq!(leaf.len(), received.len(), "reduce_scatter_deferred: a whole vector each way");
        let n = leaf.len() / self.size;
        let bytes = self.reduce_scatter_bytes_in(dtype, 1, n);
        self.timed(Collective::ReduceScatter, bytes, bytes, || {
            if self.size == 1 {
                return received.copy_from_slice(leaf);
            }
            match dtype {
                ReduceDtype::F32 => self.raw_all_to_all(&*leaf, received),
                ReduceDtype::Bf16 => {
                    let len = leaf.len();
                    self.raw_all_to_all(compact_bf16(leaf), &mut as_bits(received)[..len]);
                    widen_bf16(received);
                }
            }
        });
    }

    /// The sum of a reduce-scatter whose all-to-alls went ahead micro-batch
    /// by micro-batch ([`Comm::reduce_scatter_deferred`]): `grads` summed
    /// the received vectors in my micro-batches' tree, so its group sums
    /// hold, side by side, each rank's group sums' shard of mine. `mine`
    /// gets their sum, in global order (rank 0's groups first) by the rank
    /// sum (under bf16, each sum rounded): the additions, and so the bits,
    /// of [`Comm::reduce_scatter_sum`]. Nothing moves.
    pub fn finish_deferred(&self, grads: &mut MicroBatchSum, mine: &mut [f32]) {
        let (n, dtype) = (mine.len(), grads.dtype());
        let mut shards: Vec<_> = grads.sums().iter_mut().map(|g| g.chunks_exact_mut(n)).collect();
        let mut parts: Vec<&mut [f32]> = Vec::with_capacity(self.size * shards.len());
        for _ in 0..self.size {
            parts.extend(shards.iter_mut().map(|g| g.next().expect("a shard from every rank")));
        }
        match dtype {
            ReduceDtype::F32 => (self.rank_sum())(&mut parts),
            ReduceDtype::Bf16 => crate::reduce::sum_pairwise_in(dtype, &mut parts),
        }
        mine.copy_from_slice(parts[0]);
    }
    // ANCHOR_END: deferred_reduce_scatter

    /// [`Comm::reduce_scatter_groups`] in bf16 ([`Comm::reduce_scatter_packed_bf16`]).
    fn reduce_scatter_groups_bf16(&self, groups: &mut [Vec<f32>], mine: &mut [f32]) {
        let (k, n) = (groups.len(), mine.len());
        let bytes = self.reduce_scatter_bytes_in(ReduceDtype::Bf16, k, n);
        self.timed(Collective::ReduceScatter, bytes, bytes, || match groups {
            [only] => self.reduce_scatter_packed_bf16(only, 1, mine),
            _ => self.reduce_scatter_packed_bf16(&mut pack_groups(groups, self.size, n), k, mine),
        });
    }

    // ANCHOR: bf16_reduce_scatter
    /// The ordered reduce-scatter in bf16: `send`, packed as for
    /// [`Comm::reduce_scatter_packed`] and holding bf16 values, is compacted
    /// in place into their bits (its f32 values are gone afterwards), those
    /// cross the all-to-all — 2 bytes per element, half of fp32's — and the
    /// parts are added as the same pairwise tree, each sum rounded to bf16,
    /// in place on the receive buffer; `mine` gets my shard of the result.
    pub(crate) fn reduce_scatter_packed_bf16(&self, send: &mut [f32], groups: usize, mine: &mut [f32]) {
        let n = mine.len();
        assert_eq!(send.len(), groups * n * self.size, "reduce_scatter: input must hold N shards per group");
        let bits = compact_bf16(send);
        let mut scratch = self.scratch.borrow_mut(); // f32 words, read as bf16 bits: half as many
        let words = bits.len().div_ceil(2);
        if scratch.len() < words {
            scratch.resize(words, 0.0); // only when not reserved: kept for the next call
        }
        let received = &mut as_bits(&mut scratch[..words])[..bits.len()];
        if self.size == 1 {
            received.copy_from_slice(bits);
        } else {
            self.raw_all_to_all(bits, received);
        }
        let mut kept = self.parts.borrow_mut();
        let mut parts: Vec<&mut [u16]> = reuse(&mut kept);
        parts.extend(received.chunks_exact_mut(n));
        sum_pairwise_bf16(&mut parts); // in place, into the first: the pairwise tree, each sum rounded
        mine.iter_mut().zip(parts[0].iter()).for_each(|(m, &b)| *m = bf16_value(b));
        *kept = reuse(&mut parts);
    }
    // ANCHOR_END: bf16_reduce_scatter

    /// **all-reduce of a gradient sum**: as [`Comm::reduce_scatter_sum`],
    /// then an all-gather; returns the whole sum over all ranks (padded),
    /// which `grads` holds. `shard` is the reduce-scatter's 1/N of it (at one
    /// rank with one sum it is not written: the sum is already whole).
    pub fn all_reduce_sum<'a>(&self, grads: &'a mut MicroBatchSum, shard: &mut [f32]) -> &'a mut [f32] {
        let sums = grads.sums();
        self.all_reduce_groups(sums, shard);
        &mut sums[0]
    }

    /// **all-reduce**, ordered: `buf` becomes the element-wise sum over ranks,
    /// bit for bit equal to `reduce_scatter` followed by `all_gather`, because
    /// that is how it is done above one rank (at one, `buf` already is the sum,
    /// and `shard` is not written). `buf.len()` must be a multiple of N (pad it;
    /// see [`ShardLayout`]).
    pub fn all_reduce(&self, buf: &mut [f32], shard: &mut [f32]) {
        let layout = ShardLayout::new(buf.len(), self.size);
        assert_eq!(layout.padding(), 0, "all_reduce: pad the buffer to a multiple of the world size");
        assert_eq!(shard.len(), layout.shard_len, "all_reduce: shard buffer must be 1/N of the vector");
        let bytes = self.all_reduce_bytes(1, layout.shard_len);
        self.timed(Collective::AllReduce, bytes, bytes, || self.all_reduce_packed(buf, 1, shard, self.rank_sum()));
    }

    /// MPI's own `MPI_Allreduce(SUM)`: typically faster, but its summation
    /// order is MPI's choice and differs between world sizes and from
    /// `MPI_Reduce_scatter` — kept only to measure against the ordered one.
    pub fn all_reduce_native<'a>(&self, buf: &'a mut [f32]) -> &'a mut [f32] {
        let bytes = self.all_reduce_bytes(1, buf.len().div_ceil(self.size));
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
        self.timed(Collective::GradNorm, bytes, bytes, || self.raw_all_gather(&words[..], &mut all[..]));
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
        self.timed(Collective::Control, bytes, bytes, || self.all_gather_untimed(values, &mut all[..]));
        all
    }

    /// Every rank's `values`, of any length each, in rank order (control
    /// data too: the lengths, then each padded to the longest). Untimed.
    pub fn gather_varying<T: Equivalence + Copy + Default>(&self, values: &[T]) -> Vec<Vec<T>> {
        let mut lens = vec![0u64; self.size];
        self.all_gather_untimed(&[values.len() as u64][..], &mut lens[..]);
        let most = lens.iter().copied().max().unwrap_or(0) as usize;
        if most == 0 {
            return vec![vec![]; self.size]; // nothing to send (MPI refuses zero-length buffers here)
        }
        let mut mine = values.to_vec();
        mine.resize(most, T::default());
        let mut all = vec![T::default(); most * self.size];
        self.all_gather_untimed(&mine[..], &mut all[..]);
        all.chunks(most.max(1)).zip(&lens).map(|(c, &l)| c[..l as usize].to_vec()).collect()
    }

    /// Ends every rank of the job at once with `code` (`MPI_Abort`): for a
    /// failure on one rank while the others may be waiting in a collective.
    pub fn abort(&self, code: i32) -> ! {
        crate::job::farewell(); // this rank's end is reported: no loss for the heartbeat
        self.comm.abort(code)
    }
}

/// `groups` (each N shards of `n`) laid out for the all-to-all:
/// [destination rank][my group][shard].
pub(crate) fn pack_groups(groups: &[Vec<f32>], size: usize, n: usize) -> Vec<f32> {
    let mut send = Vec::with_capacity(groups.len() * n * size);
    for j in 0..size {
        for g in groups {
            send.extend_from_slice(&g[j * n..(j + 1) * n]);
        }
    }
    send
}

/// The empty `Vec` of part pointers `kept`, for pointers of another
/// lifetime (and of another element type: f32 parts, or a bf16 reduction's
/// u16): the reduction fills it, and empties it back into `kept`, so its
/// allocation is made once and never freed (a stream's thread must not
/// allocate while the compute thread's heap is measured).
fn reuse<'a, 'b, A, B>(kept: &mut Vec<&'a mut [A]>) -> Vec<&'b mut [B]> {
    let mut v = std::mem::take(kept);
    v.clear();
    // SAFETY: the vector is empty, so no reference of lifetime 'a is left in
    // it to outlive its borrow, and `&mut [T]` (a pointer and a length) has
    // one layout whatever its lifetime and element type: only the allocation
    // is carried over.
    unsafe { std::mem::transmute::<Vec<&'a mut [A]>, Vec<&'b mut [B]>>(v) }
}

/// `v`'s values (bf16 ones held as f32) compacted in place into their bf16
/// bits, which then fill the first half of `v`'s bytes: element i's two
/// bytes are written at 2i, after element i's four at 4i were read, and
/// before any later element's are — nothing unread is overwritten.
fn compact_bf16(v: &mut [f32]) -> &[u16] {
    let (n, p) = (v.len(), v.as_mut_ptr());
    for i in 0..n {
        // SAFETY: i < n; the read of element i precedes the write at byte 2i ≤ 4i, and later
        // elements start at byte 4(i + 1) > 2i + 2: the write touches only elements already read.
        unsafe { p.cast::<u16>().add(i).write(bf16_bits(p.add(i).read())) };
    }
    // SAFETY: the first n u16s of v's storage were all written above; f32's alignment covers u16's.
    unsafe { std::slice::from_raw_parts(p.cast::<u16>(), n) }
}

/// The inverse of [`compact_bf16`]: the bf16 bits in the first half of
/// `v`'s bytes widened in place into the f32 values they are, back to
/// front: element i's four bytes at 4i are written after the bits at 2i
/// were read, and cover only bits at 2i and 2i + 1, read already (i > 0)
/// or just now (i = 0).
fn widen_bf16(v: &mut [f32]) {
    let (n, p) = (v.len(), v.as_mut_ptr());
    for i in (0..n).rev() {
        // SAFETY: i < n; the u16 at index i (bytes 2i..2i+2) lies inside v and is read before
        // element i (bytes 4i..4i+4) is written; that write covers u16s 2i and 2i + 1, both ≥ i,
        // so read already (i > 0: every u16 above i was read before) or this very one (i = 0).
        unsafe { p.add(i).write(bf16_value(p.cast::<u16>().add(i).read())) };
    }
}

/// An f32 buffer's storage as u16s, twice as many (any bits are valid u16s).
fn as_bits(v: &mut [f32]) -> &mut [u16] {
    // SAFETY: the same bytes, u16's alignment divides f32's, every bit pattern is a valid u16.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u16>(), 2 * v.len()) }
}
