//! FSDP units: which parameters are gathered, computed and freed together,
//! and each unit's shard of the weights, of their gradient and of AdamW's
//! `m` and `v`. Lesson 04's three ZeRO stages reuse them.
//!
//! Unit 0 is the **root**: `wte`, `wpe` and the final LayerNorm. The tied
//! `wte` is both the embedding and the lm_head, so it must live in one unit
//! that is used at both ends of the model (PyTorch FSDP has the same rule:
//! tied parameters share a unit). Units 1.. hold `blocks_per_unit`
//! consecutive transformer blocks each.
use std::ops::Range;

use candle_core::{DType, Device, Tensor};
use fsdp_comm::{MicroBatchSum, Pending, ShardLayout, World};
use fsdp_gpt::params::PARAMS_PER_BLOCK;
use fsdp_gpt::precision::bf16_tensor;
use fsdp_gpt::{AdamW, ParamTable, Unit};
use fsdp_harness::{Session, Start, exercise};

use crate::hsdp::{UnitComms, all_reduce_shard};
use crate::mixed_precision::MixedPrecision;

// ANCHOR: unit_params
/// The parameter-table entries of each unit, root first: `(name, entries)`.
pub fn unit_params(table: &ParamTable, n_layer: usize, blocks_per_unit: usize) -> Vec<(String, Vec<usize>)> {
    let per_unit = blocks_per_unit.max(1);
    let mut root: Vec<usize> = table.unit_params(Unit::Embedding).collect();
    root.extend(table.unit_params(Unit::FinalNorm));
    let mut units = vec![("root".to_string(), root)];
    for first in (0..n_layer).step_by(per_unit) {
        let last = (first + per_unit).min(n_layer) - 1;
        let name = if first == last { format!("h.{first}") } else { format!("h.{first}-{last}") };
        let entries = (first..=last).flat_map(|b| table.unit_params(Unit::Block(b))).collect();
        units.push((name, entries));
    }
    units
}
// ANCHOR_END: unit_params

/// One unit on one rank: everything about it is sharded between steps.
pub struct FsdpUnit<'w> {
    pub(crate) name: String,
    /// Parameter-table entries, in the unit's flat order.
    pub(crate) params: Vec<usize>,
    /// Where each entry of `params` sits in the unit's flat vector.
    pub(crate) ranges: Vec<Range<usize>>,
    /// How many blocks the unit runs (0 for the root).
    pub(crate) blocks: usize,
    pub(crate) layout: ShardLayout,
    /// My shard of the unit's fp32 weights (padding included).
    pub(crate) master: Vec<f32>,
    /// My shard of the unit's gradient, after the reduce-scatter …
    pub(crate) grad: Vec<f32>,
    /// … or, while the reduce-scatter is in flight on the stream, where it
    /// will come from (the shard's buffer travels with it).
    pub(crate) reducing: Option<Pending<Vec<f32>>>,
    /// AdamW on my shard only: `m` and `v` are 1/N of the unit each.
    pub(crate) opt: AdamW,
    /// Where its shards are, and under HSDP its replicas.
    pub(crate) comms: UnitComms<'w>,
    /// The dtype it is gathered and computed in.
    pub(crate) mp: MixedPrecision,
    /// FSDP2's `reshard_after_forward` ([`build_units`]).
    pub(crate) reshard_after_forward: bool,
    /// Its reduce-scatters go to the communication stream, returning at once
    /// (`--prefetch`, `--overlap-comm`: [`crate::prefetch::reduce_on_stream`]).
    pub(crate) on_stream: bool,
    /// `reshard_after_forward: false`: the unsharded parameters, kept.
    pub(crate) unsharded: Option<Tensor>,
}

impl<'w> FsdpUnit<'w> {
    /// My shard of the unit, read from `start` (the seed's weights or a
    /// checkpoint's, with AdamW's moments): only the model-order positions
    /// my shard covers are computed or read — no rank holds the whole model.
    pub fn new(
        s: &Session,
        name: String,
        params: Vec<usize>,
        start: &Start,
        comms: UnitComms<'w>,
        reshard_after_forward: bool,
        mp: MixedPrecision,
    ) -> anyhow::Result<Self> {
        let table = &s.table;
        let mut ranges = Vec::new();
        let mut len = 0;
        for &i in &params {
            ranges.push(len..len + table.specs[i].numel());
            len += table.specs[i].numel();
        }
        // Sharded over the world, or under HSDP over my shard group: the
        // same layout as full sharding over S ranks (a checkpoint is one).
        let shard_comm = comms.shard;
        let layout = ShardLayout::new(len, shard_comm.size());
        let mine = model_ranges(table, &params, layout, shard_comm.rank());
        let master = layout.pad(start.weights(&mine)?); // padding: zeros that no parameter uses
        let blocks = params.len() / PARAMS_PER_BLOCK;
        // nanoGPT's decay rule on my window of the unit's flat vector
        let window = layout.shard(shard_comm.rank()).range();
        let no_decay = fsdp_gpt::params::no_decay(table, params.iter().copied().zip(ranges.iter().cloned()), window);
        let (grad, mut opt) =
            (vec![0.0; layout.shard_len], AdamW::new(s.adamw, layout.shard_len).with_no_decay(no_decay));
        if let Some(r) = start.moments(&mine)? {
            (opt.m, opt.v, opt.t) = (layout.pad(r.m), layout.pad(r.v), r.t);
        }
        let mut unit = Self {
            name,
            params,
            ranges,
            blocks,
            layout,
            master,
            grad,
            reducing: None,
            opt,
            comms,
            mp,
            reshard_after_forward,
            on_stream: false,
            unsharded: None,
        };
        if !reshard_after_forward {
            unit.unsharded = Some(unit.gather()?);
        }
        Ok(unit)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Parameter-table entries, in the unit's flat order.
    pub fn params(&self) -> &[usize] {
        &self.params
    }
    /// Where each entry of `params` sits in the unit's flat vector.
    pub fn ranges(&self) -> &[Range<usize>] {
        &self.ranges
    }
    /// How many blocks the unit runs (0 for the root).
    pub fn blocks(&self) -> usize {
        self.blocks
    }
    pub fn layout(&self) -> ShardLayout {
        self.layout
    }
    /// Bytes per element of the compute copy (the param dtype): 4, or 2 under bf16.
    pub fn param_bytes(&self) -> usize {
        self.mp.param_dtype.size_in_bytes()
    }
    /// Whether using the unit needs an all-gather (else its parameters are kept unsharded).
    pub fn gathers(&self) -> bool {
        self.reshard_after_forward
    }

    /// FSDP2's *unshard*: the unit's full weights in the param dtype, as
    /// one flat tensor (padded): an all-gather, or the kept copy when the
    /// unit is not resharded.
    pub fn unshard(&self) -> candle_core::Result<Tensor> {
        match &self.unsharded {
            Some(t) => Ok(t.clone()),
            None => self.gather(),
        }
    }

    // ANCHOR: gather
    /// **all-gather** of the compute copy: every rank rounds its fp32 shard
    /// to the param dtype and sends that (2 bytes per element under bf16,
    /// half of fp32's). The result is freshly allocated; drop it to free it.
    fn gather(&self) -> candle_core::Result<Tensor> {
        let (c, n) = (self.comms.shard, self.layout.padded); // the world, or my shard group
        match self.mp.param_dtype {
            DType::F32 => {
                let mut full = vec![0.0f32; n];
                c.all_gather(&self.master, &mut full);
                Tensor::from_vec(full, n, &Device::Cpu)
            }
            DType::BF16 => {
                // bf16: the bits of each rounded fp32 element travel as u16.
                let mut full = vec![0u16; n];
                c.all_gather(&(self.mp.bf16_wire)(&self.master), &mut full);
                bf16_tensor(full)
            }
            other => Err(candle_core::Error::Msg(format!("param_dtype {other:?}: units gather in F32 or BF16"))),
        }
    }
    // ANCHOR_END: gather

    /// **reduce-scatter** the unit's gradient sum over my micro-batches
    /// (padded, whole unit): I keep my shard of the sum over all ranks.
    /// On the communication stream (`on_stream`) the sum is handed over and
    /// the call returns at once ([`FsdpUnit::reduce_scatter_async`]); `grads`
    /// is left empty.
    pub fn reduce_scatter(&mut self, w: &World, grads: &mut MicroBatchSum) {
        if self.on_stream {
            return self.reduce_scatter_async(w, grads); // --prefetch, --overlap-comm (prefetch.rs)
        }
        self.comms.shard.reduce_scatter_sum(grads, &mut self.grad);
        if let Some(replicas) = self.comms.replica {
            // HSDP: that partial sum added across the groups holding the
            // same shard — the pairwise tree over the groups
            // (`SumGroups::hsdp_same_bits` says when that is the plain order's).
            all_reduce_shard(replicas, &mut self.grad);
        }
    }

    /// AdamW on my shard, with the gradient scaled by `f` (the mean's 1/M
    /// already applied: [`update_all`]); a kept unsharded copy is then
    /// refreshed by an all-gather of the new weights.
    pub fn update(&mut self, w: &World, f: Option<f32>) -> candle_core::Result<()> {
        self.wait_grad(w);
        if let Some(f) = f {
            self.grad.iter_mut().for_each(|g| *g *= f);
        }
        self.opt.step(&mut self.master, &self.grad);
        if self.unsharded.is_some() {
            self.unsharded = None; // free the old copy before the new one arrives
            self.unsharded = Some(self.gather()?);
        }
        Ok(())
    }
}

/// Every unit of the model on this rank, root first: my shard of each, cut
/// from `start` (the seed's weights, or a checkpoint's with AdamW's moments):
/// FSDP2's `fully_shard(unit, mesh=comms, reshard_after_forward=…, mp_policy=mp)`.
/// `reshard_after_forward` `true` (this lesson, FSDP2's default): a unit's
/// parameters are freed after every use and gathered again for the next, twice
/// per step. `false` (ZeRO-1 and ZeRO-2, lesson 04): they stay unsharded from
/// step to step, refreshed by one all-gather after the update, where FSDP2
/// frees them after backward and gathers again next step: the same bytes, at another time.
pub fn build_units<'w>(
    s: &Session,
    blocks_per_unit: usize,
    start: &Start,
    comms: UnitComms<'w>,
    reshard_after_forward: bool,
    mp: MixedPrecision,
) -> anyhow::Result<Vec<FsdpUnit<'w>>> {
    unit_params(&s.table, s.cfg.n_layer, blocks_per_unit)
        .into_iter()
        .map(|(name, params)| FsdpUnit::new(s, name, params, start, comms, reshard_after_forward, mp))
        .collect()
}

// ANCHOR: model_ranges
/// The model-order positions of my shard of the unit made of `params` (in
/// that order): the unit's flat vector is its parameters back to back, my
/// shard is `layout.shard(rank)` of it, padding excluded.
pub fn model_ranges(table: &ParamTable, params: &[usize], layout: ShardLayout, rank: usize) -> Vec<Range<usize>> {
    let shard = layout.shard(rank);
    let (lo, hi) = (shard.offset, shard.offset + layout.real_len(rank));
    let mut at = 0; // where the current parameter starts in the unit's flat vector
    let mut out = vec![];
    for &i in params {
        let spec = &table.specs[i];
        let (a, b) = (lo.max(at), hi.min(at + spec.numel()));
        if a < b {
            out.push(spec.offset + a - at..spec.offset + b - at);
        }
        at += spec.numel();
    }
    out
}
// ANCHOR_END: model_ranges

// ANCHOR: update_all
/// The update of every unit: the mean gradient (× `inv`, 1/M), clipped
/// under `--grad-clip` by the global norm over every unit's shard (one
/// exact sum gathered from the ranks), then AdamW on each shard.
pub fn update_all(units: &mut [FsdpUnit], s: &Session, inv: f32) -> candle_core::Result<()> {
    for u in units.iter_mut() {
        u.wait_grad(s.world); // the last reduce-scatters in flight
        u.grad.iter_mut().for_each(|g| *g *= inv);
    }
    let f = match s.args.grad_clip {
        None => None, // no norm to pay for
        Some(_) => {
            // Over the ranks that share the model: under HSDP my shard group
            // only, since every replica group holds the same shards.
            let comm = units[0].comms.shard;
            let shards: Vec<&[f32]> = units.iter().map(|u| u.grad.as_slice()).collect();
            s.clip_factor_of(exercise!(3, 2, global_norm(comm, &shards))) // exercise 3.2
        }
    };
    for u in units.iter_mut() {
        u.update(s.world, f)?;
    }
    Ok(())
}
// ANCHOR_END: update_all
