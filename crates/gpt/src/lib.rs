//! # fsdp-gpt — the model every lesson trains
//!
//! A nanoGPT-style character-level GPT written with candle: token and position
//! embeddings, pre-LayerNorm blocks (causal self-attention, 4× GELU MLP), a
//! final LayerNorm and an `lm_head` tied to the token embedding. Beside the
//! model: the deterministic data pipeline and the one AdamW every lesson uses.
//!
//! The crate offers *mechanisms* only. It knows nothing about ranks or shards:
//! parameters travel as one flat `f32` vector in a documented order
//! ([`ParamTable`]), and each lesson decides who holds which part of it.
//!
//! ```
//! use fsdp_gpt::{GptConfig, ParamTable, Gpt};
//! let cfg = GptConfig::preset("tiny", 65).unwrap();
//! let table = ParamTable::new(&cfg);
//! assert_eq!(table.numel(), 809_856); // the classic toy's size
//! let flat = table.init_flat(1337);   // the same on every rank, no communication
//! let model = Gpt::new(cfg);
//! let vars = model.vars_from_flat(&table, &flat).unwrap();
//! # let _ = vars;
//! ```
//!
//! | module | what it holds |
//! |---|---|
//! | [`config`] | presets `tiny`, `small`, `gpt2` and derived sizes |
//! | [`params`] | the parameter order, nanoGPT names, flat layout, deterministic init |
//! | [`kernels`] | our own matmul: the same bits on every machine (candle's depends on the CPU) |
//! | [`model`] | the forward pass, also one unit (embedding, block, head) at a time |
//! | [`blockwise`] | forward and backward block by block, each block's backward the project's own (a tape of its fused ops), with or without recompute: the same bits as one backward |
//! | [`memory`] | what a forward/backward pass holds, from shapes: candle's backward, or a tape's, replayed op by op |
//! | [`data`] | the generated default corpus, the vocabulary, the world-size-invariant sampler |
//! | [`adamw`] | AdamW over flat `f32` slices, `torch.optim.AdamW` semantics |
//! | [`weights_file`] | the weights as one safetensors file with nanoGPT's names and layouts |

pub mod adamw;
pub mod blockwise;
pub mod config;
pub mod data;
pub mod error;
pub mod kernels;
pub mod memory;
pub mod model;
pub mod params;
pub mod precision;
pub mod rng;
pub mod weights_file;

pub use adamw::{AdamW, AdamWConfig};
pub use config::GptConfig;
pub use data::{Batch, Corpus, Sampler};
pub use error::GptError;
pub use model::Gpt;
pub use params::{ParamSpec, ParamTable, Unit};
pub use precision::Precision;
