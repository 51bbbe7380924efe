//! The forward pass, written so it can also run one unit at a time.
//!
//! Shapes: B batch, T time (sequence), C channels (n_embd), V vocabulary,
//! nh heads, hs head size (C / nh).
//!
//! Every function takes its parameters as plain tensors, in the order of
//! [`crate::ParamTable`]: the model owns no weights. A lesson passes candle
//! `Var`s (so `backward` finds them) built from whatever flat vector it holds.
//!
//! **Fused ops are ours:** candle-nn's `softmax_last_dim`, `layer_norm`,
//! `rms_norm` and the `LayerNorm` module on contiguous input have no backward
//! pass — gradients silently stop there. Everything below is composed of ops
//! that have one, or is one of [`crate::kernels`] (candle custom ops with a
//! backward: the matmul, linear layers, GELU, attention, LayerNorm), and finite differences (this
//! module's tests) guard every parameter.
use candle_core::{DType, Device, Tensor, Var};

use crate::config::GptConfig;
use crate::error::{GptError, Result};
use crate::kernels::{self, Probs, matmul};
use crate::params::{PARAMS_PER_BLOCK, ParamTable, Unit};

const LN_EPS: f64 = 1e-5;

/// The model: a shape and the functions that run it.
#[derive(Debug, Clone)]
pub struct Gpt {
    pub cfg: GptConfig,
    /// Whether attention keeps its probabilities for the backward or
    /// recomputes them there (selective recompute): the same bits either way.
    pub probs: Probs,
}

impl Gpt {
    pub fn new(cfg: GptConfig) -> Self {
        Self { cfg, probs: Probs::Keep }
    }

    /// The same model, its attention keeping its probabilities or not.
    pub fn with_probs(self, probs: Probs) -> Self {
        Self { probs, ..self }
    }

    /// One candle `Var` per parameter tensor, copied from `flat` (the unit's
    /// or the whole model's part of the flat vector, starting at `specs[first]`).
    pub fn vars_from_flat(&self, table: &ParamTable, flat: &[f32]) -> Result<Vec<Var>> {
        self.unit_vars_from_flat(table, 0..table.specs.len(), flat)
    }

    /// `Var`s for the parameter entries `params` (e.g. one unit's), reading
    /// from `flat`, which holds exactly those parameters back to back.
    pub fn unit_vars_from_flat(
        &self,
        table: &ParamTable,
        params: std::ops::Range<usize>,
        flat: &[f32],
    ) -> Result<Vec<Var>> {
        let base = table.specs[params.start].offset;
        table.specs[params]
            .iter()
            .map(|s| {
                let r = s.offset - base..s.offset - base + s.numel();
                Ok(Var::from_slice(&flat[r], s.shape.as_slice(), &Device::Cpu)?)
            })
            .collect()
    }

    /// `Var`s for the entries `params`, cut from `full`, a 1-D tensor holding
    /// exactly those parameters back to back (any dtype: the compute copy).
    pub fn vars_from_tensor(&self, table: &ParamTable, params: &[usize], full: &Tensor) -> Result<Vec<Var>> {
        let mut at = 0;
        params
            .iter()
            .map(|&i| {
                let s = &table.specs[i];
                let v = Var::from_tensor(&full.narrow(0, at, s.numel())?.reshape(s.shape.as_slice())?)?;
                at += s.numel();
                Ok(v)
            })
            .collect()
    }

    /// The whole model's `Var`s in the compute dtype of `precision`, from the
    /// fp32 `flat` vector (rounded to nearest-even under bf16).
    pub fn vars_in(&self, table: &ParamTable, flat: &[f32], precision: crate::Precision) -> Result<Vec<Var>> {
        match precision {
            crate::Precision::Fp32 => self.vars_from_flat(table, flat),
            crate::Precision::Bf16 => table
                .specs
                .iter()
                .map(|s| {
                    let t = Tensor::from_slice(&flat[s.range()], s.shape.as_slice(), &Device::Cpu)?
                        .to_dtype(DType::BF16)?;
                    Ok(Var::from_tensor(&t)?)
                })
                .collect(),
        }
    }

    /// Token + position embedding. `idx`: (B, T) u32 → (B, T, C).
    pub fn embed(&self, wte: &Tensor, wpe: &Tensor, idx: &Tensor) -> Result<Tensor> {
        let tok = wte.embedding(&idx.flatten_all()?)?; // (B·T, C): one row of wte per token
        self.add_positions(&tok, wpe, idx.dims2()?)
    }

    /// The embedding after its lookup: token rows (B·T, C) plus the
    /// positions → (B, T, C). Apart from `embed` so that a backward can start
    /// at the looked-up rows (lesson 03 forms the tied `wte` gradient itself).
    pub fn add_positions(&self, tok: &Tensor, wpe: &Tensor, (b, t): (usize, usize)) -> Result<Tensor> {
        let tok = tok.reshape((b, t, self.cfg.n_embd))?; // (B, T, C)
        let pos = wpe.narrow(0, 0, t)?; // (T, C)
        // candle's broadcast_add is broadcast_as + add (the same backward); the add is the
        // model's own, as in every block: candle's bf16 add rounds with VCVTNEPS2BF16 where the
        // CPU has AVX512_BF16 (denormals flushed) and in software elsewhere.
        let pos = pos.broadcast_as(tok.shape())?.contiguous()?; // (B, T, C)
        Ok(kernels::add(&tok, &pos)?)
    }

    // ANCHOR: embedding_backward
    /// The embedding's backward, from `g`, the gradient of its output (B, T,
    /// C): the looked-up rows' gradient (B·T, C) — `g` itself, reshaped —
    /// and `wpe`'s (block_size, C): `g` summed over the batch at each of the
    /// T positions used, zeros beyond. An add's gradient does not depend on
    /// its operands, so no graph is needed: the bits of candle's backward of
    /// [`Gpt::add_positions`], whose broadcast sums over the batch the same
    /// way (`sum_keepdim`, b = 0, 1, … in order from 0).
    pub fn embedding_backward(&self, g: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, t, c) = g.dims3()?;
        let Some(rest) = self.cfg.block_size.checked_sub(t) else {
            return Err(GptError::Candle(candle_core::Error::Msg(format!(
                "embedding backward: T = {t} exceeds the context, {}",
                self.cfg.block_size
            ))));
        };
        debug_assert!(g.is_contiguous(), "the rows' gradient is a view of g (the tally counts none)");
        let rows = g.reshape((b * t, c))?; // (B·T, C): a view
        let pos = g.sum_keepdim(0)?.squeeze(0)?; // (T, C)
        let wpe = match rest {
            0 => pos,
            _ => Tensor::cat(&[&pos, &Tensor::zeros((rest, c), g.dtype(), g.device())?], 0)?,
        };
        Ok((rows, wpe))
    }
    // ANCHOR_END: embedding_backward

    /// One transformer block: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`.
    /// `p` are the block's 12 tensors in table order. (B, T, C) → (B, T, C).
    pub fn block(&self, p: &[Tensor], x: &Tensor) -> Result<Tensor> {
        assert_eq!(p.len(), PARAMS_PER_BLOCK, "a block has {PARAMS_PER_BLOCK} parameter tensors");
        let x = kernels::add(x, &self.attention(&p[2..6], &layer_norm(x, &p[0], &p[1])?)?)?;
        let h = kernels::linear_gelu(&layer_norm(&x, &p[6], &p[7])?, &p[8], &p[9])?; // (B, T, 4C): c_fc, GELU
        Ok(kernels::add(&x, &linear(&h, &p[10], &p[11])?)?)
    }

    // ANCHOR: block_taped
    /// [`Gpt::block`] outside candle's graph, each fused op kept on a tape
    /// for [`BlockTape::backward`]: the output, and the tape. `p` and `x`
    /// carry no graph (detached tensors). (B, T, C) → (B, T, C).
    pub fn block_taped(&self, p: &[Tensor], x: &Tensor) -> Result<(Tensor, BlockTape)> {
        use kernels::tape;
        assert_eq!(p.len(), PARAMS_PER_BLOCK, "a block has {PARAMS_PER_BLOCK} parameter tensors");
        let (h, ln_1) = tape::layer_norm(x, &p[0], &p[1], LN_EPS)?;
        let (y, attn) = tape::linear_attention(&h, &p[2], &p[3], self.cfg.n_head, self.probs)?; // c_attn, the heads
        let (a, attn_proj) = tape::linear(&y, &p[4], &p[5])?;
        let x = kernels::add(x, &a)?;
        let (h, ln_2) = tape::layer_norm(&x, &p[6], &p[7], LN_EPS)?;
        let (h, fc) = tape::linear_gelu(&h, &p[8], &p[9])?; // (B, T, 4C)
        let (m, mlp_proj) = tape::linear(&h, &p[10], &p[11])?;
        Ok((kernels::add(&x, &m)?, BlockTape { ops: [ln_1, attn, attn_proj, ln_2, fc, mlp_proj] }))
    }
    // ANCHOR_END: block_taped

    /// Causal self-attention. `p` = c_attn.{weight,bias}, c_proj.{weight,bias}.
    fn attention(&self, p: &[Tensor], x: &Tensor) -> Result<Tensor> {
        // c_attn: qkv (B, T, 3C), q, k, v side by side, heads side by side in each; then per head
        // y = softmax(q·kᵀ/√hs + causal mask)·v, the heads merged back into (B, T, C). One fused op
        // (kernels::linear_attention, which keeps qkv), bit for bit linear then kernels::attention_with.
        let y = kernels::linear_attention(x, &p[0], &p[1], self.cfg.n_head, self.probs)?;
        linear(&y, &p[2], &p[3])
    }

    /// Final LayerNorm and the tied lm_head. (B, T, C) → logits (B, T, V).
    pub fn head(&self, ln_w: &Tensor, ln_b: &Tensor, wte: &Tensor, x: &Tensor) -> Result<Tensor> {
        let x = layer_norm(x, ln_w, ln_b)?;
        let (b, t, c) = x.dims3()?;
        Ok(matmul(&x.reshape((b * t, c))?, &wte.t()?)?.reshape((b, t, self.cfg.vocab_size))?)
    }

    /// The whole forward pass: `params` in table order. (B, T) → (B, T, V).
    pub fn forward(&self, table: &ParamTable, params: &[Tensor], idx: &Tensor) -> Result<Tensor> {
        let mut x = self.embed(&params[0], &params[1], idx)?;
        for u in table.units() {
            if let Unit::Block(_) = u {
                x = self.block(&params[table.unit_params(u)], &x)?;
            }
        }
        let ln = table.unit_params(Unit::FinalNorm);
        self.head(&params[ln.start], &params[ln.start + 1], &params[0], &x)
    }
}

// ANCHOR: block_tape
/// A block's six fused ops as [`Gpt::block_taped`] ran them, for a backward
/// the project runs itself: each op's backward in reverse order, its input
/// gradient handed straight to the op before it — not into candle's
/// GradStore, which would add it to a tensor of zeros first
/// ([`crate::kernels::tape`]). The bits of candle's backward of [`Gpt::block`].
pub struct BlockTape {
    /// ln_1, c_attn + attention, attention's c_proj, ln_2, c_fc + GELU, the MLP's c_proj.
    ops: [crate::kernels::tape::Taped; 6],
}

impl BlockTape {
    /// From `g`, the gradient of the block's output (B, T, C): its input's
    /// gradient and its 12 parameters' gradients in table order.
    pub fn backward(&self, g: &Tensor) -> Result<(Tensor, Vec<Tensor>)> {
        let [ln_1, attn, attn_proj, ln_2, fc, mlp_proj] = &self.ops;
        // Each gradient is dropped once the op before has read it, as candle's backward drops
        // a node's gradient after its rule. out = x + m: g is m's gradient, and one of x's two.
        let [dm, dw_proj, db_proj] = mlp_proj.backward(g)?; // (B, T, 4C)
        let [dh, dw_fc, db_fc] = fc.backward(&dm)?; // through GELU and c_fc: (B, T, C)
        drop(dm);
        let [from_ln2, dw_ln2, db_ln2] = ln_2.backward(&dh)?;
        drop(dh);
        let dx = kernels::add(g, &from_ln2)?; // x's other gradient, from ln_2; x = x₀ + a: a's, and one of x₀'s
        drop(from_ln2);
        let [dy, dw_aproj, db_aproj] = attn_proj.backward(&dx)?;
        let [dh, dw_attn, db_attn] = attn.backward(&dy)?; // through the heads and c_attn
        drop(dy);
        let [from_ln1, dw_ln1, db_ln1] = ln_1.backward(&dh)?;
        drop(dh);
        let dx0 = kernels::add(&dx, &from_ln1)?; // x₀'s other gradient, from ln_1
        let grads =
            vec![dw_ln1, db_ln1, dw_attn, db_attn, dw_aproj, db_aproj, dw_ln2, db_ln2, dw_fc, db_fc, dw_proj, db_proj];
        Ok((dx0, grads))
    }
}
// ANCHOR_END: block_tape

/// Mean cross-entropy of logits (B, T, V) against targets (B, T) u32.
/// bf16 logits are widened to fp32 first: the loss is computed in fp32
/// (f32 and f64 are left as they are).
pub fn loss(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let logits = match logits.dtype() {
        DType::BF16 | DType::F16 => logits.to_dtype(DType::F32)?,
        _ => logits.clone(),
    };
    let (b, t, v) = logits.dims3()?;
    Ok(candle_nn::loss::cross_entropy(&logits.reshape((b * t, v))?, &targets.flatten_all()?)?)
}

/// `x @ w.T + b` with torch's (out, in) weight layout. (B, T, in) → (B, T, out).
/// One fused op ([`crate::kernels::linear`]), bit for bit the reshape, matmul and bias add it replaces.
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    Ok(kernels::linear(x, w, b)?)
}

/// LayerNorm over the last dimension (ε = 1e-5, torch's), fused: see [`crate::kernels::layer_norm`].
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    Ok(kernels::layer_norm(x, w, b, LN_EPS)?)
}

/// Runs `f` on the `f32` values of a tensor without copying them out.
pub fn with_f32_values<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    with_values(t, f)
}

/// Runs `f` on the values of a tensor of dtype `D` without copying them out.
fn with_values<D: candle_core::WithDType, R>(t: &Tensor, f: impl FnOnce(&[D]) -> R) -> Result<R> {
    let t = t.contiguous()?; // no copy when it already is
    let (storage, layout) = t.storage_and_layout();
    let cpu = match &*storage {
        candle_core::Storage::Cpu(cpu) => cpu,
        #[allow(unreachable_patterns)]
        _ => return Err(GptError::Candle(candle_core::Error::Msg("tensor is not on the CPU".into()))),
    };
    let all = cpu.as_slice::<D>()?;
    let start = layout.start_offset();
    Ok(f(&all[start..start + t.elem_count()]))
}

/// Adds the gradient of each `var` onto `acc` (their flat slots, back to
/// back): `acc += g`, the gradient-accumulation step. Used for the sum over
/// micro-batches, so its order of additions is part of every lesson's result.
/// A bf16 gradient is widened to fp32 first (exactly: every bf16 is an f32).
/// Every var must have a gradient: one the backward did not reach is an
/// error, not a zero (a graph built from detached copies would otherwise
/// train on silently).
pub fn add_grads(grads: &candle_core::backprop::GradStore, vars: &[Var], acc: &mut [f32]) -> Result<()> {
    if let Some(index) = vars.iter().position(|v| grads.get(v.as_tensor()).is_none()) {
        let shape = format!("{:?}", vars[index].dims());
        return Err(crate::GptError::NoGradient { index, count: vars.len(), shape });
    }
    add_each(vars, acc, |_, v| grads.get(v.as_tensor()))
}

/// `acc += g` for each of `vars` in order, their flat slots back to back,
/// with `grad(k, var)` the k-th one's gradient (none: nothing added).
pub fn add_each<'g>(vars: &[Var], acc: &mut [f32], grad: impl Fn(usize, &Var) -> Option<&'g Tensor>) -> Result<()> {
    let mut at = 0;
    for (k, v) in vars.iter().enumerate() {
        let n = v.elem_count();
        if let Some(g) = grad(k, v) {
            add_into(&mut acc[at..at + n], g)?;
        }
        at += n;
    }
    Ok(())
}

/// `acc += t`, element by element, `t` widened to fp32 as it is read (a
/// no-op for fp32; no widened copy of a bf16 `t`), at the SIMD width.
pub fn add_into(acc: &mut [f32], t: &Tensor) -> Result<()> {
    match t.dtype() {
        DType::F32 => with_values(t, |t: &[f32]| kernels::zip_update(acc, t, |a, x| *a += x)),
        DType::BF16 => {
            with_values(t, |t: &[half::bf16]| kernels::zip_update(acc, t, |a, x| *a += crate::precision::from_bf16(x)))
        }
        _ => with_values(&t.to_dtype(DType::F32)?, |t: &[f32]| kernels::zip_update(acc, t, |a, x| *a += x)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Probs;
    use crate::params::ParamTable;

    /// A model small enough for finite differences, in f64 so they are exact enough.
    fn micro() -> (Gpt, ParamTable, Vec<f64>) {
        let cfg = GptConfig { vocab_size: 7, block_size: 5, n_layer: 2, n_head: 2, n_embd: 8 };
        let table = ParamTable::new(&cfg);
        // Perturb every parameter (LayerNorm gains at 1, biases at 0 would hide bugs).
        let mut rng = crate::rng::SplitMix64::new(99);
        let flat = table.init_flat(3).iter().map(|&x| x as f64 + 0.1 * rng.normal()).collect();
        (Gpt::new(cfg), table, flat)
    }

    fn loss_at(gpt: &Gpt, table: &ParamTable, flat: &[f64], idx: &Tensor, tgt: &Tensor) -> f64 {
        let ps: Vec<Tensor> = table
            .specs
            .iter()
            .map(|s| Tensor::from_slice(&flat[s.range()], s.shape.as_slice(), &Device::Cpu).unwrap())
            .collect();
        loss(&gpt.forward(table, &ps, idx).unwrap(), tgt).unwrap().to_scalar::<f64>().unwrap()
    }

    /// Every parameter tensor's analytic gradient agrees with central finite
    /// differences. A fused op without backward would give zeros here and fail.
    #[test]
    fn gradients_match_finite_differences_for_every_parameter() {
        let (gpt, table, flat) = micro();
        let idx = Tensor::new(&[[1u32, 4, 2, 6, 0], [3, 3, 5, 1, 2]], &Device::Cpu).unwrap();
        let tgt = Tensor::new(&[[4u32, 2, 6, 0, 5], [3, 5, 1, 2, 6]], &Device::Cpu).unwrap();
        let vars: Vec<Var> = table
            .specs
            .iter()
            .map(|s| Var::from_slice(&flat[s.range()], s.shape.as_slice(), &Device::Cpu).unwrap())
            .collect();
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let grads = loss(&gpt.forward(&table, &ts, &idx).unwrap(), &tgt).unwrap().backward().unwrap();
        let h = 1e-6;
        for (spec, var) in table.specs.iter().zip(&vars) {
            let g = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{}: no gradient reached it", spec.name))
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap();
            // Check a spread of elements of each tensor.
            let n = spec.numel();
            for k in [0, n / 3, n / 2, n - 1] {
                let mut f = flat.clone();
                f[spec.offset + k] += h;
                let up = loss_at(&gpt, &table, &f, &idx, &tgt);
                f[spec.offset + k] -= 2.0 * h;
                let down = loss_at(&gpt, &table, &f, &idx, &tgt);
                let numeric = (up - down) / (2.0 * h);
                // Relative agreement, with an absolute floor for gradients that are
                // truly zero (the key bias: softmax ignores a constant shift).
                let ok = (numeric - g[k]).abs() <= 1e-5 * (numeric.abs() + g[k].abs()) + 1e-8;
                assert!(ok, "{}[{k}]: analytic {} vs numeric {numeric}", spec.name, g[k]);
            }
            assert!(g.iter().any(|&x| x != 0.0), "{}: gradient is all zeros", spec.name);
        }
    }

    #[test]
    fn a_weight_the_backward_does_not_reach_is_refused_not_summed_as_zero() {
        // Exercise 3.1's silent bug: the forward built from a detached copy of one weight.
        let (w, b) =
            (Var::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu).unwrap(), Var::new(&[0.5f32, 1.], &Device::Cpu).unwrap());
        let x = Tensor::new(&[[1f32, -1.]], &Device::Cpu).unwrap();
        let out = |w: &Tensor| x.matmul(w).unwrap().broadcast_add(b.as_tensor()).unwrap().sum_all().unwrap();
        let mut acc = vec![0f32; 6];
        let grads = out(w.as_tensor()).backward().unwrap();
        add_grads(&grads, &[w.clone(), b.clone()], &mut acc).unwrap();
        assert_eq!(acc, [1., 1., -1., -1., 1., 1.]);
        let grads = out(&w.as_tensor().detach()).backward().unwrap();
        let e = add_grads(&grads, &[w.clone(), b.clone()], &mut acc).unwrap_err().to_string();
        assert!(e.starts_with("parameter 0 of 2 ([2, 2]) has no gradient: the backward does not reach it"), "{e}");
        assert_eq!(acc, [1., 1., -1., -1., 1., 1.], "nothing added on a refusal");
    }

    /// A tensor's values as the bits of f64s (exact for f32, bf16 and f64).
    fn bits(t: &Tensor) -> Vec<u64> {
        let t = t.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
        t.to_vec1::<f64>().unwrap().iter().map(|v| v.to_bits()).collect()
    }

    /// A block's taped backward gives the bits of candle's backward of the
    /// same block — its input's gradient and all twelve parameters' — in
    /// f32, bf16 and f64, with attention's probabilities kept and
    /// recomputed; and its output is the block's.
    #[test]
    fn the_taped_backward_gives_candles_bits() {
        let cfg = GptConfig { vocab_size: 7, block_size: 6, n_layer: 1, n_head: 2, n_embd: 16 };
        let table = ParamTable::new(&cfg);
        let mut rng = crate::rng::SplitMix64::new(11);
        let flat: Vec<f32> = table.init_flat(5).iter().map(|&x| x + 0.1 * rng.normal() as f32).collect();
        let block = table.unit_params(Unit::Block(0));
        let noise =
            |n: usize, rng: &mut crate::rng::SplitMix64| (0..n).map(|_| rng.normal() as f32).collect::<Vec<_>>();
        let (x, g) = (noise(2 * 6 * 16, &mut rng), noise(2 * 6 * 16, &mut rng));
        for dtype in [DType::F32, DType::BF16, DType::F64] {
            for probs in [Probs::Keep, Probs::Recompute] {
                let gpt = Gpt::new(cfg).with_probs(probs);
                let t = |v: &[f32], shape: &[usize]| {
                    Tensor::from_slice(v, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
                };
                let ps: Vec<Var> = table.specs[block.clone()]
                    .iter()
                    .map(|s| Var::from_tensor(&t(&flat[s.range()], &s.shape)).unwrap())
                    .collect();
                let (xv, up) = (Var::from_tensor(&t(&x, &[2, 6, 16])).unwrap(), t(&g, &[2, 6, 16]));
                // candle: the block's graph, pulled back from sum(out · g)
                let tracked: Vec<Tensor> = ps.iter().map(|v| v.as_tensor().clone()).collect();
                let out = gpt.block(&tracked, xv.as_tensor()).unwrap();
                let grads = (&out * &up).unwrap().sum_all().unwrap().backward().unwrap();
                // the tape
                let detached: Vec<Tensor> = ps.iter().map(|v| v.as_detached_tensor()).collect();
                let (taped_out, tape) = gpt.block_taped(&detached, &xv.as_detached_tensor()).unwrap();
                let (dx, dp) = tape.backward(&up).unwrap();
                let what = format!("{dtype:?}, {probs:?}");
                assert_eq!(bits(&taped_out), bits(&out), "{what}: the output");
                assert_eq!(bits(&dx), bits(grads.get(xv.as_tensor()).unwrap()), "{what}: the input's gradient");
                for ((spec, v), d) in table.specs[block.clone()].iter().zip(&ps).zip(&dp) {
                    assert_eq!(bits(d), bits(grads.get(v.as_tensor()).unwrap()), "{what}: {}", spec.name);
                }
            }
        }
        // A graph on the input is refused, not silently cut.
        let vars = Gpt::new(cfg).vars_from_flat(&table, &flat).unwrap();
        let p: Vec<Tensor> = vars[block].iter().map(|v| v.as_detached_tensor()).collect();
        let x = Var::from_slice(&x, (2, 6, 16), &Device::Cpu).unwrap();
        let e = Gpt::new(cfg).block_taped(&p, x.as_tensor()).err().unwrap().to_string();
        assert!(e.contains("without a graph"), "{e}");
    }

    /// The embedding's backward without a graph gives candle's bits, the
    /// rows' and wpe's, for the whole context and for part of it (wpe
    /// narrowed), in f32, bf16 and f64.
    #[test]
    fn the_embedding_backward_gives_candles_bits() {
        let cfg = GptConfig { vocab_size: 7, block_size: 6, n_layer: 1, n_head: 2, n_embd: 8 };
        let gpt = Gpt::new(cfg);
        let mut rng = crate::rng::SplitMix64::new(3);
        for dtype in [DType::F32, DType::BF16, DType::F64] {
            for t in [6, 4] {
                let g: Vec<f32> = (0..3 * t * 8).map(|_| rng.normal() as f32).collect();
                let g = Tensor::from_vec(g, (3, t, 8), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
                let rows = Var::zeros((3 * t, 8), dtype, &Device::Cpu).unwrap();
                let wpe = Var::zeros((6, 8), dtype, &Device::Cpu).unwrap();
                let x = gpt.add_positions(rows.as_tensor(), wpe.as_tensor(), (3, t)).unwrap();
                let grads = (x * &g).unwrap().sum_all().unwrap().backward().unwrap();
                let (r, w) = gpt.embedding_backward(&g).unwrap();
                assert_eq!(bits(&r), bits(grads.get(rows.as_tensor()).unwrap()), "{dtype:?}, T = {t}: the rows");
                assert_eq!(bits(&w), bits(grads.get(wpe.as_tensor()).unwrap()), "{dtype:?}, T = {t}: wpe");
                assert_eq!(w.dims(), [6, 8]);
            }
        }
    }

    #[test]
    fn block_by_block_equals_whole_forward() {
        let (gpt, table, flat) = micro();
        let flat32: Vec<f32> = flat.iter().map(|&x| x as f32).collect();
        let vars = gpt.vars_from_flat(&table, &flat32).unwrap();
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let idx = Tensor::new(&[[1u32, 4, 2]], &Device::Cpu).unwrap();
        let whole = gpt.forward(&table, &ts, &idx).unwrap();
        let mut x = gpt.embed(&ts[0], &ts[1], &idx).unwrap();
        for i in 0..2 {
            let r = table.unit_params(Unit::Block(i));
            let unit = gpt.unit_vars_from_flat(&table, r.clone(), &flat32[table.unit_range(Unit::Block(i))]).unwrap();
            let unit: Vec<Tensor> = unit.iter().map(|v| v.as_tensor().clone()).collect();
            x = gpt.block(&unit, &x).unwrap();
        }
        let ln = table.unit_params(Unit::FinalNorm);
        let by_unit = gpt.head(&ts[ln.start], &ts[ln.start + 1], &ts[0], &x).unwrap();
        let a = whole.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let b = by_unit.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(a, b);
    }
}
