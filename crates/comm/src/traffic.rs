//! Counters per collective kind: what each rank put on the wire.
//!
//! "Bytes sent" counts the payload this rank must deliver to *other* ranks —
//! the quantity ring algorithms achieve and the textbook formulas give:
//! all-gather and reduce-scatter of a vector of S bytes move (N−1)/N·S per
//! rank, an all-reduce twice that.

/// The collectives the lessons use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Collective {
    AllGather,
    ReduceScatter,
    AllReduce,
    /// Small control messages: loss averages, digests, error agreement.
    Control,
    /// `--grad-clip`: every rank's exact sum of squares of its gradient shard.
    GradNorm,
}

impl Collective {
    pub const ALL: [Collective; 5] =
        [Self::AllGather, Self::ReduceScatter, Self::AllReduce, Self::Control, Self::GradNorm];

    pub fn name(&self) -> &'static str {
        match self {
            Self::AllGather => "all_gather",
            Self::ReduceScatter => "reduce_scatter",
            Self::AllReduce => "all_reduce",
            Self::Control => "control",
            Self::GradNorm => "grad_norm",
        }
    }
}

/// Totals for one collective kind.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TrafficStats {
    pub calls: u64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// Inside the collective (waiting for other ranks included, unless they
    /// were synchronised first: [`crate::World`] under `FSDP_SYNC_COLLECTIVES=1`).
    pub seconds: f64,
    /// Under `FSDP_SYNC_COLLECTIVES=1`: in the barrier before each call —
    /// waiting for the slowest rank to arrive, not moving data.
    pub waited: f64,
}

/// Totals for every kind, indexed by [`Collective`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Traffic {
    pub stats: [TrafficStats; 5],
}

impl Traffic {
    pub fn get(&self, kind: Collective) -> TrafficStats {
        self.stats[kind as usize]
    }

    pub fn record(&mut self, kind: Collective, sent: usize, received: usize, seconds: f64, waited: f64) {
        let s = &mut self.stats[kind as usize];
        s.calls += 1;
        s.bytes_sent += sent as u64;
        s.bytes_received += received as u64;
        s.seconds += seconds;
        s.waited += waited;
    }

    /// Seconds spent in all collectives.
    pub fn seconds(&self) -> f64 {
        self.stats.iter().map(|s| s.seconds).sum()
    }
}
