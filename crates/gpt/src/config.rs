//! Model shapes: presets and the sizes derived from them.
use crate::error::{GptError, Result};

/// The shape of a GPT, nanoGPT's `GPTConfig` without dropout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptConfig {
    pub vocab_size: usize,
    /// The context length T: the longest sequence the model sees.
    pub block_size: usize,
    pub n_layer: usize,
    pub n_head: usize,
    /// The width C of the residual stream.
    pub n_embd: usize,
}

impl GptConfig {
    /// The presets every lesson accepts, for a vocabulary of `vocab_size` characters.
    ///
    /// | preset | layers | heads | n_embd | block | params (vocab 65) |
    /// |---|---|---|---|---|---|
    /// | `tiny` | 4 | 4 | 128 | 64 | 809,856 (the classic toy) |
    /// | `small` | 6 | 6 | 384 | 128 | 10,721,664 |
    /// | `gpt2` | 12 | 12 | 768 | 1024 | 85,892,352 (GPT-2 small's body, char vocab) |
    pub fn preset(name: &str, vocab_size: usize) -> Result<Self> {
        let (n_layer, n_head, n_embd, block_size) = match name {
            "tiny" => (4, 4, 128, 64),
            "small" => (6, 6, 384, 128),
            "gpt2" => (12, 12, 768, 1024),
            other => return Err(GptError::UnknownPreset(other.to_string())),
        };
        Ok(Self { vocab_size, block_size, n_layer, n_head, n_embd })
    }

    pub const PRESETS: [&'static str; 3] = ["tiny", "small", "gpt2"];

    /// Size of one attention head.
    pub fn head_size(&self) -> usize {
        self.n_embd / self.n_head
    }
}
