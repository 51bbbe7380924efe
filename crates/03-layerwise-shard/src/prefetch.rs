//! FSDP2's overlap (`--prefetch`): while an entry of the schedule computes,
//! the all-gathers of the next entries' units run on the communication
//! stream (`--prefetch-depth K` entries ahead, two by default), and each
//! unit's reduce-scatter runs there while the next unit's backward computes.
//! The blocking step of `layerwise_shard.rs` is the idea; this is the same
//! step, with the waits moved to where the data is needed, and which gathers
//! each entry hands over decided once, from the schedule ([`Prefetch`]).
use std::collections::VecDeque;

use candle_core::{DType, Device, Tensor};
use fsdp_comm::{MicroBatchSum, Pending, World};
use fsdp_gpt::precision::bf16_tensor;
use fsdp_harness::{MemoryTimeline, Session};

use crate::head_grad::HeadGrad;
use crate::layerwise_shard::{LayerwiseShard, Phase, StepState, run_phase, schedule, unit_vars};
use crate::units::{FsdpUnit, update_all};

// ANCHOR: gathered_ahead
/// The entries of `plan` whose all-gathers are in flight on the stream
/// while entry `at` computes, `depth` entries ahead (`--prefetch`: 2, or 1
/// where memory does not allow two; `--prefetch-depth K`: K; 0 without prefetch): of the next `depth`
/// entries, those that need weights (the embedding's backward does not).
/// The step hands them over; the tally counts their buffers.
pub fn gathered_ahead(plan: &[Phase], at: usize, depth: usize) -> impl Iterator<Item = usize> + '_ {
    (at + 1..plan.len().min(at + 1 + depth)).filter(|&i| plan[i].needs_weights())
}
// ANCHOR_END: gathered_ahead

/// How far `--prefetch` reaches unless `--prefetch-depth` says: the units
/// of the next two entries, memory allowing ([`prefetch_within_budget`]).
/// One ahead (FSDP2's implicit prefetch) leaves the wire idle wherever an
/// entry's compute outlasts the next gather with nothing else to send: while
/// the last block's forward runs (only the root's small gather is next), and
/// through the first backward entry (no gradient is ready to reduce-scatter
/// yet). A second gather in flight fills those gaps, for one more unit
/// unsharded (FSDP1's `limit_all_gathers` kept two: this unit and the next).
pub const DEFAULT_PREFETCH_DEPTH: usize = 2;

/// `--prefetch` and `--prefetch-depth` as the command line gives them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefetchAsked {
    /// Entries gathered ahead: 0 without `--prefetch`, K with `--prefetch-depth K`, else
    /// [`DEFAULT_PREFETCH_DEPTH`] (which the budget may lower).
    pub depth: usize,
    /// Whether `--prefetch-depth` set it: then it is kept as given.
    pub given: bool,
}

/// The config table's line for the entries gathered ahead: `depth`, the
/// one in use, and what was `asked` for.
pub fn describe_prefetch(depth: usize, asked: PrefetchAsked) -> String {
    let lowered = match depth < asked.depth {
        true => format!(" ({} would take the tally's peak past --mem-budget)", asked.depth),
        false => String::new(),
    };
    match depth {
        0 => "off".into(),
        1 => format!("on: the next unit gathered, the last reduce-scattered on the communication stream{lowered}"),
        k => format!("on: the next {k} entries' units gathered, the last reduce-scattered on the communication stream"),
    }
}

/// The entries gathered ahead for `--prefetch` and `--prefetch-depth K`:
/// none without prefetch, K when given, [`DEFAULT_PREFETCH_DEPTH`] else. K
/// without `--prefetch`, 0, or K past the end of the step's schedule for
/// `block_units` block units (where the first entry already has every other
/// ahead of it) is refused in one line.
pub fn prefetch_depth(prefetch: bool, depth: Option<usize>, block_units: usize) -> anyhow::Result<PrefetchAsked> {
    let most = schedule(block_units, HeadGrad::Keep).len() - 1; // ahead of the first entry
    match (prefetch, depth) {
        (false, None) => Ok(PrefetchAsked { depth: 0, given: false }),
        (false, Some(k)) => anyhow::bail!("--prefetch-depth {k} sets how far --prefetch reaches: add --prefetch"),
        (true, Some(0)) => {
            anyhow::bail!(
                "--prefetch-depth 0: pass 1 or more units ahead ({DEFAULT_PREFETCH_DEPTH} is --prefetch's default), or leave out --prefetch"
            )
        }
        (true, Some(k)) if k > most => anyhow::bail!(
            "--prefetch-depth {k} reaches past the step's schedule: its {} entries (the embedding, {block_units} block units \
             forward and backward, the head, the embedding's backward) leave at most {most} ahead of any: pass 1 to {most}",
            most + 1
        ),
        (true, Some(k)) => Ok(PrefetchAsked { depth: k, given: true }),
        (true, None) => Ok(PrefetchAsked { depth: DEFAULT_PREFETCH_DEPTH, given: false }),
    }
}

// ANCHOR: plan
/// FSDP2's `set_modules_to_forward_prefetch`, computed once from the
/// schedule: at each entry, the entries whose all-gathers are handed to the
/// stream — each entry's once, `depth` entries ahead of it.
pub struct Prefetch {
    /// Entries gathered ahead (at most 1 + `depth` units unsharded).
    pub depth: usize,
    /// `issue[at]`: the entries whose gathers go to the stream at entry `at`.
    issue: Vec<Vec<usize>>,
}

impl Prefetch {
    pub fn new(schedule: &[Phase], depth: usize) -> Self {
        let mut handed = 0; // entries before this one have had their gathers handed over
        let issue = (0..schedule.len())
            .map(|at| {
                let from = handed;
                let now: Vec<usize> = gathered_ahead(schedule, at, depth).filter(|&i| i >= from).collect();
                handed = handed.max(at + 1 + depth);
                now
            })
            .collect();
        Self { depth, issue }
    }
}
// ANCHOR_END: plan

// ANCHOR: overlapped_step
impl LayerwiseShard<'_> {
    /// The step of `layerwise_shard.rs` under `--prefetch`: the next
    /// entries' all-gathers handed to the stream as `plan` says, and each
    /// unit's reduce-scatter handed there too, one unit's at a time.
    pub fn overlapped_step(
        &mut self,
        s: &Session,
        step: u64,
        tl: &mut MemoryTimeline,
        plan: &Prefetch,
    ) -> anyhow::Result<f32> {
        let w = s.world;
        let mut c = StepState::for_step(s, step)?;
        let entries = schedule(self.units.len() - 1, self.head_grad);
        debug_assert_eq!(plan.issue.len(), entries.len(), "a plan for this schedule");
        debug_assert!(self.units.iter().all(FsdpUnit::gathers), "prefetch gathers resharded units");
        // The units of the next entries, being gathered on the stream, in the
        // schedule's order (at most 1 + K units unsharded: this entry's and
        // those of the next K) …
        let mut ahead: VecDeque<(usize, Unsharding)> = VecDeque::with_capacity(plan.depth);
        // … and the last unit whose reduce-scatter went to the stream.
        let mut reducing: Option<usize> = None;
        for (at, &phase) in entries.iter().enumerate() {
            let unit = &self.units[phase.unit()];
            // 1. unshard: the gather issued ahead, or an all-gather now
            let params = match phase.needs_weights() {
                false => vec![],
                true => {
                    let gathered = match ahead.front() {
                        Some((i, _)) if *i == at => ahead.pop_front().expect("the front entry").1.wait(w)?,
                        _ => unit.unshard()?,
                    };
                    unit_vars(s, unit, gathered, tl)?
                }
            };
            // 2. prefetch: hand the next entries' all-gathers to the stream, then compute this one
            for &i in &plan.issue[at] {
                ahead.push_back((i, self.units[entries[i].unit()].unshard_async(w)?));
            }
            let label = || format!("{} {}", phase.label(), unit.name());
            let grad_sum = w.traced(label, || run_phase(s, phase, unit, &params, &mut c))?;
            tl.mark(label());

            // 3. reshard (free the unit); after its backward, hand its
            // reduce-scatter to the stream, one unit's at a time
            drop(params);
            if let Some(mut grads) = grad_sum {
                let u = phase.unit();
                one_in_flight(&mut self.units, &mut reducing, u, w);
                self.units[u].reduce_scatter(w, &mut grads);
                tl.mark(format!("reduce-scatter {}, free it", self.units[u].name()));
            }
        }
        // 4. update: the last reduce-scatters waited for, then AdamW on my shards
        w.traced(|| "AdamW update".into(), || update_all(&mut self.units, s, 1.0 / s.sampler.micro_batches as f32))?;
        tl.mark("AdamW on my shards");
        Ok((w.sum_f64(&[c.loss_sum])[0] / s.sampler.micro_batches as f64) as f32)
    }
}
// ANCHOR_END: overlapped_step

/// A unit's all-gather in flight on the communication stream.
pub enum Unsharding {
    F32(Pending<Vec<f32>>),
    Bf16(Pending<Vec<u16>>),
}

impl Unsharding {
    /// Waits for the gather: the whole unit, as [`FsdpUnit::unshard`] gives it.
    pub fn wait(self, w: &World) -> candle_core::Result<Tensor> {
        match self {
            Unsharding::F32(p) => {
                let full = p.wait(w);
                let n = full.len();
                Tensor::from_vec(full, n, &Device::Cpu)
            }
            Unsharding::Bf16(p) => bf16_tensor(p.wait(w)),
        }
    }
}

impl FsdpUnit<'_> {
    /// The same all-gather, handed to the communication stream: FSDP2's
    /// unshard issued ahead (prefetch). My shard is copied in (rounded to
    /// bf16 under a bf16 `param_dtype`), as FSDP2 copies into its
    /// all-gather input; [`Unsharding::wait`] gives the unit.
    pub fn unshard_async(&self, w: &World) -> candle_core::Result<Unsharding> {
        let n = self.layout.padded;
        let label = || format!("all_gather {}", self.name);
        let g = self.comms.stream; // where the shards are
        match self.mp.param_dtype {
            DType::F32 => {
                Ok(Unsharding::F32(w.all_gather_async_in(g, self.master.clone(), vec![0.0; n]).label(w, label)))
            }
            DType::BF16 => Ok(Unsharding::Bf16(
                w.all_gather_async_in(g, (self.mp.bf16_wire)(&self.master), vec![0; n]).label(w, label),
            )),
            other => Err(candle_core::Error::Msg(format!("param_dtype {other:?}: units gather in F32 or BF16"))),
        }
    }

    /// Waits for the unit's reduce-scatter in flight, if any: afterwards its
    /// gradient shard is here.
    pub fn wait_grad(&mut self, w: &World) {
        if let Some(p) = self.reducing.take() {
            self.grad = p.wait(w); // under HSDP, recorded in the shard and replica groups
        }
    }

    /// **reduce-scatter on the stream**: the unit's gradient sum handed to
    /// the communication stream (FSDP2 reduce-scatters on a stream of its
    /// own) and the call returns at once; [`FsdpUnit::wait_grad`] takes the
    /// shard when it is needed; `grads` is left empty. Under HSDP the
    /// reduce-scatter and the replica all-reduce are one op on the stream.
    pub(crate) fn reduce_scatter_async(&mut self, w: &World, grads: &mut MicroBatchSum) {
        self.wait_grad(w); // a unit has one reduce-scatter in flight at most
        let shard = std::mem::take(&mut self.grad); // its buffer travels with the sums
        let name = &self.name;
        let pending = match self.comms.replica {
            Some(_) => w.hsdp_reduce_async(grads, shard),
            None => w.reduce_scatter_sum_async(grads, shard),
        };
        self.reducing = Some(pending.label(w, || format!("reduce_scatter {name}")));
    }
}

/// The units' reduce-scatters go to the communication stream from now on
/// (`--prefetch`, `--overlap-comm`; the stream is started): set once, before
/// the receive buffers are reserved and the tally counts what is in flight.
pub fn reduce_on_stream(units: &mut [FsdpUnit]) {
    units.iter_mut().for_each(|u| u.on_stream = true);
}

/// Unit `u`'s reduce-scatter is next: the one in flight before it
/// (`reducing`, the unit it was) is waited for first, so that one is in
/// flight at a time — what the tally's one "reducing" row counts. Without
/// overlap nothing is ever in flight and this only notes `u`.
pub fn one_in_flight(units: &mut [FsdpUnit], reducing: &mut Option<usize>, u: usize, w: &World) {
    if let Some(previous) = reducing.replace(u).filter(|&p| p != u) {
        units[previous].wait_grad(w);
    }
}

/// How far `--prefetch` reaches, and the [`HeadGrad`] at that reach
/// (`head`: `--head-grad`, else [`crate::tally::lower_peak`]'s). A depth given with
/// `--prefetch-depth` is kept; the default, two entries ahead, is lowered to
/// one where the tally's peak with two would pass `--mem-budget` — memory
/// allowing, as FSDP1's `limit_all_gathers` and DeepSpeed's
/// `stage3_max_live_parameters` bound the units in flight. (If one does not
/// fit either, the run stops at the budget as any run does.)
pub fn prefetch_within_budget(
    s: &Session,
    units: &[FsdpUnit],
    asked: PrefetchAsked,
    head: Option<HeadGrad>,
) -> (usize, HeadGrad) {
    let at = |depth| (depth, head.unwrap_or_else(|| crate::tally::lower_peak(s, units, depth)));
    let wanted = at(asked.depth);
    let over = |(depth, head)| {
        s.args.mem_budget.is_some_and(|b| crate::tally::tally(s, units, depth, head).expected_peak_bytes() > b)
    };
    if !asked.given && asked.depth > 1 && over(wanted) { at(1) } else { wanted }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What is in flight while an entry computes: the next K entries that
    /// need weights — across the forward, the head and the backward alike,
    /// never the embedding's backward, which needs none (unless it recomputes the head).
    #[test]
    fn the_gathers_in_flight_are_the_next_k_entries_that_need_weights() {
        // E F1 F2 F3 F4 H B4 B3 B2 B1 EB: entries 0 to 10
        let plan = schedule(4, HeadGrad::Keep);
        let ahead = |at, k| gathered_ahead(&plan, at, k).collect::<Vec<_>>();
        assert_eq!(ahead(0, 0), Vec::<usize>::new(), "no prefetch");
        assert_eq!(ahead(0, 1), [1]);
        assert_eq!(ahead(4, 1), [5], "the last forward: the head's root");
        assert_eq!(ahead(4, 2), [5, 6], "… and the last block again, for its backward");
        assert_eq!(ahead(8, 2), [9], "B2: B1, not the embedding's backward");
        assert_eq!(ahead(9, 1), Vec::<usize>::new());
        assert_eq!(ahead(7, 9), [8, 9], "never past the schedule");
        let recompute = schedule(4, HeadGrad::Recompute);
        assert_eq!(gathered_ahead(&recompute, 9, 1).collect::<Vec<_>>(), [10], "the head recomputed needs the root");
    }

    #[test]
    fn the_prefetch_depth_needs_prefetch_and_reaches_within_the_schedule() {
        let depth = |p, d| prefetch_depth(p, d, 4).map(|p| (p.depth, p.given)).unwrap();
        assert_eq!(depth(false, None), (0, false));
        assert_eq!(depth(true, None), (DEFAULT_PREFETCH_DEPTH, false), "the default, which the budget may lower");
        assert_eq!(depth(true, Some(1)), (1, true));
        assert_eq!(depth(true, Some(2)), (2, true));
        assert!(prefetch_depth(false, Some(2), 4).unwrap_err().to_string().contains("add --prefetch"));
        assert!(prefetch_depth(true, Some(0), 4).unwrap_err().to_string().contains("pass 1 or more"));
        // 4 block units: E F1 F2 F3 F4 H B4 B3 B2 B1 EB, so 10 entries lie ahead of the first.
        assert_eq!(depth(true, Some(10)), (10, true));
        let past = prefetch_depth(true, Some(11), 4).unwrap_err().to_string();
        assert!(
            past.contains("--prefetch-depth 11") && past.contains("its 11 entries") && past.contains("pass 1 to 10"),
            "{past}"
        );
    }

    /// The plan issues exactly the gathers the step used to decide entry by
    /// entry: each entry's once, as soon as it is `depth` ahead.
    #[test]
    fn the_plan_issues_what_the_step_decided_entry_by_entry() {
        for head in [HeadGrad::Keep, HeadGrad::Recompute] {
            for blocks in [1, 2, 4] {
                let plan = schedule(blocks, head);
                for depth in 0..=plan.len() {
                    let mut handed = 0;
                    let mut old = vec![];
                    for at in 0..plan.len() {
                        old.push(gathered_ahead(&plan, at, depth).filter(|&i| i >= handed).collect::<Vec<_>>());
                        handed = handed.max(at + 1 + depth);
                    }
                    assert_eq!(Prefetch::new(&plan, depth).issue, old, "{head:?}, {blocks} blocks, depth {depth}");
                }
            }
        }
        // E F1 F2 F3 F4 H B4 B3 B2 B1 EB at depth 2: two gathers at the first entry, one at each after,
        // none for the embedding's backward (no weights).
        let p = Prefetch::new(&schedule(4, HeadGrad::Keep), 2);
        assert_eq!(p.issue[0], [1, 2]);
        assert_eq!(p.issue[1], [3]);
        assert_eq!(p.issue[7], [9]);
        assert!(p.issue[8].is_empty() && p.issue[10].is_empty());
    }
}
