//! FSDP units: which parameters are gathered, computed and freed together,
//! and each unit's shard of the weights, of their gradient and of AdamW's
//! `m` and `v`. Lesson 04's stage 3 reuses them.
//!
//! Unit 0 is the **root**: `wte`, `wpe` and the final LayerNorm. The tied
//! `wte` is both the embedding and the lm_head, so it must live in one unit
//! that is used at both ends of the model (PyTorch FSDP has the same rule:
//! tied parameters share a unit). Units 1.. hold `blocks_per_unit`
//! consecutive transformer blocks each.
use std::ops::Range;

use fsdp_comm::{ShardLayout, World};
use fsdp_gpt::params::PARAMS_PER_BLOCK;
use fsdp_gpt::{AdamW, AdamWConfig, ParamTable, Unit};

// ANCHOR: unit_params
/// The parameter-table entries of each unit, root first: `(name, entries)`.
pub fn unit_params(table: &ParamTable, n_layer: usize, blocks_per_unit: usize) -> Vec<(String, Vec<usize>)> {
    let g = blocks_per_unit.max(1);
    let mut root: Vec<usize> = table.unit_params(Unit::Embedding).collect();
    root.extend(table.unit_params(Unit::FinalNorm));
    let mut units = vec![("root".to_string(), root)];
    for first in (0..n_layer).step_by(g) {
        let last = (first + g).min(n_layer) - 1;
        let name = if first == last { format!("h.{first}") } else { format!("h.{first}-{last}") };
        let entries = (first..=last).flat_map(|b| table.unit_params(Unit::Block(b))).collect();
        units.push((name, entries));
    }
    units
}
// ANCHOR_END: unit_params

/// One unit on one rank: everything about it is sharded between steps.
pub struct FsdpUnit {
    pub name: String,
    /// Parameter-table entries, in the unit's flat order.
    pub params: Vec<usize>,
    /// Where each entry of `params` sits in the unit's flat vector.
    pub ranges: Vec<Range<usize>>,
    /// How many blocks the unit runs (0 for the root).
    pub blocks: usize,
    pub layout: ShardLayout,
    /// My shard of the unit's fp32 weights (padding included).
    pub master: Vec<f32>,
    /// My shard of the unit's gradient, after the reduce-scatter.
    pub grad: Vec<f32>,
    /// AdamW on my shard only: `m` and `v` are 1/N of the unit each.
    opt: AdamW,
}

impl FsdpUnit {
    /// Cuts my shard out of the unit's part of the initial weights `init`
    /// (the whole model's flat vector, the same on every rank).
    pub fn new(table: &ParamTable, name: String, params: Vec<usize>, init: &[f32], rank: usize, world: usize, adamw: AdamWConfig) -> Self {
        let mut flat = Vec::new();
        let mut ranges = Vec::new();
        for &i in &params {
            let r = table.specs[i].range();
            ranges.push(flat.len()..flat.len() + r.len());
            flat.extend_from_slice(&init[r]);
        }
        let layout = ShardLayout::new(flat.len(), world);
        flat.resize(layout.padded, 0.0);
        let master = flat[layout.shard(rank).range()].to_vec();
        let blocks = params.len() / PARAMS_PER_BLOCK;
        Self { name, params, ranges, blocks, layout, master, grad: vec![0.0; layout.shard_len], opt: AdamW::new(adamw, layout.shard_len) }
    }

    /// **all-gather**: the whole unit, padded, in a freshly allocated buffer
    /// (the caller frees it by dropping it).
    pub fn gather(&self, w: &World) -> Vec<f32> {
        let mut full = vec![0.0; self.layout.padded];
        w.all_gather(&self.master, &mut full);
        full
    }

    /// **reduce-scatter** the unit's gradient sum over my micro-batches
    /// (padded, whole unit): I keep the rank-ordered sum of my shard.
    pub fn reduce_scatter(&mut self, w: &World, sum: &[f32]) {
        w.reduce_scatter(sum, &mut self.grad);
    }

    /// AdamW on my shard, with the gradient scaled by `inv` (1 / micro-batches).
    pub fn update(&mut self, inv: f32) {
        self.grad.iter_mut().for_each(|g| *g *= inv);
        self.opt.step(&mut self.master, &self.grad);
    }

    /// Copies a gathered unit's parameters to their places in the model's flat vector.
    pub fn place(&self, table: &ParamTable, gathered: &[f32], model: &mut [f32]) {
        for (&i, r) in self.params.iter().zip(&self.ranges) {
            model[table.specs[i].range()].copy_from_slice(&gathered[r.clone()]);
        }
    }
}

/// Every unit of the model on this rank, root first.
pub fn build_units(table: &ParamTable, n_layer: usize, blocks_per_unit: usize, init: &[f32], rank: usize, world: usize, adamw: AdamWConfig) -> Vec<FsdpUnit> {
    unit_params(table, n_layer, blocks_per_unit)
        .into_iter()
        .map(|(name, params)| FsdpUnit::new(table, name, params, init, rank, world, adamw))
        .collect()
}
