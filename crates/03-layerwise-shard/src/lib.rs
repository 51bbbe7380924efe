//! # step03-layerwise-shard — real FSDP, one unit unsharded at a time
//!
//! [`LayerwiseShard`] walks the model unit by unit: all-gather, compute,
//! free; in backward re-gather, recompute, backpropagate, reduce-scatter.
//! [`units`] holds the units themselves (all of lesson 04's stages reuse them)
//! and [`tally`] the bytes they cost.
//!
//! ```no_run
//! # fn demo(s: &fsdp_harness::Session) -> anyhow::Result<()> {
//! use step03_layerwise_shard::{LayerwiseShard, units::build_units};
//! let init = s.table.init_flat(s.args.seed);
//! let (rank, n) = (s.world.rank(), s.world.size());
//! let units = build_units(&s.table, s.cfg.n_layer, 1, &init, rank, n, s.adamw, fsdp_gpt::Precision::Fp32);
//! let mut fsdp = LayerwiseShard { units, prefetch: false };
//! let loss = fsdp.step(s, 1, &mut fsdp_harness::MemoryTimeline::off())?;
//! # let _ = loss; Ok(()) }
//! ```
pub mod layerwise_shard;
pub mod tally;
pub mod units;

pub use layerwise_shard::{LayerwiseShard, Phase, schedule};
