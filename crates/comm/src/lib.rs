//! # fsdp-comm — the wire
//!
//! Everything the lessons send between ranks goes through this crate, kept
//! apart from the algorithms (as picotron keeps `*_communications.py` apart):
//!
//! - [`World`]: the MPI world (rank, size) and the collectives —
//!   `all_gather` (also overlapped with compute), `reduce_scatter`, `all_reduce`;
//!   `World::init` works without mpirun too (a world of one).
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
//! - [`Traffic`]: calls, bytes and wall time per collective kind.
//!
//! ```
//! use fsdp_comm::ShardLayout;
//! // 10 parameters over 4 ranks: padded to 12, 3 per rank, the last rank holds 1 real + 2 padding.
//! let layout = ShardLayout::new(10, 4);
//! assert_eq!(layout.padded, 12);
//! assert_eq!(layout.shard(3).offset, 9);
//! assert_eq!(layout.real_len(3), 1);
//! ```

pub mod exact;
pub mod layout;
pub mod reduce;
pub mod traffic;
pub mod world;

pub use exact::ExactSquares;
pub use layout::{ShardInfo, ShardLayout};
/// The element types the collectives move (f32, u16 for bf16 bits, u64, …).
pub use mpi::traits::Equivalence;
pub use reduce::{MicroBatchSum, SumGroups, nan_max, sum_pairwise};
pub use traffic::{Collective, Traffic, TrafficStats};
pub use world::{CommError, World, abort_job};
