//! # step01-data-parallel — the oracle, and DDP's buckets as a library
//!
//! The binary (`just step 01`) trains with plain data parallelism. Its
//! [`buckets`] — the gradient all-reduced bucket by bucket during the
//! backward (`--bucket-mb`), as PyTorch's DDP does — serve lesson 02's
//! all-reduce too.
pub mod buckets;

pub use buckets::{Buckets, backward_in_buckets};
