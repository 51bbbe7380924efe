//! The config table every lesson prints once, on rank 0, with the derived
//! quantities (nanoGPT's "tokens per iteration will be: …"): the session's
//! rows, then the lesson's own.
use fsdp_gpt::kernels::Probs;

use crate::session::Session;
use crate::table::{Table, thousands};

impl Session<'_> {
    /// The config table, printed once by rank 0, with derived quantities.
    pub fn print_config(&self, extra: &[(&str, String)]) {
        let c = &self.cfg;
        let (n, m) = (self.world.size(), self.sampler.micro_batches);
        let mut t = Table::new(["config", "value"]);
        t.row(["lesson".to_string(), format!("{} — {}", self.lesson.package, self.lesson.title)]);
        t.row(["world size".to_string(), format!("{n} rank{}", if n == 1 { "" } else { "s" })]);
        t.row([
            "preset".to_string(),
            format!(
                "{} ({} layers, {} heads, n_embd {}, block {})",
                self.args.preset, c.n_layer, c.n_head, c.n_embd, c.block_size
            ),
        ]);
        t.row(["parameters".to_string(), thousands(self.table.numel() as u64)]);
        t.row([
            "data".to_string(),
            format!(
                "{} ({} chars, vocab {})",
                self.corpus.source,
                thousands(self.corpus.tokens.len() as u64),
                c.vocab_size
            ),
        ]);
        t.row(["micro-batch".to_string(), format!("{} × {} tokens", self.sampler.batch_size, self.sampler.seq_len)]);
        t.row(["micro-batches per step".to_string(), format!("{m} ({} per rank)", m / n)]);
        t.row(["tokens per step".to_string(), thousands(self.sampler.tokens_per_step() as u64)]);
        t.row(["steps".to_string(), thousands(self.args.steps)]);
        let g = self.sum_groups.groups;
        if self.sum_groups_given {
            t.row([
                "gradient sum groups".to_string(),
                format!("{g} ({} per rank; same bits at any world size dividing {g})", g / n),
            ]);
        }
        if let Some((from, step, saved_world)) = &self.resumed_from {
            t.row([
                "resumed from".to_string(),
                format!(
                    "{} (step {step}, saved by {saved_world} rank{})",
                    from.display(),
                    if *saved_world == 1 { "" } else { "s" }
                ),
            ]);
        }
        if let Some(dir) = &self.args.ckpt {
            let every = self
                .args
                .save_every
                .map_or("at the last step".to_string(), |k| format!("every {k} steps and at the last"));
            t.row(["checkpoints".to_string(), format!("{} ({every}; keep {})", dir.display(), self.args.keep)]);
        }
        let a = &self.adamw;
        t.row([
            "AdamW".to_string(),
            format!(
                "lr {}, betas ({}, {}), eps {:e}, weight decay {} on 2-D tensors",
                a.lr, a.beta1, a.beta2, a.eps, a.weight_decay
            ),
        ]);
        t.row(["seed".to_string(), self.args.seed.to_string()]);
        if let Some(c) = self.args.grad_clip {
            t.row([
                "gradient clipping".to_string(),
                format!("by the global norm to {c} (its sum of squares exact over every shard)"),
            ]);
        }
        if self.model.probs == Probs::Recompute {
            let (b, seq) = self.micro_batch_shape();
            t.row([
                "attention probabilities".to_string(),
                format!(
                    "not kept, recomputed in backward: {b} × {} × {seq} × {seq} per block (B, nh, T, T); under block recompute as well",
                    c.n_head
                ),
            ]);
        }
        let mine = crate::exercise::mine_list();
        if !mine.is_empty() {
            t.row([
                "your code".to_string(),
                format!("exercise {} (src/exercises.rs), the answers elsewhere", mine.join(", ")),
            ]);
        }
        if let Some(b) = self.args.mem_budget {
            t.row([
                "memory budget per rank".to_string(),
                format!("{} (counting allocator, like a GPU's memory)", crate::table::mb(b)),
            ]);
        }
        t.row([
            "compute threads per rank".to_string(),
            std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "1".into()),
        ]);
        for (k, v) in extra {
            t.row([k.to_string(), v.clone()]);
        }
        if let Some(stream) = self.world.stream() {
            t.row([
                "communication thread".to_string(),
                match (stream.eager, stream.realtime) {
                    (true, true) => "its own communicator; real-time priority (wakes at once)".into(),
                    (true, false) => match std::env::var_os("FSDP_STREAM_NORMAL") {
                        Some(_) => "its own communicator; default priority (FSDP_STREAM_NORMAL is set)".into(),
                        None => "its own communicator; default priority (real-time needs root or CAP_SYS_NICE)".into(),
                    },
                    (false, _) => {
                        "its own communicator; default priority, polls backing off: more ranks than cores".into()
                    }
                },
            ]);
        }
        crate::print0!("{}", t.render());
        for note in &self.resume_notes {
            crate::print0!("note: {note}");
        }
    }
}

/// The config table's line for the activation policy.
pub fn recompute_note(recompute: bool) -> String {
    match recompute {
        true => "recomputed block by block (--recompute): inputs kept, one more forward".into(),
        false => "kept for backward (on each block's tape)".into(),
    }
}
