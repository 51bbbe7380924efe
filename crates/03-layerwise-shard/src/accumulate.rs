//! Gradient accumulation, four ways (`--accumulate MODE`): how my
//! micro-batches go through the units, and what happens to each unit's
//! gradient and parameters between them. The blocking step of
//! `layerwise_shard.rs` walks all of them through each unit together
//! (`unit-major`); the others run micro-batch after micro-batch, each a
//! whole forward and backward of its own, as FSDP2 and DeepSpeed users
//! run them — the same entries ([`run_phase`]), on one micro-batch at a
//! time, and lesson 01's bits in every mode: each micro-batch's gradient
//! of a unit is the leaf the unit-major step adds to its sum, and every
//! mode adds the leaves in the one pairwise tree.
use anyhow::anyhow;
use candle_core::Var;
use fsdp_comm::{MicroBatchSum, ShardLayout, World};
use fsdp_harness::{MemoryTally, MemoryTimeline, Moment, Session, exercise};

use crate::head_grad::HeadGrad;
use crate::layerwise_shard::{LayerwiseShard, Phase, StepState, run_phase, schedule, unit_vars};
use crate::tally::{Pass, kept, step_moments};
use crate::units::{FsdpUnit, update_all};

// ANCHOR: modes
/// What happens between my micro-batches (`--accumulate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Accumulate {
    /// All my micro-batches through each unit together: one gather pair and
    /// one reduce-scatter per unit per step; the saved inputs grow with M/N.
    #[default]
    UnitMajor,
    /// Micro-batch after micro-batch, each unit's gradient reduce-scattered
    /// after every backward (FSDP2's default, DeepSpeed's at ZeRO-2 and 3):
    /// M/N × the reduce-scatters. To keep the one tree, each micro-batch's
    /// shards travel unsummed and are added once all have arrived.
    ReduceEvery,
    /// Micro-batch after micro-batch, each unit's unsharded fp32 gradient
    /// summed across them, reduce-scattered once after the last (FSDP2's
    /// `set_requires_gradient_sync(False)` until the last micro-batch).
    NoSync,
    /// `no-sync`, and every unit kept unsharded from its first gather to its
    /// last use: one all-gather per unit per step (FSDP2's
    /// `reshard_after_forward=False` and `set_reshard_after_backward(False)`).
    KeepUnsharded,
}
// ANCHOR_END: modes

impl Accumulate {
    pub const ALL: [Accumulate; 4] =
        [Accumulate::UnitMajor, Accumulate::ReduceEvery, Accumulate::NoSync, Accumulate::KeepUnsharded];

    /// The flag's word for it.
    pub fn name(self) -> &'static str {
        match self {
            Accumulate::UnitMajor => "unit-major",
            Accumulate::ReduceEvery => "reduce-every",
            Accumulate::NoSync => "no-sync",
            Accumulate::KeepUnsharded => "keep-unsharded",
        }
    }

    /// The config table's line: only for a mode other than the default,
    /// whose reports stay as they were.
    pub fn config_row(self) -> Option<(&'static str, String)> {
        let what = match self {
            Accumulate::UnitMajor => return None,
            Accumulate::ReduceEvery => {
                "each micro-batch's unit gradients reduce-scattered (FSDP2's default), the shards summed at the end"
            }
            Accumulate::NoSync => {
                "unsharded sums across micro-batches, reduce-scattered after the last (set_requires_gradient_sync(False))"
            }
            Accumulate::KeepUnsharded => {
                "no-sync, every unit kept gathered until its last use (reshard_after_forward=False, set_reshard_after_backward(False))"
            }
        };
        Some(("gradient accumulation", format!("{}: {what}", self.name())))
    }

    /// Why this mode cannot run with the other flags, in one line (None: it can).
    pub fn refusal(self, prefetch: bool, hsdp: bool, check: bool, head: Option<HeadGrad>) -> Option<anyhow::Error> {
        let mode = self.name();
        Some(match self {
            Accumulate::UnitMajor => return None,
            _ if prefetch => anyhow!(
                "--accumulate {mode} runs the blocking step: its plan of gathers ahead is unit-major's schedule; leave out --prefetch, or --accumulate"
            ),
            _ if hsdp => anyhow!(
                "--accumulate {mode} reduce-scatters over the world only (not HSDP's shard and replica groups); leave out --hsdp, or --accumulate"
            ),
            _ if check => anyhow!(
                "--accumulate {mode}: --check runs lesson 02 beside unit-major's step only; leave out --check (every mode keeps lesson 01's bits)"
            ),
            _ if head == Some(HeadGrad::Recompute) => anyhow!(
                "--accumulate {mode} holds one micro-batch's lm_head gradient at a time, so there is nothing to save by recomputing the head; leave out --head-grad recompute"
            ),
            _ => return None,
        })
    }

    /// Whether micro-batches go one after another (every mode but the default).
    pub fn micro_batch_major(self) -> bool {
        self != Accumulate::UnitMajor
    }

    /// The [`HeadGrad`] a mode runs with: unit-major's choice, or (one
    /// micro-batch's lm_head part waiting at a time) keep.
    pub fn head_grad(self, asked: Option<HeadGrad>) -> Option<HeadGrad> {
        if self.micro_batch_major() { Some(HeadGrad::Keep) } else { asked }
    }

    /// This rank's bytes in this mode, from shapes: unit-major's tally (with
    /// `prefetch` entries gathered ahead), or [`accumulate_tally`].
    pub fn tally(self, s: &Session, units: &[FsdpUnit], prefetch: usize, head: HeadGrad) -> MemoryTally {
        match self.micro_batch_major() {
            true => accumulate_tally(s, units, self),
            false => crate::tally::tally(s, units, prefetch, head),
        }
    }
}

impl std::str::FromStr for Accumulate {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Accumulate::ALL.into_iter().find(|m| m.name() == s).ok_or_else(|| {
            let names: Vec<&str> = Accumulate::ALL.iter().map(|m| m.name()).collect();
            let oracle =
                if s.parse::<u32>().is_ok() { " (lesson 01's --accumulate N takes a number of ranks)" } else { "" };
            format!("unknown --accumulate {s:?}: pass one of {}{oracle}", names.join(", "))
        })
    }
}

// ANCHOR: accumulating_step
impl LayerwiseShard<'_> {
    /// One training step micro-batch after micro-batch (`mode` other than
    /// unit-major): each of my micro-batches walks the whole schedule, and
    /// each unit's gradient of it is handed on as `mode` says. Returns the
    /// mean loss over the global batch.
    pub fn accumulating_step(
        &mut self,
        s: &Session,
        step: u64,
        tl: &mut MemoryTimeline,
        mode: Accumulate,
    ) -> anyhow::Result<f32> {
        let w = s.world;
        let plan = schedule(self.units.len() - 1, self.head_grad);
        let last_uses: Vec<usize> = (0..self.units.len()).map(|u| last_use(&plan, u)).collect();
        // Each unit's gradient over my micro-batches so far (reduce-every: the shards received).
        let mut held: Vec<Option<MicroBatchSum>> =
            self.units.iter().map(|u| Some(s.grad_sum(u.layout().padded))).collect();
        // keep-unsharded: each unit's parameters, from its first gather to its last use.
        let mut kept: Vec<Option<Vec<Var>>> = self.units.iter().map(|_| None).collect();
        let (mut loss_sum, last) = (0.0, s.my_micro_batches().end - 1);
        for k in s.my_micro_batches() {
            let mut c = StepState::for_micro_batch(s, step, k)?;
            for (at, &phase) in plan.iter().enumerate() {
                let u = phase.unit();
                let unit = &self.units[u];
                // 1. unshard: the kept parameters, or an all-gather
                let params = match (phase.needs_weights(), kept[u].take()) {
                    (false, still) => {
                        kept[u] = still;
                        vec![]
                    }
                    (true, Some(p)) => p,
                    (true, None) => unit_vars(s, unit, unit.unshard()?, tl)?,
                };
                // 2. compute this entry, on my micro-batch k alone
                let label = || format!("{} {}, micro-batch {k}", phase.label(), unit.name());
                let one = w.traced(label, || run_phase(s, phase, unit, &params, &mut c))?;
                tl.mark(label());
                // 3. reshard (free the unit), unless it is kept until its last use
                let keep = mode == Accumulate::KeepUnsharded && !(k == last && at == last_uses[u]);
                match keep && phase.needs_weights() {
                    true => kept[u] = Some(params),
                    false => drop(params),
                }
                // 4. hand this micro-batch's gradient of the unit on
                if let Some(mut one) = one {
                    let unit = &mut self.units[u];
                    unit.hand_on(w, &mut held[u], one.take_leaf(), mode, k == last);
                    tl.mark(format!("hand on {}'s gradient, micro-batch {k}", unit.name()));
                }
            }
            loss_sum += c.loss_sum;
        }
        // No-sync's promise: after my last micro-batch no unit's unsharded gradient is left.
        anyhow::ensure!(
            held.iter().all(Option::is_none),
            "exercise 3.3: a unit's gradient sum is still held after my last micro-batch: the hand-off must reduce-scatter it, then free it (set it to None)"
        );
        debug_assert!(kept.iter().all(Option::is_none), "every kept unit freed after its last use");
        // 5. update: AdamW on my shard of every unit, with the mean gradient
        w.traced(|| "AdamW update".into(), || update_all(&mut self.units, s, 1.0 / s.sampler.micro_batches as f32))?;
        tl.mark("AdamW on my shards");
        Ok((w.sum_f64(&[loss_sum])[0] / s.sampler.micro_batches as f64) as f32)
    }
}

impl FsdpUnit<'_> {
    /// My micro-batch's gradient of the unit (`leaf`: whole, padded) handed
    /// on: sent at once as every rank's shard (reduce-every) or added to the
    /// unit's unsharded sum (no-sync, keep-unsharded). After my last
    /// micro-batch my shard of the sum over all ranks is in `grad`, and the
    /// held sum is freed.
    fn hand_on(&mut self, w: &World, held: &mut Option<MicroBatchSum>, leaf: Vec<f32>, mode: Accumulate, last: bool) {
        if mode != Accumulate::ReduceEvery {
            // Into the unit's unsharded sum; after my last micro-batch, reduce-scattered and freed (exercise 3.3).
            return exercise!(3, 3, no_sync_hand_off(w, self, held, leaf, last));
        }
        // The reduce-scatter's all-to-all now; its sum once every micro-batch has arrived.
        let sum = held.as_mut().expect("a unit's sum lives until my last micro-batch");
        let (mut leaf, mut received) = (leaf, vec![0.0; self.layout.padded]);
        self.comms.shard.reduce_scatter_deferred(&mut leaf, sum.dtype(), &mut received);
        drop(leaf);
        sum.push(received); // [source rank][my shard], each source's in its own tree
        if last {
            self.comms.shard.finish_deferred(sum, &mut self.grad);
            *held = None; // freed as soon as it is reduced
        }
    }
}
// ANCHOR_END: accumulating_step

/// The last entry of `plan` that uses unit `u`'s parameters.
fn last_use(plan: &[Phase], u: usize) -> usize {
    plan.iter().rposition(|p| p.unit() == u && p.needs_weights()).expect("every unit is used")
}

/// The first entry of `plan` that uses unit `u`'s parameters.
fn first_use(plan: &[Phase], u: usize) -> usize {
    plan.iter().position(|p| p.unit() == u && p.needs_weights()).expect("every unit is used")
}

/// The entry of `plan` after which unit `u`'s gradient of a micro-batch is complete.
fn handed_at(plan: &[Phase], u: usize) -> usize {
    plan.iter().rposition(|p| p.unit() == u).expect("every unit has a backward")
}

// ANCHOR: accumulate_traffic
/// Collectives one rank runs per step, (all-gathers, reduce-scatters), for
/// `units` units and `mine` micro-batches of mine (`head`: unit-major's
/// [`HeadGrad`]; the other modes keep the lm_head part).
pub fn calls_per_step(mode: Accumulate, units: usize, mine: usize, head: HeadGrad) -> (usize, usize) {
    let gathers = 2 * units; // a block's forward and backward, the root's embedding and head
    match mode {
        Accumulate::UnitMajor => (gathers + head.root_gathers() - 2, units),
        Accumulate::ReduceEvery => (mine * gathers, mine * units),
        Accumulate::NoSync => (mine * gathers, units),
        Accumulate::KeepUnsharded => (units, units),
    }
}

/// Bytes one rank sends per step, (all-gather, reduce-scatter), in `mode`,
/// given the units' layouts (root first), `mine` micro-batches of mine,
/// `groups` sums per rank (`--sum-groups` G / N) and the bytes of a gathered
/// and of a reduced element. Each all-gather or reduce-scatter of a unit
/// sends my shard to N − 1 ranks (reduce-every: one micro-batch's; the
/// others: one per group of mine).
pub fn bytes_per_step(
    mode: Accumulate,
    units: &[ShardLayout],
    head: HeadGrad,
    mine: usize,
    groups: usize,
    (gather_elem, reduce_elem): (usize, usize),
) -> (u64, u64) {
    let (gather, scatter) = crate::tally::bytes_per_step(units, head, gather_elem, reduce_elem);
    let once: u64 = units.iter().map(|l| ((l.world - 1) * l.shard_len * gather_elem) as u64).sum();
    let mine = mine as u64;
    match mode {
        Accumulate::UnitMajor => (gather, scatter * groups as u64),
        Accumulate::ReduceEvery => (mine * gather, mine * scatter),
        Accumulate::NoSync => (mine * gather, scatter * groups as u64),
        Accumulate::KeepUnsharded => (once, scatter * groups as u64),
    }
}
// ANCHOR_END: accumulate_traffic

// ANCHOR: accumulate_tally
/// This rank's bytes in `mode` (micro-batch after micro-batch), from
/// shapes: what it keeps, and the busiest moment of any micro-batch's walk
/// through the schedule ([`step_moments`] for one micro-batch), with what
/// lives across micro-batches — every unit's held sum (its buffers as
/// [`fsdp_comm::SumGroups::held_after`] says; reduce-every's are the shards
/// received, one unit long each all the same), keep-unsharded's parameters,
/// and at a hand-off the vectors it sends and receives.
pub fn accumulate_tally(s: &Session, units: &[FsdpUnit], mode: Accumulate) -> MemoryTally {
    let mut t = kept(s, units);
    let head = HeadGrad::Keep;
    let plan = schedule(units.len() - 1, head);
    let e = units[0].param_bytes();
    let dt = if e == 2 { "bf16" } else { "fp32" };
    let mine = s.my_micro_batches().len();
    let groups = s.sum_groups.per_rank();
    let mut moments = vec![];
    for k in 0..mine {
        let last = k + 1 == mine;
        // After my last micro-batch no-sync's and keep-unsharded's sums are packed to be sent, the gradient added first.
        let packs = last && groups > 1 && mode != Accumulate::ReduceEvery;
        let across = |m: &mut Moment, at: usize, handing: bool| {
            let now = plan[at].unit();
            let held: usize = (0..units.len())
                .map(|x| {
                    let buffers = match (at > handed_at(&plan, x), last) {
                        (true, true) => 0,                                                   // reduced and freed
                        _ if packs && handing && x == now => s.sum_groups.held_after(k + 1), // my gradient merged in
                        (true, false) => s.sum_groups.held_after(k + 1),
                        (false, _) => s.sum_groups.held_after(k),
                    };
                    buffers * units[x].layout().padded
                })
                .sum();
            let note = match mode {
                Accumulate::ReduceEvery => "every rank's shard of mine, per unit, over my micro-batches so far",
                _ => "every unit's unsharded gradient over my micro-batches so far",
            };
            m.add("held grad sums (fp32)", held, 4, note);
            if handing && mode == Accumulate::ReduceEvery {
                m.add("received shards (fp32)", units[now].layout().padded, 4, "every rank's shard of mine, arriving");
            }
            if handing && packs {
                m.add("send buffer", groups * units[now].layout().padded, 4, "its group sums packed per destination");
            }
            if mode == Accumulate::KeepUnsharded {
                let alive = |x: usize| {
                    let gathered = k > 0 || at >= first_use(&plan, x);
                    let freed = last && (at > last_use(&plan, x) || (handing && at == last_use(&plan, x)));
                    let counted = !handing && x == now && plan[at].needs_weights(); // the entry's own row
                    gathered && !freed && !counted
                };
                let numel: usize = (0..units.len()).filter(|&x| alive(x)).map(|x| units[x].layout().numel).sum();
                m.add(&format!("units kept unsharded ({dt})"), numel, e, "as candle Vars, until their last use");
            }
        };
        let pass = Pass { mine: 1, first: k, handed_on: true, merged_first: packs, across: &across };
        moments.extend(step_moments(s, units, 0, head, &pass));
    }
    t.peak(moments);
    t
}
// ANCHOR_END: accumulate_tally

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_modes_parse_by_name_and_only_others_than_the_default_print_a_line() {
        for m in Accumulate::ALL {
            assert_eq!(m.name().parse::<Accumulate>(), Ok(m));
            assert_eq!(m.config_row().is_none(), m == Accumulate::UnitMajor);
        }
        assert!("no_sync".parse::<Accumulate>().unwrap_err().contains("pass one of unit-major, reduce-every"));
        assert_eq!(Accumulate::default(), Accumulate::UnitMajor);
    }

    #[test]
    fn the_calls_per_step_follow_the_schedule() {
        // 5 units (the root and 4 blocks), 2 micro-batches of mine, the head's gradient kept.
        assert_eq!(calls_per_step(Accumulate::UnitMajor, 5, 2, HeadGrad::Keep), (10, 5));
        assert_eq!(calls_per_step(Accumulate::UnitMajor, 5, 2, HeadGrad::Recompute), (11, 5));
        assert_eq!(calls_per_step(Accumulate::ReduceEvery, 5, 2, HeadGrad::Keep), (20, 10));
        assert_eq!(calls_per_step(Accumulate::NoSync, 5, 2, HeadGrad::Keep), (20, 5));
        assert_eq!(calls_per_step(Accumulate::KeepUnsharded, 5, 2, HeadGrad::Keep), (5, 5));
    }

    #[test]
    fn a_unit_is_used_handed_on_and_freed_where_the_schedule_says() {
        // E F1 F2 H B2 B1 EB
        let plan = schedule(2, HeadGrad::Keep);
        assert_eq!((first_use(&plan, 0), last_use(&plan, 0), handed_at(&plan, 0)), (0, 3, 6));
        assert_eq!((first_use(&plan, 2), last_use(&plan, 2), handed_at(&plan, 2)), (2, 4, 4));
        assert_eq!((first_use(&plan, 1), last_use(&plan, 1), handed_at(&plan, 1)), (1, 5, 5));
    }
}
