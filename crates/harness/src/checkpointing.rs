//! What a [`Session`] does with checkpoints: checks the flags, checks a
//! checkpoint against this run before resuming it, and saves one — all
//! ranks together, so a failure anywhere ends every rank with one line.
//! The file format is in [`crate::checkpoint`].
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, anyhow, bail};
use fsdp_comm::{SumGroups, World};

use crate::checkpoint::{self, AdamWMeta, DataMeta, FileMeta, Meta, ModelMeta, ShardPiece, UnitMeta};
use crate::cli::TrainArgs;
use crate::edge::agree;
use crate::session::Session;
use crate::table::mb;

/// `--ckpt`, `--save-every`, `--resume`: consistent, and the folder writable.
pub fn check_paths(world: &World, args: &TrainArgs) -> anyhow::Result<()> {
    if args.save_every.is_some() && args.ckpt.is_none() {
        bail!("--save-every needs --ckpt DIR: the folder to write checkpoints into");
    }
    let Some(dir) = &args.ckpt else { return Ok(()) };
    let canonical = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let resuming_here = args.resume.as_ref().and_then(|r| checkpoint::resolve(r, "--resume").ok()).is_some_and(|r| {
        canonical(&r).parent() == Some(canonical(dir).as_path())
    });
    if !resuming_here && (dir.join("latest").exists() || !checkpoint::list(dir).is_empty()) {
        bail!(
            "--ckpt {} already holds checkpoints of another run: pass --resume {} to continue it, or choose an empty folder",
            dir.display(),
            dir.display()
        );
    }
    if world.is_root() {
        // Try writing there now rather than after the first steps; leave no
        // trace (the first save creates the folder for real).
        let created: Vec<&Path> = dir.ancestors().take_while(|p| !p.as_os_str().is_empty() && !p.exists()).collect();
        let probe = dir.join(".write-test");
        let tried = std::fs::create_dir_all(dir).and_then(|_| std::fs::write(&probe, b"ok")).and_then(|_| std::fs::remove_file(&probe));
        for p in &created {
            let _ = std::fs::remove_dir(p); // deepest first
        }
        tried.map_err(|e| anyhow!("--ckpt {}: cannot write there ({e}): pass a writable folder", dir.display()))?;
    }
    Ok(())
}

/// `--sum-groups`, else the grouping a checkpoint was saved with `--sum-groups`
/// under, else one group per rank; and whether it was chosen (not the default).
pub fn sum_groups(args: &TrainArgs, world: usize, meta: Option<&Meta>) -> anyhow::Result<(SumGroups, bool)> {
    let m = args.micro_batches.expect("resolved by the session") as usize;
    let g = match (args.sum_groups, meta) {
        (Some(g), _) => g as usize,
        (None, Some(meta)) if meta.sum_groups_given && meta.sum_groups % world != 0 => bail!(
            "the checkpoint summed each step's gradients in {g} group(s); {world} ranks cannot split them: resume on a world size dividing {g}, \
             or pass --sum-groups (a multiple of {world}) to continue with another rounding (then not bit for bit an uninterrupted run)",
            g = meta.sum_groups
        ),
        (None, Some(meta)) if meta.sum_groups_given => meta.sum_groups,
        (None, _) => world,
    };
    let given = args.sum_groups.is_some() || meta.is_some_and(|m| m.sum_groups_given);
    Ok((SumGroups::new(g, m, world).map_err(|e| anyhow!(e))?, given))
}

/// What a resumed run does differently from the uninterrupted run the
/// checkpoint came from: a line for each, printed and kept in report.json.
pub fn resume_notes(meta: &Meta, now: SumGroups) -> Vec<String> {
    let (m_then, m_now) = (meta.data.micro_batches, now.micro_batches);
    if m_then != m_now {
        return vec![format!(
            "--micro-batches {m_now} where the checkpoint trained with {m_then}: the global batch changes from step {} on, so this is another run from here",
            meta.step + 1
        )];
    }
    let then = SumGroups { groups: meta.sum_groups, micro_batches: m_then, world: meta.world_size };
    if then.same_order(&now) {
        return vec![];
    }
    vec![format!(
        "the gradients are summed in another order than the checkpoint's run ({} rank{} then, {} now): training continues, but differs from an uninterrupted run by rounding (for the same bits, resume on a power-of-two world size dividing {m_now}, or save with --sum-groups G and resume on a divisor of G)",
        meta.world_size,
        if meta.world_size == 1 { "" } else { "s" },
        now.world
    )]
}

/// FNV-1a of the token ids: equal digests, equal batches.
fn tokens_digest(tokens: &[u32]) -> String {
    format!("{:016x}", fsdp_gpt::params::fnv1a(tokens.iter().flat_map(|t| t.to_le_bytes())))
}

fn model_meta(s: &Session) -> ModelMeta {
    let c = &s.cfg;
    ModelMeta {
        preset: s.args.preset.clone(),
        vocab_size: c.vocab_size,
        block_size: c.block_size,
        n_layer: c.n_layer,
        n_head: c.n_head,
        n_embd: c.n_embd,
        params: s.table.numel(),
    }
}

fn data_meta(s: &Session, next_step: u64) -> DataMeta {
    DataMeta {
        source: s.corpus.source.clone(),
        vocab: s.corpus.vocab_string(),
        tokens: s.corpus.tokens.len(),
        tokens_digest: tokens_digest(&s.corpus.tokens),
        batch_size: s.sampler.batch_size,
        seq_len: s.sampler.seq_len,
        micro_batches: s.sampler.micro_batches,
        seed: s.args.seed,
        next_step,
    }
}

/// Before resuming: the checkpoint must come from this lesson, this model,
/// this data and these hyper-parameters. The error names the flag to fix.
pub fn check_resume(s: &Session, meta: &Meta) -> anyhow::Result<()> {
    let at = s.args.resume.as_deref().map_or(String::new(), |p| p.display().to_string());
    if meta.lesson != s.lesson.package {
        bail!(
            "checkpoint {at} was written by {}, not {}: resume it with that lesson (`just step {} …`), or export its weights with fsdp-export",
            meta.lesson,
            s.lesson.package,
            meta.lesson.trim_start_matches("step").get(..2).unwrap_or("NN")
        );
    }
    let mismatch = |flag: &str, theirs: String, ours: String| -> anyhow::Result<()> {
        if theirs != ours {
            bail!("checkpoint {at} was trained with {flag} {theirs}; this run has {flag} {ours}: pass {flag} {theirs} to resume it");
        }
        Ok(())
    };
    mismatch("--preset", meta.model.preset.clone(), s.args.preset.clone())?;
    let data = data_meta(s, 0);
    if meta.data.vocab != data.vocab || meta.data.tokens_digest != data.tokens_digest {
        let how = if meta.data.source == "generated" { "drop --data".to_string() } else { format!("pass --data {}", meta.data.source) };
        bail!(
            "checkpoint {at} was trained on other data ({}: {} chars, vocab {}); this run reads {} ({} chars, vocab {}): {how}",
            meta.data.source,
            meta.data.tokens,
            meta.data.vocab.chars().count(),
            data.source,
            data.tokens,
            data.vocab.chars().count()
        );
    }
    if meta.model != model_meta(s) {
        bail!("checkpoint {at} holds a model of another shape ({} parameters, this run {}): pass --preset {}", meta.model.params, s.table.numel(), meta.model.preset);
    }
    mismatch("--batch-size", meta.data.batch_size.to_string(), data.batch_size.to_string())?;
    mismatch("--seq-len", meta.data.seq_len.to_string(), data.seq_len.to_string())?;
    mismatch("--seed", meta.data.seed.to_string(), data.seed.to_string())?;
    mismatch("--lr", meta.adamw.lr.to_string(), s.adamw.lr.to_string())?;
    mismatch("--weight-decay", meta.adamw.weight_decay.to_string(), s.adamw.weight_decay.to_string())?;
    for (flag, theirs) in &meta.lesson_flags {
        let ours = s.lesson_flags.iter().find(|(f, _)| f == flag).map_or(String::new(), |(_, v)| v.clone());
        mismatch(flag, theirs.clone(), ours)?;
    }
    if meta.step >= s.args.steps {
        bail!("checkpoint {at} is at step {}; --steps {} leaves nothing to train: pass --steps {} or more", meta.step, s.args.steps, meta.step + 1);
    }
    Ok(())
}

impl Session<'_> {
    /// Whether a checkpoint is due after `step`: every `--save-every` steps
    /// and at the last step, when `--ckpt` is set.
    pub fn checkpoint_due(&self, step: u64) -> bool {
        self.args.ckpt.is_some() && (step == self.args.steps || self.args.save_every.is_some_and(|k| step % k == 0))
    }

    /// Saves this rank's `pieces` as part of the checkpoint of `step`
    /// (every rank calls). Not counted in the traffic, the budget or the
    /// measured peak: it is not training, and on a GPU it happens in host memory.
    /// `pieces` is called inside: copies it makes (lesson 01's shard of its
    /// replicated state) are host-side too.
    pub fn save_checkpoint<'a>(&self, step: u64, pieces: impl FnOnce() -> Vec<ShardPiece<'a>>) -> anyhow::Result<()> {
        let w = self.world;
        let Some(ckpt) = self.args.ckpt.as_deref() else { return Ok(()) };
        crate::stop::while_writing(|| crate::alloc::host_side(|| w.untracked(|| self.save_untracked(ckpt, step, &pieces()))))
    }

    fn save_untracked(&self, ckpt: &Path, step: u64, pieces: &[ShardPiece]) -> anyhow::Result<()> {
        let (w, t0) = (self.world, Instant::now());
        let partial = checkpoint::partial_dir(ckpt, step);
        // 1. rank 0 clears what a killed save left and makes the partial folder
        let prepared = match w.is_root() {
            true => {
                checkpoint::remove_partials(ckpt);
                checkpoint::abandon_from(ckpt, step)
                    .and_then(|_| std::fs::create_dir_all(&partial).with_context(|| format!("cannot create checkpoint folder {}", partial.display())))
            }
            false => Ok(()),
        };
        agree(w, prepared)?;
        let saved = self.write_and_commit(ckpt, &partial, step, pieces, t0);
        if saved.is_err() && w.is_root() {
            // A failed save (a full disk, say) must not keep holding the space:
            // every rank is past its write (the failure was agreed on).
            let _ = std::fs::remove_dir_all(&partial);
        }
        saved
    }

    /// Steps 2–4 of a save, into the `partial` folder rank 0 made.
    fn write_and_commit(&self, ckpt: &Path, partial: &Path, step: u64, pieces: &[ShardPiece], t0: Instant) -> anyhow::Result<()> {
        let w = self.world;
        // 2. every rank writes and fsyncs its own shard
        let name = checkpoint::shard_file_name(w.rank(), w.size());
        let written = checkpoint::shard_bytes(pieces, w.rank(), w.size(), step).and_then(|bytes| {
            checkpoint::write_synced(&partial.join(&name), &bytes).with_context(|| format!("cannot write checkpoint shard {}", partial.join(&name).display()))?;
            Ok((bytes.len() as u64, checkpoint::sha256_hex(&bytes)))
        });
        failpoint_kill_during_save(w, step);

        // 3. rank 0 learns every shard's size and checksum
        let mut record = [0u8; 41];
        if let Ok((bytes, sha)) = &written {
            record[0] = 1;
            record[1..9].copy_from_slice(&bytes.to_le_bytes());
            record[9..41].copy_from_slice(&hex_to_bytes(sha));
        }
        let all = w.gather_control(&record);
        agree(w, written.map(|_| ()))?;

        // 4. rank 0 writes meta.json, commits by renaming, moves `latest`, prunes
        let committed = match w.is_root() {
            false => Ok(None),
            true => {
                let files = all
                    .chunks_exact(41)
                    .enumerate()
                    .map(|(r, c)| FileMeta {
                        rank: r,
                        path: checkpoint::shard_file_name(r, w.size()),
                        bytes: u64::from_le_bytes(c[1..9].try_into().expect("8 bytes")),
                        sha256: c[9..41].iter().map(|b| format!("{b:02x}")).collect(),
                    })
                    .collect::<Vec<_>>();
                let total: u64 = files.iter().map(|f| f.bytes).sum();
                let meta = Meta {
                    format: checkpoint::FORMAT.to_string(),
                    lesson: self.lesson.package.to_string(),
                    step,
                    world_size: w.size(),
                    sum_groups: self.sum_groups.groups,
                    sum_groups_given: self.sum_groups_given,
                    model: model_meta(self),
                    data: data_meta(self, step + 1),
                    adamw: AdamWMeta {
                        lr: self.adamw.lr,
                        beta1: self.adamw.beta1,
                        beta2: self.adamw.beta2,
                        eps: self.adamw.eps,
                        weight_decay: self.adamw.weight_decay,
                        t: step as u32,
                    },
                    lesson_flags: self.lesson_flags.clone(),
                    units: pieces
                        .iter()
                        .map(|p| UnitMeta { name: p.name.clone(), params: p.params.clone(), numel: p.params.iter().map(|&i| self.table.specs[i].numel()).sum() })
                        .collect(),
                    files,
                };
                checkpoint::commit(ckpt, &meta, self.args.keep as usize)
                    .with_context(|| format!("cannot commit checkpoint {}", ckpt.display()))
                    .map(|dir| Some((dir, total)))
            }
        };
        if let Ok(Some((dir, total))) = &committed {
            println!("checkpoint: step {step} → {} ({} shard file{}, {} in all, {:.2} s)", dir.display(), w.size(), if w.size() == 1 { "" } else { "s" }, mb(*total), t0.elapsed().as_secs_f64());
        }
        agree(w, committed.map(|_| ()))
    }
}

fn hex_to_bytes(hex: &str) -> [u8; 32] {
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap_or(0);
    }
    out
}

/// Fault injection for the tests: `FSDP_FAILPOINT=kill-during-save:STEP`
/// makes the last rank SIGKILL itself right after writing its shard of
/// step STEP's checkpoint — before the checkpoint is committed.
fn failpoint_kill_during_save(w: &World, step: u64) {
    let Ok(spec) = std::env::var("FSDP_FAILPOINT") else { return };
    if spec.strip_prefix("kill-during-save:").and_then(|s| s.parse::<u64>().ok()) == Some(step) && w.rank() == w.size() - 1 {
        eprintln!("failpoint: rank {} kills itself (SIGKILL) during the save of step {step}", w.rank());
        // SAFETY: raise has no preconditions; SIGKILL ends the process here.
        unsafe { libc::raise(libc::SIGKILL) };
    }
}
