//! # step02-whole-model-shard — the classic FSDP toy, as a library
//!
//! The binary (`just step 02`) trains with [`WholeModelShard`]; lesson 03
//! uses it too, as the whole-model baseline its memory timeline is drawn
//! against and as the reference of its `--check`. Beside the idea: [`check`]
//! (`--check`, the replicated reference) and [`buckets`] (`--bucket-mb`).
//!
//! ```no_run
//! # fn demo(s: &fsdp_harness::Session, start: fsdp_harness::Start) -> anyhow::Result<()> {
//! use step02_whole_model_shard::WholeModelShard;
//! let mut fsdp = WholeModelShard::new(s, &start, false)?;
//! drop(start); // my shard is read
//! let loss = fsdp.step(s, 1, &mut fsdp_harness::MemoryTimeline::off())?;
//! println!("loss {loss}");
//! # Ok(()) }
//! ```
pub mod buckets;
pub mod check;
pub mod whole_model_shard;

pub use check::Reference;
pub use whole_model_shard::{MyShard, WholeModelShard};

// The exercises: yours (src/exercises.rs) and the answers, with the same
// signatures; `--mine K` makes the step call yours (fsdp_harness::exercise).
#[doc(hidden)]
#[path = "../solutions/exercises.rs"]
pub mod answers;
#[doc(hidden)]
#[path = "exercises.rs"]
pub mod mine;
