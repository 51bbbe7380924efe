//! Forward and backward one block at a time: every lesson's backward but
//! lesson 03's units — the mechanism behind `--recompute` (activation
//! checkpointing) and behind ZeRO-2's backward, which hands each block's
//! gradient on as soon as it exists.
//!
//! One micro-batch, whole model resident:
//!
//! ```text
//! forward   embed (no graph) → h.0 → … → h.L−1 → head + loss, and its backward
//! backward  h.L−1 → … → h.0 → the embedding's backward
//! ```
//!
//! Each block runs on a tape ([`crate::model::Gpt::block_taped`]): its fused
//! ops outside candle's graph, each kept with what its backward needs, so
//! that the block's backward is the project's own — the ops' backwards in
//! reverse, each gradient handed straight to the op before, where candle's
//! `backward` would first add it to a tensor of zeros in its GradStore.
//! Pulling `g` back through a tape gives the block's parameter gradients
//! and `g` for the block before. With `recompute` the forward keeps only
//! each block's input and runs the block again on a tape just before its
//! backward (one block's activations at a time, for one more forward);
//! without, it keeps every block's tape, and frees each once its backward is
//! done. The head and the loss go through candle's autograd; the
//! embedding's backward needs no graph ([`crate::model::Gpt::embedding_backward`]).
//! Either way every gradient has exactly the bits of one
//! whole-graph `loss.backward()`: the same ops, the same order (the tied
//! `wte` is completed as candle completes it: its lm_head part, then the
//! token rows index-added onto it).
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use crate::data::Batch;
use crate::error::{GptError, Result};
use crate::model::{Gpt, add_each, loss};
use crate::params::{PARAMS_PER_BLOCK, ParamTable, Unit};

/// A micro-batch's gradients, the tensors the block-by-block backward
/// produced, by parameter-table entry.
pub struct Grads(Vec<Option<Tensor>>);

impl Grads {
    /// The gradient of parameter entry `i`.
    pub fn get(&self, i: usize) -> Option<&Tensor> {
        self.0.get(i).and_then(Option::as_ref)
    }

    /// `acc += g` for the entries `params` (with their `vars`), back to back
    /// in `acc`: the gradient-accumulation step. Each element is one addition,
    /// so the order of the entries does not matter; a bf16 gradient is
    /// widened to fp32 first (exactly).
    pub fn add_to(&self, params: &[usize], vars: &[Var], acc: &mut [f32]) -> Result<()> {
        add_each(vars, acc, |k, _| self.get(params[k]))
    }
}

fn missing(what: &str) -> GptError {
    GptError::Candle(candle_core::Error::Msg(format!("blockwise backward: no gradient for {what}")))
}

/// One micro-batch's forward and backward, block by block, with `params`
/// the whole model's `Var`s in table order. `on_unit` receives each unit's
/// gradients as soon as they are complete, as `(table entry, gradient)`:
/// every block in backward order, then the root (`wte`, `wpe`, `ln_f`),
/// reported as [`Unit::Embedding`]. Returns the micro-batch's loss.
pub fn forward_backward(
    gpt: &Gpt,
    table: &ParamTable,
    params: &[Var],
    batch: &Batch,
    recompute: bool,
    on_unit: impl FnMut(Unit, Vec<(usize, Tensor)>) -> Result<()>,
) -> Result<f32> {
    forward_backward_marked(gpt, table, params, batch, recompute, |_| {}, on_unit)
}

/// Where [`forward_backward_marked`] has got to, for a trace: the blocks'
/// forward is done, then the head's forward and backward (each block's
/// backward ends with its `on_unit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Milestone {
    ForwardDone,
    HeadDone,
}

/// [`forward_backward`], telling `on_milestone` when the forward and the head are done.
pub fn forward_backward_marked(
    gpt: &Gpt,
    table: &ParamTable,
    params: &[Var],
    batch: &Batch,
    recompute: bool,
    mut on_milestone: impl FnMut(Milestone),
    mut on_unit: impl FnMut(Unit, Vec<(usize, Tensor)>) -> Result<()>,
) -> Result<f32> {
    let detached: Vec<Tensor> = params.iter().map(|v| v.as_detached_tensor()).collect(); // no graph
    let tracked: Vec<Tensor> = params.iter().map(|v| v.as_tensor().clone()).collect(); // the head's graph
    let n_layer = gpt.cfg.n_layer;
    let block = |i: usize| 2 + i * PARAMS_PER_BLOCK..2 + (i + 1) * PARAMS_PER_BLOCK;

    // Forward: the embedding without a graph (its backward needs no activations).
    let mut x = gpt.embed(&detached[0], &detached[1], &batch.inputs)?; // (B, T, C)
    let (mut saved, mut tapes) = (vec![], vec![]);
    for i in 0..n_layer {
        x = match recompute {
            true => {
                let y = gpt.block(&detached[block(i)], &x)?; // no graph, no tape: keep the input only
                saved.push(x);
                y
            }
            false => {
                let (y, tape) = gpt.block_taped(&detached[block(i)], &x)?; // the tape keeps what backward needs
                tapes.push(tape);
                y
            }
        };
    }

    on_milestone(Milestone::ForwardDone);

    // The head and the loss, and their backward at once.
    let ln = table.unit_params(Unit::FinalNorm);
    let xv = Var::from_tensor(&x)?;
    drop(x);
    let logits = gpt.head(&tracked[ln.start], &tracked[ln.start + 1], &tracked[0], xv.as_tensor())?;
    let loss = loss(&logits, &batch.targets)?;
    let grads = loss.backward()?;
    let loss_value = loss.to_scalar::<f32>()?;
    let get = |g: &GradStore, t: &Tensor, what: &str| g.get(t).map(Tensor::detach).ok_or_else(|| missing(what));
    let head_wte = get(&grads, &tracked[0], "wte (lm_head)")?;
    let lnf = [get(&grads, &tracked[ln.start], "ln_f.weight")?, get(&grads, &tracked[ln.start + 1], "ln_f.bias")?];
    let mut g = get(&grads, xv.as_tensor(), "the head's input")?;
    drop((grads, loss, logits, xv));
    on_milestone(Milestone::HeadDone);

    // The blocks, last first: pull g back through each tape, hand its gradients on.
    for i in (0..n_layer).rev() {
        let tape = match recompute {
            true => gpt.block_taped(&detached[block(i)], &saved.pop().ok_or_else(|| missing("a saved input"))?)?.1,
            false => tapes.pop().ok_or_else(|| missing("a block's tape"))?,
        };
        let (dx, grads) = tape.backward(&g)?;
        drop(tape); // the block's activations go with it
        g = dx;
        on_unit(Unit::Block(i), block(i).zip(grads).collect())?;
    }

    // The embedding's backward (no graph: an add's gradient does not depend on its operands).
    let (rows, wpe_grad) = gpt.embedding_backward(&g)?;
    // wte's whole gradient as candle's one-graph backward forms it.
    let tied = head_wte.index_add(&batch.inputs.flatten_all()?, &rows, 0)?;
    let [w, b] = lnf;
    on_unit(Unit::Embedding, vec![(0, tied), (1, wpe_grad), (ln.start, w), (ln.start + 1, b)])?;
    Ok(loss_value)
}

/// [`forward_backward`] for the whole model at once: every gradient,
/// collected by table entry (`Session::forward_backward`: lessons 01 and 02 and ZeRO-1).
pub fn forward_backward_collected(
    gpt: &Gpt,
    table: &ParamTable,
    params: &[Var],
    batch: &Batch,
    recompute: bool,
) -> Result<(f32, Grads)> {
    let mut all: Vec<Option<Tensor>> = vec![None; table.specs.len()];
    let loss = forward_backward(gpt, table, params, batch, recompute, |_, grads| {
        for (i, g) in grads {
            all[i] = Some(g);
        }
        Ok(())
    })?;
    Ok((loss, Grads(all)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::GptConfig;
    use crate::precision::Precision;
    use candle_core::Device;

    /// Both block-by-block backwards give every gradient of one whole-graph
    /// backward, bit for bit, in fp32 and bf16, with and without recompute.
    #[test]
    fn block_by_block_equals_the_whole_graph_bitwise() {
        let cfg = GptConfig { vocab_size: 11, block_size: 8, n_layer: 3, n_head: 2, n_embd: 16 };
        let (table, gpt) = (ParamTable::new(&cfg), Gpt::new(cfg));
        let mut rng = crate::rng::SplitMix64::new(5);
        let flat: Vec<f32> = table.init_flat(7).iter().map(|&x| x + 0.05 * rng.normal() as f32).collect();
        let ids: Vec<u32> = (0..2 * 6).map(|i| (i * 5 % 11) as u32).collect();
        let batch = Batch {
            inputs: Tensor::from_vec(ids.clone(), (2, 6), &Device::Cpu).unwrap(), // T = 6 < block_size: wpe narrowed
            targets: Tensor::from_vec(ids.iter().map(|x| (x + 3) % 11).collect::<Vec<_>>(), (2, 6), &Device::Cpu)
                .unwrap(),
        };
        for precision in [Precision::Fp32, Precision::Bf16] {
            let vars = gpt.vars_in(&table, &flat, precision).unwrap();
            let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
            let whole = loss(&gpt.forward(&table, &ts, &batch.inputs).unwrap(), &batch.targets).unwrap();
            let reference = whole.backward().unwrap();
            let bits = |t: &Tensor| -> Vec<u32> {
                let t = t.to_dtype(candle_core::DType::F32).unwrap();
                t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
            };
            for recompute in [false, true] {
                let mut order = vec![];
                let mut all: Vec<Option<Tensor>> = vec![None; table.specs.len()];
                let l = forward_backward(&gpt, &table, &vars, &batch, recompute, |u, grads| {
                    order.push(u);
                    grads.into_iter().for_each(|(i, g)| all[i] = Some(g));
                    Ok(())
                })
                .unwrap();
                assert_eq!(l.to_bits(), whole.to_scalar::<f32>().unwrap().to_bits());
                assert_eq!(order, [Unit::Block(2), Unit::Block(1), Unit::Block(0), Unit::Embedding]);
                for (i, spec) in table.specs.iter().enumerate() {
                    assert_eq!(
                        bits(all[i].as_ref().unwrap()),
                        bits(reference.get(vars[i].as_tensor()).unwrap()),
                        "{precision} recompute {recompute}: {}",
                        spec.name
                    );
                }
            }
        }
    }
}
