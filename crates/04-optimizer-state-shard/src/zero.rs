//! The bytes of ZeRO, two ways: from first principles for any model size
//! (the paper's formulas, `just tally 7B 64`), and from this run's shapes,
//! category by category, for data parallelism and each stage side by side.
use fsdp_gpt::Unit;
use fsdp_harness::table::{Table, mb};
use fsdp_harness::{MemoryTally, Moment, Session};
use step03_layerwise_shard::tally::{in_flight_part, largest_padded, receive_buffers};
use step03_layerwise_shard::units::FsdpUnit;

/// The schemes compared: plain data parallelism (lesson 01) and ZeRO 1–3.
pub const SCHEMES: [(u8, &str); 4] = [(0, "data parallel"), (1, "ZeRO-1"), (2, "ZeRO-2"), (3, "ZeRO-3")];

// ANCHOR: formula
/// Model-state bytes per device for `params` parameters on `ranks` ranks,
/// with `k` bytes of optimizer state per parameter (fp32 master, m, v: 12)
/// and 2-byte (bf16) weights and gradients — the ZeRO paper's accounting.
/// `stage` 0 is plain data parallelism.
pub fn model_state_bytes(params: f64, ranks: u64, stage: u8, k: f64) -> f64 {
    let n = ranks as f64;
    match stage {
        0 => (2.0 + 2.0 + k) * params,                     // everything replicated
        1 => 2.0 * params + 2.0 * params + k * params / n, // optimizer state sharded
        2 => 2.0 * params + (2.0 + k) * params / n,        // + gradients
        _ => (2.0 + 2.0 + k) * params / n,                 // + parameters
    }
}
// ANCHOR_END: formula

/// What a run's tally needs to know about its shapes.
#[derive(Debug, Clone, Copy)]
pub struct Shapes {
    /// Parameters (Ψ), unpadded.
    pub numel: usize,
    /// Σ over units of the padded length (the resident copies are padded).
    pub padded: usize,
    /// Σ over units of my shard's length.
    pub shards: usize,
    /// The largest unit: elements, and padded.
    pub largest: usize,
    pub largest_padded: usize,
    pub ranks: usize,
    /// Bytes per element of the compute copy and candle's gradients (2 for bf16).
    pub compute_bytes: usize,
    /// Stage 3's units gathered ahead (`--prefetch`: 2, or 1 where memory does not allow two; 0 without).
    pub prefetch: usize,
    /// Gradient sums per unit on each rank (`--sum-groups` G / N; by default 1): what the reduce-scatter sends.
    pub sum_groups: usize,
    /// The most partial sums one gradient sum holds at once (the pairwise tree's stack).
    pub sum_buffers: usize,
}

// ANCHOR: model_states
/// Bytes per rank by category for `stage` (0: data parallelism, lesson 01),
/// from shapes: model states and the buffers around them, for comparing the
/// schemes side by side. Activations, the same in every scheme at equal
/// activation policy, are not here; a run's own tally ([`stage1_tally`],
/// [`stage2_tally`], lesson 03's for stage 3) has them, beside the measured peak.
pub fn model_states(stage: u8, sh: Shapes) -> MemoryTally {
    let (c, n) = (sh.compute_bytes, sh.ranks);
    let cdt = if c == 2 { "bf16" } else { "fp32" };
    let mut t = MemoryTally::new();
    if stage == 0 {
        let (shard, g) = (sh.numel.div_ceil(n), sh.sum_groups);
        // receive (one padded vector per group), the packed send when g > 1, my shard
        let all_reduce = if n > 1 || g > 1 { g * shard * n + if g > 1 { g * shard * n } else { 0 } + shard } else { 0 };
        t.add("fp32 params (the master)", sh.numel, 4, "replicated")
            .add("AdamW m", sh.numel, 4, "replicated")
            .add("AdamW v", sh.numel, 4, "replicated")
            .add(&format!("compute copy as candle Vars ({cdt})"), sh.numel, c, "whole model")
            .add(&format!("grads of one micro-batch ({cdt})"), sh.numel, c, "whole model")
            .add("grad sum (fp32)", sh.sum_buffers * sh.numel.div_ceil(n) * n, 4, "whole model, all-reduced")
            .add("comm buffers", all_reduce, 4, "all-to-all receive + own shard");
        return t;
    }
    let share = format!("1/{n} of every unit");
    t.add("fp32 master shard", sh.shards, 4, &share)
        .add("AdamW m shard", sh.shards, 4, &share)
        .add("AdamW v shard", sh.shards, 4, &share)
        .add("grad shard (fp32)", sh.shards, 4, &share);
    // Where the compute copy lives: resident (stages 1, 2) or gathered per unit (3).
    match stage {
        1 | 2 => t.add(
            &format!("compute copy, resident ({cdt})"),
            sh.padded,
            c,
            "whole model, all-gathered after each update",
        ),
        _ => t.add(&format!("gathered unit ({cdt})"), sh.largest_padded, c, "all-gather output, freed once copied"),
    };
    // What backward holds: the whole model's (stage 1) or one unit's (2, 3).
    match stage {
        1 => t
            .add(&format!("compute copy as candle Vars ({cdt})"), sh.numel, c, "whole model")
            .add(&format!("grads of one micro-batch ({cdt})"), sh.numel, c, "whole model")
            .add("grad sums (fp32)", sh.sum_buffers * sh.padded, 4, "whole model, until reduce-scattered"),
        _ => t
            .add(&format!("unit as candle Vars ({cdt})"), sh.largest, c, "largest unit, freed after use")
            .add(&format!("unit grads of one micro-batch ({cdt})"), sh.largest, c, "largest unit, freed after use")
            .add(
                "unit grad sum (fp32)",
                sh.sum_buffers * sh.largest_padded,
                4,
                "reduce-scattered as soon as the unit is done",
            ),
    };
    if stage == 3 && sh.prefetch > 0 {
        let (what, note) = match sh.prefetch {
            1 => ("next unit".to_string(), "--prefetch, one ahead".to_string()),
            k => (format!("next {k} units"), format!("--prefetch, {k} ahead, the largest unit's size each")),
        };
        t.add(&format!("{what}, prefetched ({cdt})"), sh.prefetch * sh.largest_padded, c, &note);
    }
    if n > 1 || sh.sum_groups > 1 {
        let groups = sh.sum_groups; // more than one sum: packed per destination, then received
        t.add(
            "comm buffers",
            groups * sh.largest_padded + if groups > 1 { groups * sh.largest_padded } else { 0 },
            4,
            "reduce-scatter's all-to-all receive, largest unit",
        );
    }
    t
}
// ANCHOR_END: model_states

// ANCHOR: stage1_tally
/// What ZeRO-1 and ZeRO-2 keep from step to step: the shards, the resident
/// compute copy, the reduce-scatter's receive buffer, the data.
fn resident_kept(s: &Session, units: &[FsdpUnit]) -> MemoryTally {
    let (n, e) = (units[0].layout().world, units[0].param_bytes()); // N, or S under --hsdp
    let dt = if e == 2 { "bf16" } else { "fp32" };
    let shard: usize = units.iter().map(|u| u.layout().shard_len).sum();
    let padded: usize = units.iter().map(|u| u.layout().padded).sum();
    let mut t = MemoryTally::new();
    let share = format!("1/{n} of every unit");
    t.add("fp32 master shard", shard, 4, &share)
        .add("AdamW m shard", shard, 4, &share)
        .add("AdamW v shard", shard, 4, &share)
        .add("grad shard (fp32)", shard, 4, &share)
        .add(&format!("compute copy, resident ({dt})"), padded, e, "whole model, all-gathered after each update");
    for (_, category, len, note) in receive_buffers(s, units) {
        t.add(category, len, 4, note);
    }
    s.data_tally(&mut t);
    t
}

/// This rank's bytes under ZeRO-1, from shapes: what it keeps, and the
/// peak — a micro-batch's backward through the whole model (block by block
/// under `--recompute`), with every unit's gradient sums. Under
/// `--overlap-comm` my last micro-batch runs block by block, handing each
/// unit's sum to the stream, as ZeRO-2's last micro-batch does.
pub fn stage1_tally(s: &Session, units: &[FsdpUnit], recompute: bool, overlap_comm: bool) -> MemoryTally {
    let e = units[0].param_bytes();
    let dt = if e == 2 { "bf16" } else { "fp32" };
    let padded: usize = units.iter().map(|u| u.layout().padded).sum();
    let numel = s.table.numel();
    let mut t = resident_kept(s, units);
    let mut moments = vec![];
    let mine = s.my_micro_batches().len();
    for k in 0..mine {
        if overlap_comm && k + 1 == mine {
            moments.extend(blockwise_moments(s, units, recompute, k, true));
            continue;
        }
        let (label, add) = (format!("micro-batch {k}"), format!("adding micro-batch {k}'s gradients to the sums"));
        moments.extend(s.whole_model_moments(e, recompute, &label, &add, &mut |adding, m| {
            // The sums' buffers: those of my micro-batches so far, this one's once it is added.
            let held = s.sum_groups.allocated_before(k + usize::from(adding));
            m.add(&format!("compute copy as candle Vars ({dt})"), numel, e, "whole model").add(
                "grad sums (fp32)",
                held * padded,
                4,
                "whole model, over my micro-batches so far",
            );
        }));
    }
    let groups = s.sum_groups.per_rank();
    if groups > 1 && !overlap_comm {
        // The reduce-scatters after the backward: every unit's sums, and the
        // largest unit's packed per destination.
        let mut m = Moment::new("reduce-scatter of several group sums");
        let largest = largest_padded(units);
        m.add("grad sums (fp32)", s.sum_groups.buffers() * padded, 4, "whole model, every micro-batch of mine").add(
            "send buffer",
            groups * largest,
            4,
            "the largest unit's group sums packed per destination",
        );
        moments.push(m);
    }
    t.peak(moments);
    t
}
// ANCHOR_END: stage1_tally

// ANCHOR: stage2_tally
/// This rank's bytes under ZeRO-2, from shapes: what it keeps, and the
/// peak over the block-by-block backward of every micro-batch of mine.
/// Each unit's sum holds its buffers until my last micro-batch's backward
/// has added to it, then is reduce-scattered and freed (under
/// `--overlap-comm`, freed once the stream has sent it: when the next
/// unit is handed on).
pub fn stage2_tally(s: &Session, units: &[FsdpUnit], recompute: bool, overlap_comm: bool) -> MemoryTally {
    let mut t = resident_kept(s, units);
    let moments =
        (0..s.my_micro_batches().len()).flat_map(|k| blockwise_moments(s, units, recompute, k, overlap_comm)).collect();
    t.peak(moments);
    t
}

/// The moments of my micro-batch `k` through the resident copy, block by
/// block, each unit's gradient added to its sum as its backward ends, and
/// after my last micro-batch reduce-scattered (on the stream, one unit in
/// flight at a time, under `overlap`).
fn blockwise_moments(s: &Session, units: &[FsdpUnit], recompute: bool, k: usize, overlap: bool) -> Vec<Moment> {
    let e = units[0].param_bytes();
    let dt = if e == 2 { "bf16" } else { "fp32" };
    let mine = s.my_micro_batches().len();
    let last = k + 1 == mine;
    // Which unit holds block i's parameters, and the root.
    let unit_of = |u: Unit| -> usize {
        let first = s.table.unit_params(u).start;
        units.iter().position(|x| x.params().contains(&first)).expect("a unit")
    };
    let order: Vec<usize> = (0..s.cfg.n_layer).rev().map(|i| unit_of(Unit::Block(i))).chain([0]).collect();
    s.blockwise_moments(e, recompute, &format!("micro-batch {k}"), &mut |now, handed, m| {
        // Units whose gradients were added in this micro-batch: those
        // before `now` in `order`, and `now` itself once handed on.
        let before = match now {
            Unit::FinalNorm => 0,
            u => order.iter().position(|&x| x == unit_of(u)).expect("in order"),
        };
        let done = before + usize::from(handed && now != Unit::FinalNorm);
        // Under overlap, the unit handed on last is in flight until the next
        // hand-off waits for it (just before it adds).
        let in_flight = (overlap && last && !handed && before > 0).then(|| order[before - 1]);
        if handed {
            let unit = &units[unit_of(now)];
            let groups = s.sum_groups.per_rank();
            if last && groups > 1 {
                m.add("send buffer", groups * unit.layout().padded, 4, "its group sums packed per destination");
            }
        }
        let sums: usize = units
            .iter()
            .enumerate()
            .map(|(x, unit)| {
                let added = order[..done].contains(&x);
                let handing = handed && x == unit_of(now); // its last add, before its reduce-scatter
                let buffers = match (added, last && !handing) {
                    (true, true) => 0, // reduce-scattered (or in flight: its row is below) and freed
                    (true, false) => s.sum_groups.allocated_before(k + 1),
                    (false, _) => s.sum_groups.allocated_before(k),
                };
                buffers * unit.layout().padded
            })
            .sum();
        m.add(&format!("compute copy as candle Vars ({dt})"), s.table.numel(), e, "whole model").add(
            "unit grad sums (fp32)",
            sums,
            4,
            "units not yet reduce-scattered, over my micro-batches so far",
        );
        if let Some(x) = in_flight {
            m.add(
                &format!("{}'s grad sums, reduce-scatter in flight (fp32)", units[x].name()),
                s.sum_groups.per_rank() * units[x].layout().padded,
                4,
                "--overlap-comm: sent from the stream while the blocks below compute",
            );
            if let Some((category, len, note)) = in_flight_part(s, &units[x]) {
                m.add(&category, len, 4, note);
            }
        }
    })
}
// ANCHOR_END: stage2_tally

/// Data parallelism and the three stages, side by side, for this run's
/// model and world size: the from-shapes total, and the paper's formula.
pub fn side_by_side(sh: Shapes, k: f64) -> Table {
    let mut t = Table::new(["per rank", "data parallel", "ZeRO-1", "ZeRO-2", "ZeRO-3"]);
    let tallies: Vec<MemoryTally> = SCHEMES.iter().map(|&(st, _)| model_states(st, sh)).collect();
    let by = |pick: &dyn Fn(&str) -> bool| -> Vec<String> {
        tallies.iter().map(|t| mb(t.rows.iter().filter(|r| pick(&r.category)).map(|r| r.bytes()).sum())).collect()
    };
    let row = |t: &mut Table, label: &str, cells: Vec<String>| {
        t.row(std::iter::once(label.to_string()).chain(cells).collect::<Vec<_>>());
    };
    row(&mut t, "fp32 master + AdamW m, v", by(&|c| c.contains("master") || c.starts_with("AdamW")));
    row(&mut t, "gradients (compute + fp32 sums, shard)", by(&|c| c.contains("grad")));
    row(
        &mut t,
        "compute copy of the weights",
        by(&|c| {
            c.contains("compute copy")
                || c.contains("unit as")
                || c.contains("gathered unit")
                || c.contains("prefetched")
        }),
    );
    row(&mut t, "comm buffers", by(&|c| c == "comm buffers"));
    t.separator();
    row(&mut t, "model states and buffers, from shapes", tallies.iter().map(|t| mb(t.total_bytes())).collect());
    let paper =
        SCHEMES.iter().map(|&(st, _)| mb(model_state_bytes(sh.numel as f64, sh.ranks as u64, st, k) as u64)).collect();
    row(&mut t, &format!("ZeRO paper, K = {k}: 2+2+K bytes/param"), paper);
    t
}
