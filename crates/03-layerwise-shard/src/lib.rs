//! # step03-layerwise-shard — real FSDP, one unit unsharded at a time
//!
//! [`LayerwiseShard`] walks the model unit by unit: all-gather, compute,
//! free; in backward re-gather, recompute, backpropagate, reduce-scatter.
//! [`units`] holds the units themselves (all of lesson 04's stages reuse them),
//! [`tally`] the bytes they cost, [`hsdp`] hybrid sharding's flag and traffic
//! and [`accumulate`] the other ways through my micro-batches (`--accumulate`).
//!
//! ```no_run
//! # fn demo(s: &fsdp_harness::Session, start: fsdp_harness::Start) -> anyhow::Result<()> {
//! use step03_layerwise_shard::mixed_precision::MixedPrecision;
//! use step03_layerwise_shard::hsdp::UnitComms;
//! use step03_layerwise_shard::units::build_units;
//! use step03_layerwise_shard::{HeadGrad, LayerwiseShard};
//! // One block per unit over the world, resharded after every use, gathered in fp32 (FSDP2's defaults).
//! let units = build_units(s, 1, &start, UnitComms::world(s.world), true, MixedPrecision::default())?;
//! drop(start); // my shards are read
//! let head_grad = step03_layerwise_shard::tally::lower_peak(s, &units, 0);
//! let mut fsdp = LayerwiseShard { units, head_grad };
//! let loss = fsdp.step(s, 1, &mut fsdp_harness::MemoryTimeline::off())?;
//! # let _ = loss; Ok(()) }
//! ```
pub mod accumulate;
pub mod head_grad;
pub mod hsdp;
pub mod layerwise_shard;
pub mod mixed_precision;
pub mod prefetch;
pub mod readout;
pub mod tally;
pub mod units;

pub use accumulate::Accumulate;
pub use head_grad::HeadGrad;
pub use layerwise_shard::{LayerwiseShard, Phase, schedule};
pub use mixed_precision::{describe_reduce, reduce_flag};

// The exercises: yours (src/exercises.rs) and the answers, with the same
// signatures; `--mine K` makes the step call yours (fsdp_harness::exercise).
#[doc(hidden)]
#[path = "../solutions/exercises.rs"]
pub mod answers;
#[doc(hidden)]
#[path = "exercises.rs"]
pub mod mine;
