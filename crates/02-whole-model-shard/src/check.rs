//! `--check`: the proof, at run time. Lesson 01's whole state — the
//! replicated reference — is kept beside the shards and fed the *same* mean
//! gradient; after every step, the largest |sharded − replicated| over all
//! the model's parameters must be 0 (exercise 2.2). `--check-probe` plants a
//! known fault in the reference, so that a check that always says 0 fails.
use fsdp_gpt::AdamW;
use fsdp_harness::{MemoryTally, Session, Start, exercise};

use crate::whole_model_shard::WholeModelShard;

/// The replicated reference of `--check`: lesson 01's params, `m` and `v`.
pub struct Reference {
    params: Vec<f32>,
    opt: AdamW,
    /// `--check-probe`: a known fault planted in it ([`plant_fault`]).
    probe: bool,
}

impl Reference {
    /// Lesson 01's whole state, read from `start` (a diagnostic beside my shard).
    pub fn new(s: &Session, start: &Start, probe: bool) -> anyhow::Result<Self> {
        let numel = s.table.numel();
        let all = 0..numel;
        let all = std::slice::from_ref(&all);
        let mut opt = AdamW::new(s.adamw, numel).with_no_decay(s.table.no_decay_in(0..numel));
        if let Some(r) = start.moments(all)? {
            (opt.m, opt.v, opt.t) = (r.m, r.v, r.t);
        }
        Ok(Self { params: start.weights(all)?, opt, probe })
    }
}

// ANCHOR: check
impl Reference {
    /// After the sharded step, on its batch and its mean gradient: the
    /// replicated reference's loss, its AdamW step, and max |sharded −
    /// replicated| over all elements of all ranks (exercise 2.2). Returns
    /// (the reference's loss, the divergence).
    pub fn step(&mut self, s: &Session, step: u64, fsdp: &mut WholeModelShard) -> anyhow::Result<(f32, f32)> {
        let (w, numel) = (s.world, fsdp.layout.numel);
        let ref_loss = reference_loss(s, &self.params, step)?;
        self.opt.step(&mut self.params, &fsdp.grads.sums()[0][..numel]);
        if self.probe {
            plant_fault(&mut self.params, step);
        }
        let d = exercise!(2, 2, divergence(w, &fsdp.master, &self.params, fsdp.layout, w.rank()));
        Ok((ref_loss, d))
    }
}
// ANCHOR_END: check

impl Reference {
    /// Its row in the tally: a diagnostic, apart from the technique's total.
    pub fn tally_apart(&self, t: &mut MemoryTally, numel: usize) {
        t.apart("--check reference", 3 * numel, 4, "replicated params, m, v: lesson 01's state, to compare");
    }
}

/// The loss of the replicated reference on this step's global batch
/// (forward only, without a graph: it keeps no activations).
fn reference_loss(s: &Session, params: &[f32], step: u64) -> anyhow::Result<f32> {
    let vars = s.model.vars_from_flat(&s.table, params)?;
    let ps: Vec<_> = vars.iter().map(|v| v.as_detached_tensor()).collect();
    let mut sum = 0.0;
    for k in s.my_micro_batches() {
        let b = s.sampler.micro_batch(step, k)?;
        let logits = s.model.forward(&s.table, &ps, &b.inputs)?;
        sum += fsdp_gpt::model::loss(&logits, &b.targets)?.to_scalar::<f32>()? as f64;
    }
    Ok((s.world.sum_f64(&[sum])[0] / s.sampler.micro_batches as f64) as f32)
}

/// `--check-probe`, for exercise 2.2's check: `--check` must see a fault in
/// the last rank's shard — the last parameter of the replicated reference
/// moved by 2⁻¹⁰ after step 2, made NaN after step 3.
fn plant_fault(params: &mut [f32], step: u64) {
    if let Some(last) = params.last_mut() {
        match step {
            2 => *last += 1.0 / 1024.0,
            3 => *last = f32::NAN,
            _ => {}
        }
    }
}
