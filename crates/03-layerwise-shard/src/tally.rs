//! What lesson 03 holds per rank, from shapes alone, and the bytes its
//! collectives must move: the numbers the report prints beside the
//! measured heap and the counted traffic.
use fsdp_comm::{CommOf, ShardLayout};
use fsdp_gpt::kernels::Probs;
use fsdp_gpt::memory::block_activations;
use fsdp_harness::memory_tally::{embedding_rows, pass_rows, tape_rows};
use fsdp_harness::table::{Table, mb};
use fsdp_harness::{MemoryTally, Moment, Session};

use crate::head_grad::HeadGrad;
use crate::layerwise_shard::schedule;
use crate::prefetch::gathered_ahead;
use crate::units::FsdpUnit;

// ANCHOR: tally
/// Bytes this rank holds, by category, from shapes: every unit's shards
/// (kept), and the busiest moment of the step's schedule — the head, a
/// unit's recompute+backward or the embedding's backward, micro-batch by
/// micro-batch — with what it carries from the entries before it
/// ([`step_moments`]).
/// Lesson 04's stage 3 runs the same schedule and uses it too. `prefetch`:
/// the entries gathered ahead (0 without `--prefetch`).
pub fn tally(s: &Session, units: &[FsdpUnit], prefetch: usize, head: HeadGrad) -> MemoryTally {
    let mut k = kept(s, units);
    let all_mine = Pass {
        mine: s.my_micro_batches().len(),
        first: 0,
        handed_on: false,
        merged_first: false,
        across: &|_: &mut Moment, _: usize, _: bool| {},
    };
    k.peak(step_moments(s, units, prefetch, head, &all_mine));
    k
}
// ANCHOR_END: tally

/// What every unit's shards and the kept buffers take, from step to step.
pub(crate) fn kept(s: &Session, units: &[FsdpUnit]) -> MemoryTally {
    let n = units[0].layout().world; // the ranks a unit is sharded over: N, or S under --hsdp
    let shard: usize = units.iter().map(|u| u.layout().shard_len).sum();
    let mut k = MemoryTally::new();
    let share = format!("1/{n} of every unit");
    k.add("master params shards (fp32)", shard, 4, &share)
        .add("AdamW m shards", shard, 4, &share)
        .add("AdamW v shards", shard, 4, &share)
        .add("grad shards (fp32)", shard, 4, "reduce-scattered, 1/N of every unit");
    for (over, category, len, note) in receive_buffers(s, units) {
        let elem = if over == fsdp_comm::CommOf::Replica { 4 } else { s.reduce_dtype.bytes() }; // (HSDP: fp32 only)
        k.add(category, len, elem, note);
    }
    s.data_tally(&mut k);
    k
}

/// Which of my micro-batches walk the schedule together in the moments of
/// [`step_moments`], and what lives across them.
pub(crate) struct Pass<'a> {
    /// How many: all of mine (unit-major), or one (`--accumulate`'s other modes).
    pub mine: usize,
    /// The first one's index among mine (for the moments' labels).
    pub first: usize,
    /// Whether a unit's gradient is handed on after its backward entry
    /// (`accumulate.rs`), rather than reduce-scattered there: a moment for
    /// each hand-off then.
    pub handed_on: bool,
    /// Whether, at a hand-off, the gradient is added into the held sums
    /// before they are packed to be sent (no-sync's and keep-unsharded's last
    /// micro-batch with several sums per rank): the moment then holds the
    /// sums and the send buffer, the gradient no longer.
    pub merged_first: bool,
    /// Adds what lives across micro-batches at schedule entry `at`, or
    /// (`true`) at its unit's hand-off after it.
    pub across: &'a dyn Fn(&mut Moment, usize, bool),
}

// ANCHOR: step_moments
/// The moments of the step's schedule, entry by entry, for the
/// micro-batches of `pass`: the busiest is the step's peak.
pub(crate) fn step_moments(
    s: &Session,
    units: &[FsdpUnit],
    prefetch: usize,
    head: HeadGrad,
    pass: &Pass,
) -> Vec<Moment> {
    let e = units[0].param_bytes(); // the compute dtype's bytes
    let dt = if e == 2 { "bf16" } else { "fp32" };
    let ((b, t), c, v) = (s.micro_batch_shape(), s.cfg.n_embd, s.cfg.vocab_size);
    let (btc, mine, mb) = (b * t * c, pass.mine, |k: usize| pass.first + k);
    let shapes = s.shapes(e);
    let tape = shapes.block_taped((b, t)); // a block recomputed on its tape, and its backward
    let block_numel = s.table.unit_range(fsdp_gpt::Unit::Block(0)).len();
    let blocks = units.len() - 1; // block units
    let ids = |m: &mut Moment| {
        m.add("micro-batch token ids", mine * 2 * b * t, 4, "inputs and targets of my micro-batches");
    };
    // What the backward entries carry: the upstream gradient and the head's
    // outputs for each of my micro-batches (`done` of them so far).
    let carried = |m: &mut Moment, done: usize| {
        m.add(
            &format!("upstream gradients ({dt})"),
            done * btc,
            e,
            "dL/dx at the unit boundary, (B, T, C) per micro-batch",
        );
        match head {
            HeadGrad::Keep => m.add(
                &format!("lm_head part of wte grad ({dt})"),
                done * v * c,
                e,
                "per micro-batch, until the embedding's part",
            ),
            HeadGrad::Recompute => m.add(
                &format!("saved head inputs ({dt})"),
                done * btc,
                e,
                "(B, T, C) per micro-batch, to recompute the head at the end",
            ),
        }
        .add(
            &format!("ln_f grads ({dt})"),
            done * 2 * c,
            e,
            "per micro-batch, until the root's gradient is summed",
        );
    };
    // --prefetch: the all-gathers in flight on the stream while the
    // schedule's entry `at` computes, each one's output and my shard copied
    // in (both freed when it is waited for) …
    let plan = schedule(units.len() - 1, head);
    let prefetched = |m: &mut Moment, at: usize| {
        let ahead: Vec<&FsdpUnit> = gathered_ahead(&plan, at, prefetch).map(|i| &units[plan[i].unit()]).collect();
        if ahead.is_empty() {
            return;
        }
        let (padded, shards) = ahead.iter().fold((0, 0), |(p, h), u| (p + u.layout().padded, h + u.layout().shard_len));
        let names: Vec<&str> = ahead.iter().map(|u| u.name()).collect();
        let (what, note) = match ahead.len() {
            1 => ("next unit".to_string(), format!("--prefetch: {}'s all-gather in flight", names[0])),
            k => (format!("next {k} units"), format!("--prefetch: {}'s all-gathers in flight", names.join(", "))),
        };
        m.add(&format!("{what}, prefetched ({dt})"), padded, e, &note).add(
            &format!("my shard of {}, copied in ({dt})", if ahead.len() == 1 { "it" } else { "each" }),
            shards,
            e,
            "the all-gather's input",
        );
    };
    // … and the unit above's reduce-scatter, handed to the stream after its
    // backward and waited for once this unit's backward is done.
    let reducing = |m: &mut Moment, above: Option<&FsdpUnit>| {
        if let Some(u) = above.filter(|_| prefetch > 0) {
            m.add(
                &format!("{}'s grad sums, reduce-scatter in flight (fp32)", u.name()),
                s.sum_groups.per_rank() * u.layout().padded,
                4,
                "--prefetch: sent from the stream while this unit computes",
            );
            if let Some((category, len, note)) = in_flight_part(s, u) {
                m.add(&category, len, 4, note);
            }
        }
    };
    let sums = |m: &mut Moment, u: &FsdpUnit, k: usize| {
        let held = s.sum_groups.allocated_before(k);
        m.add(
            "unit grad sums (fp32)",
            held * u.layout().padded,
            4,
            "over my micro-batches so far, then reduce-scattered",
        );
    };
    // A unit's reduce-scatter with several sums per rank (--sum-groups):
    // they are packed per destination first, beside the sums themselves.
    // `at`: its entry in the schedule.
    // Handed on instead (`pass.handed_on`): a moment for every unit's hand-off.
    let send_moment = |u: &FsdpUnit, at: usize, saved: usize, done: usize| {
        let groups = s.sum_groups.per_rank();
        (groups > 1 || pass.handed_on).then(|| {
            let mut m = match pass.handed_on {
                false => Moment::new(format!("reduce-scatter of {}", u.name())),
                true => Moment::new(format!("hand-off of {}, micro-batch {}", u.name(), mb(0))),
            };
            m.add(&format!("saved unit inputs ({dt})"), saved, e, "(B, T, C) per unit and micro-batch");
            carried(&mut m, done);
            if !pass.merged_first {
                sums(&mut m, u, done);
            }
            if !pass.handed_on {
                m.add("send buffer", groups * u.layout().padded, 4, "its group sums packed per destination");
            }
            ids(&mut m);
            prefetched(&mut m, at);
            m
        })
    };
    // Where the head's and block unit u's backward entries are in the schedule.
    let (head_at, backward_at) = (blocks + 1, |u: usize| 2 * blocks + 2 - u);
    let recomputed = |m: &mut Moment| {
        if head == HeadGrad::Recompute {
            m.add(&format!("root as candle Vars ({dt})"), units[0].layout().numel, e, "gathered again, for the head")
                .add(&format!("lm_head part of wte grad ({dt})"), v * c, e, "recomputed, this micro-batch's");
        }
    };
    // Each moment with what lives across micro-batches at entry `at` (at its hand-off: `handing`).
    let mut moments = vec![];
    let mut push = |mut m: Moment, at: usize, handing: bool| {
        (pass.across)(&mut m, at, handing);
        moments.push(m);
    };
    // The forward entries: no graph, only each unit's output kept. Never the
    // busiest moment with one entry gathered ahead; with more (two, --prefetch's
    // default), all but the first of them can be in flight here, so they are
    // counted, with what one block's forward makes as it goes bounded by what
    // its graph would keep.
    let block_forward = block_activations(&s.cfg, (b, t), Probs::Keep); // attention's P is made, if not kept
    for (at, unit) in units.iter().enumerate().take(blocks + 1) {
        for k in 0..mine {
            let name = if at == 0 { "embed" } else { "forward" };
            let mut m = Moment::new(format!("{name} of {}, micro-batch {}", unit.name(), mb(k)));
            m.add(&format!("unit as candle Vars ({dt})"), unit.layout().numel, e, "gathered, freed after use").add(
                &format!("saved unit inputs ({dt})"),
                (at * mine + k) * btc,
                e,
                "(B, T, C) per unit and micro-batch",
            );
            ids(&mut m);
            let (what, len) = match at {
                0 => ("the looked-up rows and their sum", 2 * btc),
                _ => ("a block's forward, as it goes", block_forward),
            };
            m.add(&format!("{what} ({dt})"), len, e, "no graph: at most what its graph would keep");
            prefetched(&mut m, at);
            push(m, at, false);
        }
    }
    for k in 0..mine {
        // The head: my micro-batch k's head forward and backward.
        let mut m = Moment::new(format!("head forward+backward, micro-batch {}", mb(k)));
        m.add(&format!("root as candle Vars ({dt})"), units[0].layout().numel, e, "gathered, freed after use").add(
            &format!("saved unit inputs ({dt})"),
            (blocks * mine + mine - k) * btc,
            e,
            "(B, T, C) per unit and micro-batch",
        );
        carried(&mut m, k);
        m.add(&format!("the head's input as a Var ({dt})"), btc, e, "a copy, so backward reaches it");
        ids(&mut m);
        pass_rows(&mut m, &shapes.head_and_loss((b, t)), "the head's graph");
        prefetched(&mut m, head_at);
        push(m, head_at, false);
        // Each block unit's recompute and backward: its blocks recomputed on
        // tapes, then pulled back through them last first, each block's
        // gradients added onto the micro-batch's slot of the sum at once.
        for u in (1..=blocks).rev() {
            let unit = &units[u];
            let base = |m: &mut Moment, slots: usize, waiting: usize| {
                m.add(&format!("unit as candle Vars ({dt})"), unit.layout().numel, e, "gathered, freed after use").add(
                    &format!("saved unit inputs ({dt})"),
                    u * mine * btc,
                    e,
                    "(B, T, C) per unit and micro-batch",
                );
                carried(m, mine);
                sums(m, unit, slots);
                if waiting > 0 {
                    m.add("block tapes waiting for backward", waiting * tape.activations, 1, "the unit's blocks below");
                }
                ids(m);
                prefetched(m, backward_at(u));
                reducing(m, units.get(u + 1));
            };
            for j in (0..unit.blocks()).rev() {
                let which = match unit.blocks() {
                    1 => String::new(),
                    _ => format!(" (block {j})"),
                };
                // Block j's backward: the slot is taken after the unit's last block's.
                let slots = if j + 1 == unit.blocks() { k } else { k + 1 };
                let mut m = Moment::new(format!("recompute+backward of {}{which}, micro-batch {}", unit.name(), mb(k)));
                base(&mut m, slots, j);
                tape_rows(&mut m, &tape);
                push(m, backward_at(u), false);
                // Its tape gone, its gradients are added onto the slot.
                let mut m = Moment::new(format!("adding {}{which}'s gradients, micro-batch {}", unit.name(), mb(k)));
                base(&mut m, k + 1, j);
                m.add(&format!("the block's gradients ({dt})"), block_numel, e, "added onto the sum, then freed");
                push(m, backward_at(u), false);
            }
            if k + 1 == mine {
                // its own inputs gone
                if let Some(m) = send_moment(unit, backward_at(u), (u - 1) * mine * btc, mine) {
                    push(m, backward_at(u), true);
                }
            }
        }
        // The head recomputed, when it is: the root gathered again.
        if head == HeadGrad::Recompute {
            let mut m = Moment::new(format!("head recompute, micro-batch {}", mb(k)));
            m.add(&format!("root as candle Vars ({dt})"), units[0].layout().numel, e, "gathered again, for the head");
            carried(&mut m, mine);
            sums(&mut m, &units[0], k);
            m.add(&format!("the head's input as a Var ({dt})"), btc, e, "a copy, as in the head entry");
            ids(&mut m);
            pass_rows(&mut m, &shapes.head_and_loss((b, t)), "the head's graph, again");
            reducing(&mut m, units.get(1));
            push(m, plan.len() - 1, false);
        }
        // The embedding's backward: no weights, the tied wte completed.
        let mut m = Moment::new(format!("embedding backward, micro-batch {}", mb(k)));
        carried(&mut m, mine);
        recomputed(&mut m);
        sums(&mut m, &units[0], k);
        ids(&mut m);
        let f = shapes.embedding_backward((b, t));
        embedding_rows(&mut m, &f, v * c * e);
        reducing(&mut m, units.get(1));
        push(m, plan.len() - 1, false);
        let mut m = Moment::new(format!("adding the root's gradient of micro-batch {}", mb(k)));
        carried(&mut m, mine);
        recomputed(&mut m);
        sums(&mut m, &units[0], k + 1);
        m.add(&format!("wte's whole gradient ({dt})"), v * c, e, "lm_head part + the rows, index-added").add(
            &format!("wpe's gradient ({dt})"),
            f.grad_store,
            1,
            "the rows' gradient is a view of the upstream one",
        );
        ids(&mut m);
        reducing(&mut m, units.get(1));
        push(m, plan.len() - 1, false);
        if let Some(m) = send_moment(&units[0], plan.len() - 1, 0, mine).filter(|_| k + 1 == mine) {
            push(m, plan.len() - 1, true);
        }
    }
    moments
}
// ANCHOR_END: step_moments

// ANCHOR: head_grad_choice
/// The default [`HeadGrad`]: recompute the head only if that lowers the
/// step's peak, by the tally above (the root's third gather and the head's
/// second run count against it; a tie keeps). With a 65-character vocabulary
/// on 8 × 64-token micro-batches the lm_head part (65 × C) is the smaller
/// wait and is kept; on 2 × 16 tokens the head's input is, and the head is
/// recomputed. With GPT-2's 50,257 tokens a (V, C) part per micro-batch
/// would be 154 MB in fp32.
pub fn lower_peak(s: &Session, units: &[FsdpUnit], prefetch: usize) -> HeadGrad {
    let peak = |h| tally(s, units, prefetch, h).expected_peak_bytes();
    if peak(HeadGrad::Recompute) < peak(HeadGrad::Keep) { HeadGrad::Recompute } else { HeadGrad::Keep }
}
// ANCHOR_END: head_grad_choice

/// The unsharded peak: the largest unit (× 1 + the most gathered ahead at
/// once under `--prefetch`) against lesson 02's whole model.
pub fn unsharded_peak_table(units: &[FsdpUnit], prefetch: usize, head: HeadGrad) -> Table {
    let numel: usize = units.iter().map(|u| u.layout().numel).sum();
    let largest = units.iter().max_by_key(|u| u.layout().numel).expect("a model has units");
    let plan = schedule(units.len() - 1, head);
    let most = (0..plan.len()).map(|at| gathered_ahead(&plan, at, prefetch).count()).max().unwrap_or(0);
    let held = largest.layout().numel * (1 + most);
    let mut t = Table::new(["peak unsharded params", "elements", "MB"]);
    t.row([
        format!(
            "largest unit ({}){}",
            largest.name(),
            if prefetch > 0 { format!(" × {} (prefetch)", 1 + prefetch) } else { String::new() }
        ),
        fsdp_harness::table::thousands(held as u64),
        mb(4 * held as u64),
    ]);
    t.row(["whole model (lesson 02)".to_string(), fsdp_harness::table::thousands(numel as u64), mb(4 * numel as u64)]);
    t.row(["ratio".to_string(), String::new(), format!("{:.1}× less", numel as f64 / held as f64)]);
    t
}

// ANCHOR: traffic
/// Bytes one rank sends per step, (all-gather, reduce-scatter), given the
/// units' layouts, the root first, the bytes of a gathered element (4 in
/// fp32; lesson 04 gathers its compute dtype) and of a reduced one (4, or 2
/// under `--reduce-dtype bf16`). Each gather sends my shard to N − 1 ranks;
/// every unit is gathered twice (a block for forward and backward, the root
/// for the embedding and the head; a third time for the root when the head
/// is recomputed) and its gradient reduce-scattered once.
pub fn bytes_per_step(units: &[ShardLayout], head: HeadGrad, gather_elem: usize, reduce_elem: usize) -> (u64, u64) {
    let (mut gather, mut scatter) = (0, 0);
    for (i, l) in units.iter().enumerate() {
        let once = ((l.world - 1) * l.shard_len) as u64;
        gather += once * gather_elem as u64 * if i == 0 { head.root_gathers() } else { 2 } as u64;
        scatter += once * reduce_elem as u64;
    }
    (gather, scatter)
}

// ANCHOR_END: traffic

/// The units for report.json: name, elements, my shard's length.
pub fn units_json(units: &[FsdpUnit]) -> serde_json::Value {
    let one =
        |u: &FsdpUnit| serde_json::json!({"name": u.name(), "elements": u.layout.numel, "shard": u.layout.shard_len});
    serde_json::Value::Array(units.iter().map(one).collect())
}

/// The largest unit's padded length: what one unit-sized buffer must hold
/// (the reduce-scatter's receive and send buffers, a prefetched unit).
pub fn largest_padded(units: &[FsdpUnit]) -> usize {
    units.iter().map(|u| u.layout().padded).max().unwrap_or(0)
}

/// The ordered reductions' receive buffers, as `(communicator, category,
/// elements, note)`, kept from the first step on: the reduce-scatter's
/// all-to-all input for the largest unit and, under HSDP, the replica
/// all-reduce's, one shard long. What a tally counts and
/// [`reserve_receive_buffers`] allocates.
pub fn receive_buffers(s: &Session, units: &[FsdpUnit]) -> Vec<(CommOf, &'static str, usize, &'static str)> {
    let (padded, shard) = (largest_padded(units), units.iter().map(|u| u.layout.shard_len).max().unwrap_or(0));
    let Some(s_size) = units[0].comms.replica.map(|_| units[0].comms.shard.size()) else {
        let note = "the reduce-scatter's input from every rank, largest unit, kept";
        return s
            .receive_buffer_len(padded)
            .map(|l| (CommOf::World, "all-to-all receive buffer", l, note))
            .into_iter()
            .collect();
    };
    let (groups, replicas) = (s.sum_groups.per_rank(), s.world.size() / s_size);
    let mut v = vec![];
    if s_size > 1 || groups > 1 {
        let note = "the reduce-scatter's input from my shard group, largest unit, kept";
        v.push((CommOf::Shard, "all-to-all receive buffer", groups * padded, note));
    }
    if replicas > 1 {
        let len = shard.next_multiple_of(replicas); // padded to R equal parts
        let note = "my shard from every replica group, largest unit, kept";
        v.push((CommOf::Replica, "replica all-reduce receive buffer", len, note));
    }
    v
}

/// Allocates the receive buffers now ([`receive_buffers`]), as the tally
/// counts them: on the communication stream's thread when the reductions go
/// there (the units' `on_stream`, set first).
pub fn reserve_receive_buffers(s: &Session, units: &[FsdpUnit]) {
    let (comms, on_stream) = (units[0].comms, units[0].on_stream);
    let Some(replica) = comms.replica else {
        return s.reserve_receive_buffer(largest_padded(units), on_stream);
    };
    let (w, size) = (s.world, comms.shard.size());
    for (over, _, len, _) in receive_buffers(s, units) {
        let parts = match over {
            CommOf::Replica => replica.size(),
            _ => s.sum_groups.per_rank() * size,
        };
        match (on_stream, over) {
            (true, g) => w.reserve_stream_receive_buffer_in(g, len, parts),
            (false, CommOf::Replica) => replica.reserve_receive_buffer(len, parts),
            (false, _) => comms.shard.reserve_receive_buffer(len, parts),
        }
    }
}

// ANCHOR: in_flight_part
/// Under HSDP with the stream, a unit's reduction in flight holds, beyond
/// its sums, the replica all-reduce's part: 1/R of its shard (padded to R
/// parts). The tally's row for it, `(category, elements, note)`.
pub fn in_flight_part(s: &Session, u: &FsdpUnit) -> Option<(String, usize, &'static str)> {
    u.comms.replica.filter(|_| u.on_stream)?;
    let r = s.world.size() / u.comms.shard.size();
    (r > 1).then(|| {
        let part = u.layout.shard_len.div_ceil(r);
        (format!("{}'s replica all-reduce part (fp32)", u.name), part, "1/R of its shard, in flight with it")
    })
}
// ANCHOR_END: in_flight_part
