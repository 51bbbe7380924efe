//! The sharded state read out: checkpoint pieces, the whole weights
//! gathered for the report, and gradient digests for the exercises' checks.
use std::borrow::Cow;

use fsdp_gpt::ParamTable;
use fsdp_harness::Session;
use fsdp_harness::checkpoint::ShardPiece;

use crate::layerwise_shard::LayerwiseShard;
use crate::units::FsdpUnit;

impl FsdpUnit<'_> {
    /// The digest of my shard of the unit's last gradient, as the update
    /// used it (the mean, clipped under --grad-clip): the exercises' checks
    /// name the first unit whose gradient differs from the answer's.
    pub fn grad_digest(&self) -> u64 {
        fsdp_gpt::params::digest_f32(&self.grad)
    }

    /// My shard of the weights and of AdamW's state, for a checkpoint.
    pub fn checkpoint_piece(&self) -> ShardPiece<'_> {
        ShardPiece {
            name: self.name.clone(),
            params: self.params.clone(),
            master: Cow::Borrowed(&self.master),
            m: Cow::Borrowed(&self.opt.m),
            v: Cow::Borrowed(&self.opt.v),
        }
    }

    /// The fp32 master weights of the whole unit (for the final weights file).
    pub fn gather_master(&self) -> Vec<f32> {
        let mut full = vec![0.0; self.layout.padded];
        self.comms.shard.all_gather(&self.master, &mut full);
        full
    }

    /// Copies a gathered unit's parameters to their places in the model's flat vector.
    pub fn place(&self, table: &ParamTable, gathered: &[f32], model: &mut [f32]) {
        for (&i, r) in self.params.iter().zip(&self.ranges) {
            model[table.specs[i].range()].copy_from_slice(&gathered[r.clone()]);
        }
    }
}

impl LayerwiseShard<'_> {
    /// Every unit's gradient digest ([`FsdpUnit::grad_digest`]), in the
    /// order the backward finishes them: the last block first, the root last.
    pub fn grad_digests(&self) -> Vec<(String, String)> {
        self.units.iter().rev().map(|u| (u.name().to_string(), format!("{:016x}", u.grad_digest()))).collect()
    }

    /// My shard of every unit, for a checkpoint.
    pub fn checkpoint_pieces(&self) -> Vec<fsdp_harness::checkpoint::ShardPiece<'_>> {
        self.units.iter().map(FsdpUnit::checkpoint_piece).collect()
    }

    /// The full weights in the model's flat order, gathered unit by unit
    /// (every rank calls; all get them).
    pub fn gather_full(&self, s: &Session) -> Vec<f32> {
        let mut full = vec![0.0; s.table.numel()];
        for u in &self.units {
            u.place(&s.table, &u.gather_master(), &mut full);
        }
        full
    }
}
