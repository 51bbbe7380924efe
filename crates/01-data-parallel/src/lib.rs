//! # step01-data-parallel — the oracle, and DDP's buckets as a library
//!
//! The binary (`just step 01`) trains with plain data parallelism,
//! [`DataParallel`]. Its [`buckets`] — the gradient all-reduced bucket by
//! bucket during the backward (`--bucket-mb`), as PyTorch's DDP does — serve
//! lesson 02's all-reduce too.
pub mod buckets;
pub mod data_parallel;

pub use buckets::{Buckets, backward_in_buckets};
pub use data_parallel::{DataParallel, Reduce};

// The exercises: yours (src/exercises.rs) and the answers, with the same
// signatures; `--mine K` makes the step call yours (fsdp_harness::exercise).
#[doc(hidden)]
#[path = "../solutions/exercises.rs"]
pub mod answers;
#[doc(hidden)]
#[path = "exercises.rs"]
pub mod mine;
