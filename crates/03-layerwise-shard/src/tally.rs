//! What lesson 03 holds per rank, from shapes alone, and the bytes its
//! collectives must move: the numbers the report prints beside the
//! measured heap and the counted traffic.
use fsdp_comm::ShardLayout;
use fsdp_harness::MemoryTally;
use fsdp_harness::table::{Table, mb};

use crate::units::FsdpUnit;

/// The activation shapes of one step on one rank.
#[derive(Debug, Clone, Copy)]
pub struct StepShape {
    /// My micro-batches per step (M / N).
    pub micro_batches: usize,
    /// My gradient sums per unit (`--sum-groups` G / N; by default 1): what the reduce-scatter sends.
    pub sum_groups: usize,
    /// The most partial sums a unit's gradient sum holds at once (the pairwise tree's stack).
    pub sum_buffers: usize,
    pub batch_size: usize,
    pub seq_len: usize,
    pub n_embd: usize,
    pub vocab_size: usize,
}

// ANCHOR: tally
/// Bytes this rank holds, by category: everything sharded between steps,
/// and at most one unit (two with prefetch) unsharded at any moment.
pub fn tally(units: &[FsdpUnit], shape: StepShape, prefetch: bool) -> MemoryTally {
    let n = units[0].layout().world;
    let shard: usize = units.iter().map(|u| u.layout().shard_len).sum();
    let largest = units.iter().max_by_key(|u| u.layout().numel).expect("a model has units");
    let (big, big_padded) = (largest.layout().numel, largest.layout().padded);
    let root = units[0].layout();
    let btc = shape.batch_size * shape.seq_len * shape.n_embd;
    let mine = shape.micro_batches; // my micro-batches per step
    let mut t = MemoryTally::new();
    let share = format!("1/{n} of every unit");
    t.add("master params shards (fp32)", shard, 4, &share)
        .add("AdamW m shards", shard, 4, &share)
        .add("AdamW v shards", shard, 4, &share)
        .add("grad shards", shard, 4, "reduce-scattered, 1/N of every unit");
    let what = format!("largest unit ({}), freed after use", largest.name());
    t.add(
        "gathered unit (all-gather output)",
        big_padded,
        4,
        &format!("largest unit ({}), freed once copied", largest.name()),
    )
    .add("unit params as candle Vars", big, 4, &what)
    .add("unit grads of one micro-batch", big, 4, "candle's GradStore, largest unit")
    .add("unit grad sum", shape.sum_buffers * big_padded, 4, "over my micro-batches, then reduce-scattered");
    if prefetch {
        t.add("next unit, prefetched", big_padded, 4, "--prefetch: its all-gather in flight");
    }
    t.add("root grad sum", shape.sum_buffers * root.padded, 4, "formed in the embedding's backward")
        .add("ln_f grads", mine * 2 * shape.n_embd, 4, "per micro-batch, from the head to the embedding's backward")
        .add(
            "lm_head part of wte grad",
            mine * shape.vocab_size * shape.n_embd,
            4,
            "per micro-batch, until the embedding's part",
        )
        .add("saved unit inputs", units.len() * mine * btc, 4, "activations kept for backward: (B, T, C) per unit")
        .add("upstream gradients", mine * btc, 4, "dL/dx at the current unit boundary");
    if n > 1 {
        let groups = shape.sum_groups; // more than one sum: packed per destination, then received
        t.add(
            "comm buffers",
            groups * big_padded + if groups > 1 { groups * big_padded } else { 0 },
            4,
            "reduce-scatter's all-to-all receive, largest unit",
        );
    }
    t
}
// ANCHOR_END: tally

/// The unsharded peak: the largest unit against lesson 02's whole model.
pub fn unsharded_peak_table(units: &[FsdpUnit], prefetch: bool) -> Table {
    let numel: usize = units.iter().map(|u| u.layout().numel).sum();
    let largest = units.iter().max_by_key(|u| u.layout().numel).expect("a model has units");
    let held = largest.layout().numel * if prefetch { 2 } else { 1 };
    let mut t = Table::new(["peak unsharded params", "elements", "MB"]);
    t.row([
        format!("largest unit ({}){}", largest.name(), if prefetch { " × 2 (prefetch)" } else { "" }),
        fsdp_harness::table::thousands(held as u64),
        mb(4 * held as u64),
    ]);
    t.row(["whole model (lesson 02)".to_string(), fsdp_harness::table::thousands(numel as u64), mb(4 * numel as u64)]);
    t.row(["ratio".to_string(), String::new(), format!("{:.1}× less", numel as f64 / held as f64)]);
    t
}

// ANCHOR: traffic
/// Bytes one rank sends per step, (all-gather, reduce-scatter), given the
/// units' layouts. Each gather sends my shard to N − 1 ranks; every unit is
/// gathered twice (a block for forward and backward, the root for the
/// embedding and the head) and its gradient reduce-scattered once.
pub fn bytes_per_step(units: &[ShardLayout]) -> (u64, u64) {
    let (mut gather, mut scatter) = (0, 0);
    for l in units {
        let once = ((l.world - 1) * l.shard_len * 4) as u64;
        gather += 2 * once;
        scatter += once;
    }
    (gather, scatter)
}
// ANCHOR_END: traffic
