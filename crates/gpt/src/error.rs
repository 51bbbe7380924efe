//! Typed errors of the model crate; the binaries report them once, at the edge.
use thiserror::Error;

#[derive(Debug, Error)]
pub enum GptError {
    #[error("unknown preset `{0}`: choose one of tiny, small, gpt2")]
    UnknownPreset(String),
    #[error("data file {path}: {reason}")]
    Data { path: String, reason: String },
    #[error("weights file {path}: {reason}")]
    Weights { path: String, reason: String },
    #[error(
        "parameter {index} of {count} ({shape}) has no gradient: the backward does not reach it \
         (computed from a detached copy, or from its values?)"
    )]
    NoGradient { index: usize, count: usize, shape: String },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, GptError>;
