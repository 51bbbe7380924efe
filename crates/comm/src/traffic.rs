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
    /// Of `bytes_sent`, those addressed to ranks on other nodes (machines):
    /// what crosses the network between them, payload only.
    pub bytes_remote: u64,
    pub bytes_received: u64,
    /// Inside the collective (waiting for other ranks included, unless they
    /// were synchronised first: [`crate::World`] under `FSDP_SYNC_COLLECTIVES=1`).
    pub seconds: f64,
    /// Under `FSDP_SYNC_COLLECTIVES=1`: in the barrier before each call —
    /// waiting for the slowest rank to arrive, not moving data.
    pub waited: f64,
    /// The compute thread's time blocked on it: all of `seconds` for a
    /// blocking call; for one on the communication stream, only the wait
    /// where the step needed its result (the rest was hidden behind compute).
    pub exposed: f64,
    /// On the communication stream: the CPU time its thread spent on the
    /// collective (driving MPI's progress, adding the parts), from the
    /// thread's own clock. 0 for a blocking call, which runs on the compute thread.
    pub cpu: f64,
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

    /// One call of `kind`: bytes, and its times (see [`TrafficStats`]).
    pub fn record(&mut self, kind: Collective, sent: usize, remote: usize, received: usize, times: Times) {
        let s = &mut self.stats[kind as usize];
        s.calls += 1;
        s.bytes_sent += sent as u64;
        s.bytes_remote += remote as u64;
        s.bytes_received += received as u64;
        s.seconds += times.seconds;
        s.waited += times.waited;
        s.exposed += times.exposed;
        s.cpu += times.cpu;
    }

    /// Both counts added, kind by kind: what a rank sent over several communicators.
    pub fn plus(&self, other: &Traffic) -> Traffic {
        let mut t = self.clone();
        for (a, b) in t.stats.iter_mut().zip(&other.stats) {
            a.calls += b.calls;
            a.bytes_sent += b.bytes_sent;
            a.bytes_remote += b.bytes_remote;
            a.bytes_received += b.bytes_received;
            a.seconds += b.seconds;
            a.waited += b.waited;
            a.exposed += b.exposed;
            a.cpu += b.cpu;
        }
        t
    }

    /// Seconds spent in all collectives (on whichever thread ran them).
    pub fn seconds(&self) -> f64 {
        self.stats.iter().map(|s| s.seconds).sum()
    }

    /// Seconds the compute thread was blocked on collectives.
    pub fn exposed(&self) -> f64 {
        self.stats.iter().map(|s| s.exposed).sum()
    }

    /// CPU seconds the communication thread spent on collectives.
    pub fn cpu(&self) -> f64 {
        self.stats.iter().map(|s| s.cpu).sum()
    }
}

/// The times of one call, as [`Traffic::record`] adds them up.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Times {
    pub seconds: f64,
    pub waited: f64,
    pub exposed: f64,
    pub cpu: f64,
}

impl Times {
    /// A blocking call: the compute thread was in it for all of `seconds`.
    pub fn blocking(seconds: f64, waited: f64) -> Self {
        Self { seconds, waited, exposed: seconds, cpu: 0.0 }
    }
}
