//! # fsdp-comm — the wire
//!
//! Everything the lessons send between ranks goes through this crate, kept
//! apart from the algorithms (as picotron keeps `*_communications.py` apart):
//!
//! - [`World`]: the MPI world (rank, size) and, through [`Comm`], the
//!   collectives — `all_gather`, `reduce_scatter`, `all_reduce`;
//!   `World::init` works without mpirun too (a world of one).
//! - [`Stream`]: the communication stream — collectives on a thread of
//!   their own, handed over and waited for ([`Pending`]), so that the bytes
//!   move while the compute thread computes (FSDP2's all-gather and
//!   reduce-scatter streams); [`progress`] how its thread polls MPI without
//!   taking the core; [`trace`] records when each thing happened.
//! - **Ordered reductions** ([`reduce`]): every gradient sum is formed as one
//!   fixed pairwise tree over the step's micro-batches ([`MicroBatchSum`] on
//!   each rank, [`sum_pairwise`] across ranks), so `all_reduce ≡
//!   reduce_scatter + all_gather` bit for bit, and every power-of-two world
//!   size dividing M gives the bits of one rank. MPI's own reductions pick
//!   summation trees that differ between collectives and world sizes; the
//!   native all-reduce stays available ([`World::all_reduce_native`]) for comparison.
//! - [`ExactSquares`]: a sum of squares no split or order changes — the
//!   global gradient norm for `--grad-clip`, the same bits at every world size.
//! - [`ShardLayout`]: who owns which slice of a flat vector, as pure arithmetic.
//! - [`Traffic`]: calls, bytes and times per collective kind: wall time,
//!   the part the compute thread waited for (exposed), the stream's CPU time;
//!   across machines, the bytes addressed to other nodes.
//! - [`Mesh`] ([`mesh`]): HSDP's shard and replica groups (`MPI_Comm_split`).
//! - [`heartbeat`]: across machines, a dead node or link ends the job in
//!   bounded time, with one line naming the node; [`job`]: how a rank's or
//!   the job's end is told (its error, the abort, the farewell).
//!
//! ```
//! use fsdp_comm::ShardLayout;
//! // 10 parameters over 4 ranks: padded to 12, 3 per rank, the last rank holds 1 real + 2 padding.
//! let layout = ShardLayout::new(10, 4);
//! assert_eq!(layout.padded, 12);
//! assert_eq!(layout.shard(3).offset, 9);
//! assert_eq!(layout.real_len(3), 1);
//! ```

pub mod comm;
pub mod exact;
pub mod heartbeat;
pub mod job;
pub mod layout;
pub mod mesh;
pub mod progress;
pub mod reduce;
pub mod stream;
pub mod trace;
pub mod traffic;
pub mod world;

pub use comm::{Comm, RankSum};
pub use exact::ExactSquares;
pub use job::{CommError, abort_job};
pub use layout::{ShardInfo, ShardLayout};
pub use mesh::Mesh;
/// The element types the collectives move (f32, u16 for bf16 bits, u64, …).
pub use mpi::traits::Equivalence;
pub use progress::PollPolicy;
pub use reduce::{
    MicroBatchSlot, MicroBatchSum, ReduceDtype, SumGroups, nan_max, sum_pairwise, sum_pairwise_bf16, sum_pairwise_in,
};
pub use stream::{CommOf, Pending, Stream, Wire};
pub use trace::{Lane, Span, Trace};
pub use traffic::{Collective, Times, Traffic, TrafficStats};
pub use world::World;
