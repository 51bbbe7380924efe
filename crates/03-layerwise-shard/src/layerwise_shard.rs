//! # Lesson 03 — layer-wise shard: real FSDP
//!
//! Lesson 02 gathered the whole model and held it for the whole step. Here
//! the model is cut into **units** (see [`crate::units`]): the root
//! (embeddings, final norm, tied head) and the transformer blocks, each
//! flattened and sharded on its own. A step walks a schedule of units:
//!
//! ```text
//! forward    root·embed → h.0 → h.1 → … → h.L−1 → root·head (loss, and its backward)
//! backward   h.L−1 → … → h.1 → h.0 → root·embed-backward (no weights, unless the head is recomputed)
//! ```
//!
//! At every entry: **all-gather** the unit, compute, **free** it; so every
//! unit is gathered twice per step. A forward
//! entry keeps only the unit's *input* activations. A backward entry
//! re-gathers the weights, **recomputes** the unit's forward from the saved
//! input, backpropagates the upstream gradient through it and
//! **reduce-scatters** the unit's gradient, so each rank keeps 1/N of it.
//! Only one unit is ever unsharded (1 + K with `--prefetch`, which gathers
//! the next K entries' units ahead — two, or `--prefetch-depth K` — in the
//! overlapped step beside this one, `prefetch.rs`).
//!
//! The tied `wte` gets its lm_head part at the head and its embedding part
//! at the very end, so the weights stay lesson 01's, bit for bit; what a
//! rank holds in between is [`HeadGrad`] (`head_grad.rs`).
use anyhow::Context;
use candle_core::{Tensor, Var};
use fsdp_comm::MicroBatchSum;
use fsdp_gpt::Batch;
use fsdp_gpt::model::{add_into, loss as cross_entropy};
use fsdp_gpt::params::PARAMS_PER_BLOCK;
use fsdp_harness::{MemoryTimeline, Session, exercise};

use crate::head_grad::HeadGrad;
use crate::units::{FsdpUnit, update_all};

/// One entry of the schedule: what is done with which unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Root: token + position embedding of my micro-batches.
    Embed,
    /// Block unit `u` (1-based): forward, keeping only its input.
    Forward(usize),
    /// Root: final norm, lm_head, loss — and their backward, at once;
    /// then it keeps what [`HeadGrad`] says for the tied weight.
    Head(HeadGrad),
    /// Block unit `u`: recompute from the saved input, backpropagate, reduce-scatter.
    Backward(usize),
    /// Root: the embedding's backward; completes the tied `wte` gradient,
    /// then the root's gradient is reduce-scattered. It needs no weights,
    /// unless the head is recomputed here ([`HeadGrad::Recompute`]).
    EmbedBackward(HeadGrad),
}

impl Phase {
    /// Which unit the phase gathers.
    pub fn unit(self) -> usize {
        match self {
            Phase::Embed | Phase::Head(_) | Phase::EmbedBackward(_) => 0,
            Phase::Forward(u) | Phase::Backward(u) => u,
        }
    }

    /// The embedding's backward alone is the one entry that needs no weights.
    pub fn needs_weights(self) -> bool {
        self != Phase::EmbedBackward(HeadGrad::Keep)
    }

    pub fn label(self) -> &'static str {
        match self {
            Phase::Embed => "embed",
            Phase::Forward(_) => "forward",
            Phase::Head(_) => "head forward+backward",
            Phase::Backward(_) => "recompute+backward",
            Phase::EmbedBackward(HeadGrad::Keep) => "embedding backward",
            Phase::EmbedBackward(HeadGrad::Recompute) => "head recompute+embedding backward",
        }
    }
}

/// The step's schedule for `block_units` block units.
pub fn schedule(block_units: usize, head: HeadGrad) -> Vec<Phase> {
    let mut s = vec![Phase::Embed];
    s.extend((1..=block_units).map(Phase::Forward));
    s.push(Phase::Head(head));
    s.extend((1..=block_units).rev().map(Phase::Backward));
    s.push(Phase::EmbedBackward(head));
    s
}

/// What travels between the schedule's entries, per micro-batch of mine.
#[derive(Default)]
pub(crate) struct StepState {
    batches: Vec<Batch>,
    /// Saved unit inputs: `inputs[u − 1][k]` is block unit u's input (B, T, C);
    /// the last entry is the head's. Popped as backward consumes them.
    inputs: Vec<Vec<Tensor>>,
    /// The upstream gradient dL/dx at the current unit boundary, (B, T, C).
    upstream: Vec<Tensor>,
    /// The lm_head's part of the tied `wte` gradient, held until the
    /// embedding's part arrives ([`HeadGrad::Keep`]) …
    head_wte: Vec<Tensor>,
    /// … or the head's input, to recompute it then ([`HeadGrad::Recompute`]).
    head_inputs: Vec<Tensor>,
    /// The final LayerNorm's gradient (weight, bias), likewise: the root's
    /// gradient is summed over micro-batches once all its parts exist.
    head_lnf: Vec<[Tensor; 2]>,
    pub(crate) loss_sum: f64,
}

impl StepState {
    /// Step `step`'s state before its first entry: my micro-batches, nothing carried yet.
    pub(crate) fn for_step(s: &Session, step: u64) -> anyhow::Result<Self> {
        let batches = s.my_micro_batches().map(|k| s.sampler.micro_batch(step, k)).collect::<Result<_, _>>()?;
        Ok(Self { batches, ..Self::default() })
    }

    /// … or micro-batch `k`'s alone (micro-batch after micro-batch: `accumulate.rs`).
    pub(crate) fn for_micro_batch(s: &Session, step: u64, k: usize) -> anyhow::Result<Self> {
        Ok(Self { batches: vec![s.sampler.micro_batch(step, k)?], ..Self::default() })
    }
}

/// One rank's share of the training state: every unit, sharded.
pub struct LayerwiseShard<'w> {
    pub units: Vec<FsdpUnit<'w>>,
    /// What waits for the tied `wte`'s embedding part.
    pub head_grad: HeadGrad,
}

impl LayerwiseShard<'_> {
    // ANCHOR: step
    /// One training step; returns the mean loss over the global batch.
    pub fn step(&mut self, s: &Session, step: u64, tl: &mut MemoryTimeline) -> anyhow::Result<f32> {
        let w = s.world;
        let mut c = StepState::for_step(s, step)?;
        for &phase in &schedule(self.units.len() - 1, self.head_grad) {
            let unit = &self.units[phase.unit()];
            // 1. unshard: all-gather the unit (the embedding's backward needs no weights)
            let params = match phase.needs_weights() {
                false => vec![],
                true => unit_vars(s, unit, unit.unshard()?, tl)?,
            };
            // 2. compute this entry
            let label = || format!("{} {}", phase.label(), unit.name());
            let grad_sum = w.traced(label, || run_phase(s, phase, unit, &params, &mut c))?;
            tl.mark(label());

            // 3. reshard (free the unit); after its backward, reduce-scatter its gradient
            drop(params);
            if let Some(mut grads) = grad_sum {
                let u = phase.unit();
                self.units[u].reduce_scatter(w, &mut grads);
                tl.mark(format!("reduce-scatter {}, free it", self.units[u].name()));
            }
        }
        // 4. update: AdamW on my shard of every unit, with the mean gradient
        // (clipped by its global norm under --grad-clip)
        w.traced(|| "AdamW update".into(), || update_all(&mut self.units, s, 1.0 / s.sampler.micro_batches as f32))?;
        tl.mark("AdamW on my shards");
        Ok((w.sum_f64(&[c.loss_sum])[0] / s.sampler.micro_batches as f64) as f32)
    }
    // ANCHOR_END: step
}

/// The unit's gathered weights as candle Vars in its flat order (the
/// gathered tensor freed), marked on the memory timeline.
pub(crate) fn unit_vars(
    s: &Session,
    unit: &FsdpUnit,
    gathered: Tensor,
    tl: &mut MemoryTimeline,
) -> anyhow::Result<Vec<Var>> {
    let params = s.model.vars_from_tensor(&s.table, unit.params(), &gathered)?;
    drop(gathered);
    tl.mark(format!("{} {}", if unit.gathers() { "gather" } else { "use unsharded" }, unit.name()));
    Ok(params)
}

// ANCHOR: phases
/// One schedule entry's compute, on the gathered `p` (the unit's parameters
/// in its flat order). Returns the unit's gradient sums when they are complete.
pub(crate) fn run_phase(
    s: &Session,
    phase: Phase,
    unit: &FsdpUnit,
    p: &[Var],
    c: &mut StepState,
) -> anyhow::Result<Option<MicroBatchSum>> {
    let detached: Vec<Tensor> = p.iter().map(|v| v.as_detached_tensor()).collect(); // forward: no graph
    let tracked: Vec<Tensor> = p.iter().map(|v| v.as_tensor().clone()).collect(); // backward: a graph to the Vars
    let m = &s.model;
    match phase {
        Phase::Embed => {
            let x =
                c.batches.iter().map(|b| m.embed(&detached[0], &detached[1], &b.inputs)).collect::<Result<_, _>>()?;
            c.inputs.push(x); // (B, T, C) per micro-batch: block unit 1's input
            Ok(None)
        }
        Phase::Forward(u) => {
            let x = &c.inputs[u - 1];
            let y = x.iter().map(|x| run_blocks(s, unit, &detached, x)).collect::<anyhow::Result<_>>()?;
            c.inputs.push(y); // the next unit's input (the head's, after the last)
            Ok(None)
        }
        Phase::Head(head_grad) => {
            let (lnf, wte) = (&tracked[2..4], &tracked[0]);
            for (x, b) in c.inputs.pop().context("head input")?.into_iter().zip(&c.batches) {
                let (loss, grads, xv) = head_backward(s, lnf, wte, &x, b)?;
                c.loss_sum += loss as f64;
                let lnf_grad = |v: &Var| grads.get(v).map(Tensor::detach).context("ln_f grad");
                c.head_lnf.push([lnf_grad(&p[2])?, lnf_grad(&p[3])?]);
                match head_grad {
                    HeadGrad::Keep => c.head_wte.push(grads.get(&p[0]).context("wte grad")?.detach()),
                    HeadGrad::Recompute => c.head_inputs.push(x), // the lm_head part is dropped here
                }
                c.upstream.push(grads.get(&xv).context("head input grad")?.detach());
            }
            Ok(None)
        }
        Phase::Backward(_) => {
            // Recompute from the saved input, pull the upstream gradient back
            // through the unit, sum its gradients (exercise 3.1).
            let inputs = c.inputs.pop().context("unit input")?;
            let sum = exercise!(3, 1, backward_entry(s, unit, p, &inputs, &mut c.upstream))?;
            Ok(Some(sum))
        }
        Phase::EmbedBackward(head_grad) => {
            // The embedding's backward needs only the token ids and the
            // upstream gradient — no weights; they were gathered only if the
            // head is recomputed here.
            let mut sum = s.grad_sum(unit.layout().padded);
            let r = unit.ranges(); // wte, wpe, ln_f.weight, ln_f.bias
            for (k, ((b, g), lnf)) in c.batches.iter().zip(&c.upstream).zip(&c.head_lnf).enumerate() {
                let head = match head_grad {
                    HeadGrad::Keep => c.head_wte[k].clone(),
                    HeadGrad::Recompute => {
                        // The head again, on the same input: the same bits as the first time.
                        let (_, grads, _) = head_backward(s, &tracked[2..4], &tracked[0], &c.head_inputs[k], b)?;
                        grads.get(&p[0]).context("wte grad")?.detach()
                    }
                };
                let (rows, wpe) = m.embedding_backward(g)?; // the looked-up rows' gradient (B·T, C), wpe's
                // wte's whole gradient, formed as candle's one-graph backward
                // forms it: the lm_head part, then each token's row gradient
                // index-added onto it (in token order), then onto the running sum.
                let tied = head.index_add(&b.inputs.flatten_all()?, &rows, 0)?;
                sum.add(|buf| -> anyhow::Result<()> {
                    add_into(&mut buf[r[0].clone()], &tied)?;
                    add_into(&mut buf[r[1].clone()], &wpe)?;
                    add_into(&mut buf[r[2].clone()], &lnf[0])?;
                    add_into(&mut buf[r[3].clone()], &lnf[1])?;
                    Ok(())
                })?;
            }
            Ok(Some(sum))
        }
    }
}

/// The head's forward and backward on one micro-batch: its loss, the
/// gradients (ln_f, `wte`'s lm_head part, the input's) and the input as the
/// Var they were taken for.
fn head_backward(
    s: &Session,
    lnf: &[Tensor],
    wte: &Tensor,
    x: &Tensor,
    b: &Batch,
) -> anyhow::Result<(f32, candle_core::backprop::GradStore, Var)> {
    let x = Var::from_tensor(x)?; // a copy, so backward reaches it
    let logits = s.model.head(&lnf[0], &lnf[1], wte, x.as_tensor())?; // (B, T, V)
    let loss = cross_entropy(&logits, &b.targets)?;
    let grads = loss.backward()?;
    Ok((loss.to_scalar::<f32>()?, grads, x))
}

/// The unit's blocks, in order, on one micro-batch. (B, T, C) → (B, T, C).
pub fn run_blocks(s: &Session, unit: &FsdpUnit, p: &[Tensor], x: &Tensor) -> anyhow::Result<Tensor> {
    let mut x = x.clone();
    for b in 0..unit.blocks() {
        x = s.model.block(&p[b * PARAMS_PER_BLOCK..(b + 1) * PARAMS_PER_BLOCK], &x)?;
    }
    Ok(x)
}
// ANCHOR_END: phases

impl FsdpUnit<'_> {
    /// `buf += g` for gradients given by parameter-table entry (all of this
    /// unit's), each onto its place in the unit's flat vector.
    pub fn add_grads(&self, grads: &[(usize, Tensor)], buf: &mut [f32]) -> Result<(), fsdp_gpt::GptError> {
        for (i, g) in grads {
            let j = self.params.iter().position(|p| p == i).expect("a gradient of this unit's");
            fsdp_gpt::model::add_into(&mut buf[self.ranges[j].clone()], g)?;
        }
        Ok(())
    }
}
