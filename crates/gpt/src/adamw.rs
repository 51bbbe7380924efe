//! AdamW over flat `f32` slices — the one optimizer every lesson uses.
//!
//! It is elementwise: element `i`'s new value depends only on element `i` of
//! the parameter, gradient, `m` and `v`. That is the whole reason sharding
//! works: a rank that owns elements `a..b` can update them alone and get
//! exactly the bits a replicated run gets.
//!
//! The arithmetic follows `torch.optim.AdamW` (single-tensor path) op by op:
//!
//! ```text
//! p  ← p · (1 − lr·λ)                      decoupled weight decay
//! m  ← m + (1 − β1)·(g − m)                torch's lerp
//! v  ← β2·v + (1 − β2)·g·g
//! p  ← p − (lr / (1 − β1ᵗ)) · m / (√v / √(1 − β2ᵗ) + ε)   (ε outside the sqrt)
//! ```
//!
//! Weight decay follows nanoGPT's rule: only tensors of two or more
//! dimensions (matmul weights, embeddings) decay; biases and LayerNorm gains
//! do not. A shard holds pieces of several tensors, so the rule becomes a
//! property of each element, given to the optimizer as the ranges of its
//! elements that do not decay ([`crate::params::no_decay`]).

use std::ops::Range;

/// Hyper-parameters (torch's defaults but for the learning rate).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }
    }
}

/// The optimizer's state for the elements this rank owns: momentum `m`,
/// variance `v`, and the step count.
#[derive(Debug, Clone)]
pub struct AdamW {
    pub cfg: AdamWConfig,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    pub t: u32,
    /// The elements in order, as runs that decay (`true`) or not (1-D
    /// tensors' pieces): fixed by the layout, so formed once, not per step.
    runs: Vec<(Range<usize>, bool)>,
}

impl AdamW {
    /// State for `len` elements, all zero (torch's lazy init).
    pub fn new(cfg: AdamWConfig, len: usize) -> Self {
        Self { cfg, m: vec![0.0; len], v: vec![0.0; len], t: 0, runs: vec![(0..len, true)] }
    }

    /// The same, with the elements in `no_decay` left undecayed.
    pub fn with_no_decay(mut self, no_decay: Vec<Range<usize>>) -> Self {
        let (sorted, inside) =
            (no_decay.windows(2).all(|w| w[0].end <= w[1].start), no_decay.iter().all(|r| r.end <= self.m.len()));
        assert!(sorted && inside, "no_decay ranges must be sorted, disjoint and inside the {} elements", self.m.len());
        let mut at = 0;
        self.runs.clear();
        for r in no_decay {
            self.runs.extend([(at..r.start, true), (r.clone(), false)]);
            at = r.end;
        }
        self.runs.push((at..self.m.len(), true));
        self
    }

    /// One step over the owned elements. `params` and `grads` must be the
    /// same elements `m` and `v` describe.
    pub fn step(&mut self, params: &mut [f32], grads: &[f32]) {
        assert_eq!(params.len(), self.m.len(), "params and optimizer state differ in length");
        assert_eq!(grads.len(), self.m.len(), "grads and optimizer state differ in length");
        self.t += 1;
        let c = self.cfg;
        let decay = 1.0 - c.lr * c.weight_decay;
        let bias1 = 1.0 - c.beta1.powi(self.t as i32);
        let bias2 = 1.0 - c.beta2.powi(self.t as i32);
        let step_size = c.lr / bias1;
        let bias2_sqrt = bias2.sqrt();
        let w = 1.0 - c.beta1;
        let k = Consts { decay, w, beta2: c.beta2, eps: c.eps, step_size, bias2_sqrt };
        for (r, decays) in &self.runs {
            let k = Consts { decay: if *decays { decay } else { 1.0 }, ..k }; // × 1.0: exact, as if skipped
            let r = r.clone();
            let (p, g, m, v) = (&mut params[r.clone()], &grads[r.clone()], &mut self.m[r.clone()], &mut self.v[r]);
            crate::kernels::elementwise(|| update(p, g, m, v, k));
        }
    }
}

/// One step's constants.
#[derive(Clone, Copy)]
struct Consts {
    decay: f32,
    w: f32,
    beta2: f32,
    eps: f32,
    step_size: f32,
    bias2_sqrt: f32,
}

/// The update of a run of elements, each by itself: the same operations in
/// the same order at any SIMD width (no fused multiply-add: Rust never forms
/// one unasked), so [`crate::kernels::elementwise`] may run it as wide as the CPU allows.
#[inline(always)]
fn update(params: &mut [f32], grads: &[f32], m: &mut [f32], v: &mut [f32], k: Consts) {
    for (((p, &g), m), v) in params.iter_mut().zip(grads).zip(m).zip(v) {
        *p *= k.decay;
        *m += k.w * (g - *m);
        *v = *v * k.beta2 + (1.0 - k.beta2) * g * g;
        let denom = v.sqrt() / k.bias2_sqrt + k.eps;
        *p += -k.step_size * (*m / denom);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two steps worked by hand from the formula (in f64, rounded to f32).
    #[test]
    fn two_steps_match_the_formula_worked_by_hand() {
        let cfg = AdamWConfig { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 };
        let mut opt = AdamW::new(cfg, 2);
        let mut p = [1.0f32, -2.0];
        opt.step(&mut p, &[0.5, -0.25]);
        // Step 1: p·0.99; m = 0.1g; v = 0.001g²; m̂ = g, v̂ = g² → p −= 0.1·sign(g) (ε negligible).
        // 1·0.99 − 0.1 = 0.89;  −2·0.99 + 0.1 = −1.88.
        assert!((p[0] - 0.89).abs() < 1e-6, "{}", p[0]);
        assert!((p[1] + 1.88).abs() < 1e-6, "{}", p[1]);
        opt.step(&mut p, &[0.5, 0.25]);
        // Step 2, element 0: m = 0.05 + 0.1(0.5 − 0.05) = 0.095; v = 0.999·0.00025 + 0.001·0.25 = 0.00049975
        // m̂ = 0.095/0.19 = 0.5; v̂ = 0.00049975/0.001999 = 0.25; p = 0.89·0.99 − 0.1·0.5/0.5 = 0.7811
        assert!((p[0] - 0.7811).abs() < 1e-5, "{}", p[0]);
        // Element 1: m = −0.025 + 0.1(0.25 + 0.025) = 0.0025; v = 0.999·0.0000625 + 0.001·0.0625 = 0.0001249375
        // m̂ = 0.0025/0.19; v̂ = 0.0001249375/0.001999; p = −1.88·0.99 − 0.1·m̂/√v̂
        let (mh, vh) = (0.0025f64 / 0.19, 0.000_124_937_5f64 / 0.001_999);
        let want = -1.88f64 * 0.99 - 0.1 * mh / vh.sqrt();
        assert!((p[1] as f64 - want).abs() < 1e-5, "{} vs {want}", p[1]);
        assert_eq!(opt.t, 2);
    }

    /// nanoGPT's rule: with no gradient, an element moves only by its decay —
    /// the elements in `no_decay` not at all, the others by × (1 − lr·λ).
    #[test]
    fn no_decay_ranges_are_not_decayed() {
        let cfg = AdamWConfig { lr: 0.1, weight_decay: 0.5, ..AdamWConfig::default() };
        let mut p = [2.0f32; 6];
        AdamW::new(cfg, 6).with_no_decay(vec![1..3, 5..6]).step(&mut p, &[0.0; 6]);
        assert_eq!(p, [1.9, 2.0, 2.0, 1.9, 1.9, 2.0]);
    }

    /// Updating a slice in two halves with two optimizers gives the bits of
    /// one optimizer over the whole: the property every lesson relies on.
    #[test]
    fn updating_shards_separately_is_bitwise_equal_to_the_whole() {
        let cfg = AdamWConfig::default();
        let mut rng = crate::rng::SplitMix64::new(5);
        let mut whole: Vec<f32> = (0..1001).map(|_| rng.normal() as f32).collect();
        let mut parts = whole.clone();
        let mut one = AdamW::new(cfg, 1001);
        let (mut a, mut b) = (AdamW::new(cfg, 400), AdamW::new(cfg, 601));
        for _ in 0..5 {
            let g: Vec<f32> = (0..1001).map(|_| rng.normal() as f32).collect();
            one.step(&mut whole, &g);
            let (pa, pb) = parts.split_at_mut(400);
            a.step(pa, &g[..400]);
            b.step(pb, &g[400..]);
        }
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&whole), bits(&parts));
    }
}
