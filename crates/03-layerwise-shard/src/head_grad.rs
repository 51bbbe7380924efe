//! Where the tied `wte`'s lm_head gradient waits for its embedding part.
//!
//! The tied `wte` gets its lm_head part at the head and its embedding part
//! at the very end, combined the way candle's whole-graph backward combines
//! them, so the weights stay lesson 01's, bit for bit. In between, a rank
//! holds per micro-batch either that lm_head part (V, C) or the head's input
//! (B, T, C), recomputing the head at the end: [`HeadGrad`], whichever is
//! smaller ([`crate::tally::lower_peak`]).

// ANCHOR: head_grad
/// Where the tied `wte`'s lm_head gradient waits for its embedding part.
/// Candle's one backward forms `wte`'s gradient per micro-batch as the
/// lm_head part with the token rows index-added onto it, and micro-batches
/// are summed as whole gradients; so each micro-batch's lm_head part must
/// exist whole when its rows arrive, at the very end of the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadGrad {
    /// Hold the lm_head part, (V, C) per micro-batch, from the head to the
    /// embedding's backward.
    Keep,
    /// Hold the head's input, (B, T, C) per micro-batch, and recompute the
    /// head at the embedding's backward: the root is gathered a third time,
    /// and the head runs forward and backward twice.
    Recompute,
}
// ANCHOR_END: head_grad

impl HeadGrad {
    /// All-gathers of the root per step: the embedding and the head, and
    /// the head again when it is recomputed.
    pub fn root_gathers(self) -> usize {
        match self {
            HeadGrad::Keep => 2,
            HeadGrad::Recompute => 3,
        }
    }

    /// The flag's word for it.
    pub fn name(self) -> &'static str {
        match self {
            HeadGrad::Keep => "keep",
            HeadGrad::Recompute => "recompute",
        }
    }

    /// For the config table.
    pub fn describe(self, micro_batch: (usize, usize), c: usize, vocab: usize) -> String {
        let (held, shape) = match self {
            HeadGrad::Keep => ("its lm_head part kept", format!("(V, C) = {vocab} × {c}")),
            HeadGrad::Recompute => (
                "the head recomputed at the end",
                format!("input (B, T, C) = {} × {} × {c}", micro_batch.0, micro_batch.1),
            ),
        };
        format!("{held}: {shape} per micro-batch")
    }
}

impl std::str::FromStr for HeadGrad {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "keep" => Ok(HeadGrad::Keep),
            "recompute" => Ok(HeadGrad::Recompute),
            _ => Err(format!("unknown --head-grad {s:?}: pass keep or recompute (or leave it out: the smaller)")),
        }
    }
}
