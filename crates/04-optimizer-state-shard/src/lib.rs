//! # step04-optimizer-state-shard — where the memory really goes
//!
//! [`OptimizerStateShard`] trains at ZeRO stage 1, 2 or 3 over lesson 03's
//! units; [`zero`] holds the bytes: the paper's per-device formulas (the
//! `zero-tally` binary behind `just tally`) and this run's tally per stage.
//!
//! ```
//! use step04_optimizer_state_shard::zero::model_state_bytes;
//! // 7B parameters, 16 bytes each, replicated: 112 GB per device.
//! assert_eq!(model_state_bytes(7e9, 64, 0, 12.0), 112e9);
//! // ZeRO-3 on 64 ranks: 1.75 GB.
//! assert_eq!(model_state_bytes(7e9, 64, 3, 12.0), 1.75e9);
//! ```
pub mod optimizer_state_shard;
pub mod zero;

pub use optimizer_state_shard::OptimizerStateShard;
