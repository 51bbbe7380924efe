//! Before training: the checkpoint flags are consistent, and a checkpoint
//! to resume comes from this very run (lesson, model, data, hyper-parameters);
//! which summation order the resumed run uses, and what it does differently
//! from an uninterrupted run. The file format is in [`crate::checkpoint`];
//! the collective save in [`crate::save`].
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail};
use fsdp_comm::{SumGroups, World};
use fsdp_gpt::{AdamWConfig, Corpus, GptConfig, Sampler};

use crate::checkpoint::{self, AdamWMeta, DataMeta, Meta, ModelMeta};
use crate::cli::TrainArgs;

/// `--ckpt`, `--save-every`, `--resume`: consistent, the folder writable and
/// this job's alone: rank 0 takes its lock (held to the end; [`release_ckpt_lock`]).
pub fn check_paths(world: &World, args: &TrainArgs, lesson: &str) -> anyhow::Result<()> {
    if args.save_every.is_some() && args.ckpt.is_none() {
        bail!("--save-every needs --ckpt DIR: the folder to write checkpoints into");
    }
    let Some(dir) = &args.ckpt else { return Ok(()) };
    let canonical = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let resuming_here = args
        .resume
        .as_ref()
        .and_then(|r| checkpoint::resolve(r, "--resume").ok())
        .is_some_and(|r| canonical(&r).parent() == Some(canonical(dir).as_path()));
    if !world.is_root() {
        return Ok(());
    }
    // Try writing there now rather than after the first steps. The folder
    // stays while the job runs (it holds the lock); folders made here are
    // removed at the end if nothing was saved in them.
    let created: Vec<PathBuf> =
        dir.ancestors().take_while(|p| !p.as_os_str().is_empty() && !p.exists()).map(Path::to_path_buf).collect();
    let probe = dir.join(".write-test");
    let tried = std::fs::create_dir_all(dir)
        .and_then(|_| std::fs::write(&probe, b"ok"))
        .and_then(|_| std::fs::remove_file(&probe));
    let remove_created = || created.iter().for_each(|p| _ = std::fs::remove_dir(p)); // deepest first
    if let Err(e) = tried {
        remove_created();
        bail!("--ckpt {}: cannot write there ({e}): pass a writable folder", dir.display());
    }
    let who = format!("host {}, pid {}, {lesson} on {} rank(s)", hostname(), std::process::id(), world.size());
    let lock = match checkpoint::FolderLock::take(dir, &who) {
        // A file system without locks (NFS without lockd, Lustre without -o flock): go on, and say so.
        Err(e) if [libc::ENOLCK, libc::EOPNOTSUPP, libc::ENOSYS].contains(&e.raw_os_error().unwrap_or(0)) => {
            crate::print0!(
                "note: --ckpt {}: its file system cannot lock ({e}): nothing stops another job from writing there too",
                dir.display()
            );
            None
        }
        Ok(checkpoint::Taken::Held(lock, stale)) => {
            if let Some(dead) = stale {
                crate::print0!(
                    "note: --ckpt {}: its lock was left by a job that ended without releasing it ({dead}): taken over",
                    dir.display()
                );
            }
            Some(lock)
        }
        Ok(checkpoint::Taken::Busy(holder)) => {
            remove_created();
            bail!(
                "--ckpt {} is in use by another job ({holder}): wait for it to end, or pass another folder",
                dir.display()
            )
        }
        Err(e) => {
            remove_created();
            bail!("--ckpt {}: cannot lock it ({e}): pass a folder on a file system with flock", dir.display())
        }
    };
    // Checked with the lock held: a job that saved meanwhile is seen.
    if !resuming_here && (dir.join("latest").exists() || !checkpoint::list(dir).is_empty()) {
        bail!(
            "--ckpt {} already holds checkpoints of another run: pass --resume {} to continue it, or choose an empty folder",
            dir.display(),
            dir.display()
        );
    }
    *CKPT_LOCK.lock().unwrap_or_else(|e| e.into_inner()) = Some(HeldFolder { lock, created });
    Ok(())
}

/// The `--ckpt` folder rank 0 holds, and the folders it made for it.
struct HeldFolder {
    lock: Option<checkpoint::FolderLock>,
    created: Vec<PathBuf>,
}

impl Drop for HeldFolder {
    fn drop(&mut self) {
        drop(self.lock.take()); // first the lock file, then any folder left empty
        self.created.iter().for_each(|p| _ = std::fs::remove_dir(p));
    }
}

static CKPT_LOCK: std::sync::Mutex<Option<HeldFolder>> = std::sync::Mutex::new(None);

/// Releases the `--ckpt` folder's lock, if this process holds it: at the end
/// of a job, however it ends short of a kill (`launch`).
pub fn release_ckpt_lock() {
    if let Ok(mut held) = CKPT_LOCK.try_lock() {
        held.take();
    }
}

/// This machine's name, as the lock names its holder.
fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    if ok { String::from_utf8_lossy(&buf[..end]).into_owned() } else { "unknown".to_string() }
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
    let ranks = meta.world_size * meta.replicas; // the run's ranks (under HSDP, more than its shards)
    let then = SumGroups { groups: meta.sum_groups, micro_batches: m_then, world: ranks };
    if then.same_order(&now) {
        return vec![];
    }
    vec![format!(
        "the gradients are summed in another order than the checkpoint's run ({} rank{} then, {} now): training continues, but differs from an uninterrupted run by rounding (for the same bits, resume on a power-of-two world size dividing {m_now}, or save with --sum-groups G and resume on a divisor of G)",
        ranks,
        if ranks == 1 { "" } else { "s" },
        now.world
    )]
}

/// FNV-1a of the token ids: equal digests, equal batches.
fn tokens_digest(tokens: &[u32]) -> String {
    format!("{:016x}", fsdp_gpt::params::fnv1a(tokens.iter().flat_map(|t| t.to_le_bytes())))
}

/// What makes this run this run, as a checkpoint records it: the lesson,
/// the model, the data and batch, AdamW, and the lesson's own flags.
#[derive(Debug, Clone)]
pub struct ThisRun {
    pub lesson: String,
    pub model: ModelMeta,
    pub data: DataMeta,
    pub adamw: AdamWMeta,
    pub lesson_flags: Vec<(String, String)>,
}

/// The model as a checkpoint records it.
pub fn model_meta(preset: &str, cfg: &GptConfig, params: usize) -> ModelMeta {
    ModelMeta {
        preset: preset.to_string(),
        vocab_size: cfg.vocab_size,
        block_size: cfg.block_size,
        n_layer: cfg.n_layer,
        n_head: cfg.n_head,
        n_embd: cfg.n_embd,
        params,
    }
}

/// The data and the batch as a checkpoint records them (`next_step` is the save's).
pub fn data_meta(corpus: &Corpus, sampler: &Sampler, seed: u64) -> DataMeta {
    DataMeta {
        source: corpus.source.clone(),
        vocab: corpus.vocab_string(),
        tokens: corpus.tokens.len(),
        tokens_digest: tokens_digest(&corpus.tokens),
        batch_size: sampler.batch_size,
        seq_len: sampler.seq_len,
        micro_batches: sampler.micro_batches,
        seed,
        next_step: 0,
    }
}

/// AdamW's settings as a checkpoint records them (`t` is the save's).
pub fn adamw_meta(a: &AdamWConfig) -> AdamWMeta {
    AdamWMeta { lr: a.lr, beta1: a.beta1, beta2: a.beta2, eps: a.eps, weight_decay: a.weight_decay, t: 0 }
}

impl ThisRun {
    /// Before resuming: the checkpoint must come from this lesson, this model,
    /// this data and these hyper-parameters. The error names the flag to fix.
    pub fn check_resume(&self, args: &TrainArgs, meta: &Meta) -> anyhow::Result<()> {
        let at = args.resume.as_deref().map_or(String::new(), |p| p.display().to_string());
        if meta.lesson != self.lesson {
            bail!(
                "checkpoint {at} was written by {}, not {}: resume it with that lesson (`just step {} …`), or export its weights with fsdp-export",
                meta.lesson,
                self.lesson,
                meta.lesson.trim_start_matches("step").get(..2).unwrap_or("NN")
            );
        }
        let mismatch = |flag: &str, theirs: String, ours: String| -> anyhow::Result<()> {
            if theirs != ours {
                let has = if ours.is_empty() { format!("no {flag}") } else { format!("{flag} {ours}") };
                bail!(
                    "checkpoint {at} was trained with {flag} {theirs}; this run has {has}: pass {flag} {theirs} to resume it"
                );
            }
            Ok(())
        };
        mismatch("--preset", meta.model.preset.clone(), args.preset.clone())?;
        let data = &self.data;
        if meta.data.vocab != data.vocab || meta.data.tokens_digest != data.tokens_digest {
            let how = if meta.data.source == "generated" {
                "drop --data".to_string()
            } else {
                format!("pass --data {}", meta.data.source)
            };
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
        if meta.model != self.model {
            bail!(
                "checkpoint {at} holds a model of another shape ({} parameters, this run {}): pass --preset {}",
                meta.model.params,
                self.model.params,
                meta.model.preset
            );
        }
        mismatch("--batch-size", meta.data.batch_size.to_string(), data.batch_size.to_string())?;
        mismatch("--seq-len", meta.data.seq_len.to_string(), data.seq_len.to_string())?;
        mismatch("--seed", meta.data.seed.to_string(), data.seed.to_string())?;
        mismatch("--lr", meta.adamw.lr.to_string(), self.adamw.lr.to_string())?;
        mismatch("--weight-decay", meta.adamw.weight_decay.to_string(), self.adamw.weight_decay.to_string())?;
        for (flag, theirs) in &meta.lesson_flags {
            let ours = self.lesson_flags.iter().find(|(f, _)| f == flag).map_or(String::new(), |(_, v)| v.clone());
            mismatch(flag, theirs.clone(), ours)?;
        }
        // Flags recorded only when given change the arithmetic both ways: a clipped resume of an
        // unclipped run too, a bf16 reduction resuming an fp32 one.
        for flag in ["--grad-clip", "--reduce-dtype"] {
            let given = |flags: &[(String, String)]| flags.iter().find(|(f, _)| f == flag).map(|(_, c)| c.clone());
            if let (None, Some(c)) = (given(&meta.lesson_flags), given(&self.lesson_flags)) {
                bail!(
                    "checkpoint {at} was trained without {flag}; this run has {flag} {c}: leave {flag} out to resume it"
                );
            }
        }
        if meta.step >= args.steps {
            bail!(
                "checkpoint {at} is at step {}; --steps {} leaves nothing to train: pass --steps {} or more",
                meta.step,
                args.steps,
                meta.step + 1
            );
        }
        Ok(())
    }
}
