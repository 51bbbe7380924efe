//! Saving a checkpoint: every rank writes its shard, rank 0 commits —
//! all ranks together, so a failure anywhere ends every rank with one line,
//! and a failed save leaves nothing behind. The file format is in
//! [`crate::checkpoint`]; the checks before resuming in [`crate::resume`].
use std::path::Path;
use std::time::Instant;

use anyhow::Context;
use fsdp_comm::World;

use crate::checkpoint::{self, AdamWMeta, DataMeta, FileMeta, Meta, ShardPiece, UnitMeta};
use crate::lesson::agree;
use crate::session::Session;
use crate::table::mb;

impl Session<'_> {
    /// Whether a checkpoint is due after `step`: every `--save-every` steps
    /// and at the last step, when `--ckpt` is set.
    pub fn checkpoint_due(&self, step: u64) -> bool {
        self.args.ckpt.is_some()
            && (step == self.args.steps || self.args.save_every.is_some_and(|k| step.is_multiple_of(k)))
    }

    /// Saves this rank's `pieces` as part of the checkpoint of `step`
    /// (every rank calls). Not counted in the traffic, the budget or the
    /// measured peak: it is not training, and on a GPU it happens in host memory.
    /// `pieces` is called inside: copies it makes (lesson 01's shard of its
    /// replicated state) are host-side too.
    pub fn save_checkpoint<'a>(&self, step: u64, pieces: impl FnOnce() -> Vec<ShardPiece<'a>>) -> anyhow::Result<()> {
        let w = self.world;
        let Some(ckpt) = self.args.ckpt.as_deref() else { return Ok(()) };
        crate::stop::while_writing(|| {
            crate::alloc::host_side(|| w.untracked(|| self.save_untracked(ckpt, step, &pieces())))
        })
    }

    fn save_untracked(&self, ckpt: &Path, step: u64, pieces: &[ShardPiece]) -> anyhow::Result<()> {
        let (w, t0) = (self.world, Instant::now());
        let partial = checkpoint::partial_dir(ckpt, step);
        // 1. rank 0 clears what a killed save left and makes the partial folder
        let prepared = match w.is_root() {
            true => {
                checkpoint::remove_partials(ckpt);
                checkpoint::abandon_from(ckpt, step).and_then(|_| {
                    std::fs::create_dir_all(&partial)
                        .with_context(|| format!("cannot create checkpoint folder {}", partial.display()))
                })
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
    fn write_and_commit(
        &self,
        ckpt: &Path,
        partial: &Path,
        step: u64,
        pieces: &[ShardPiece],
        t0: Instant,
    ) -> anyhow::Result<()> {
        let w = self.world;
        // 2. every rank writes and fsyncs its own shard — under HSDP only the
        // first shard group, ranks 0 … S − 1: the other groups hold the same shards
        let (writes, shard, shards) = match w.mesh_if_split() {
            Some(m) => (m.replica.rank() == 0, m.shard.rank(), m.shard.size()),
            None => (true, w.rank(), w.size()),
        };
        let name = checkpoint::shard_file_name(shard, shards);
        let written = match writes {
            false => Ok((0, "0".repeat(64))), // nothing written, nothing to check
            true => checkpoint::shard_bytes(pieces, shard, shards, step).and_then(|bytes| {
                checkpoint::write_synced(&partial.join(&name), &bytes)
                    .with_context(|| format!("cannot write checkpoint shard {}", partial.join(&name).display()))?;
                Ok((bytes.len() as u64, checkpoint::sha256_hex(&bytes)))
            }),
        };
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
                    .take(shards) // the writers: ranks 0 … S − 1
                    .enumerate()
                    .map(|(r, c)| FileMeta {
                        rank: r,
                        path: checkpoint::shard_file_name(r, shards),
                        bytes: u64::from_le_bytes(c[1..9].try_into().expect("8 bytes")),
                        sha256: c[9..41].iter().map(|b| format!("{b:02x}")).collect(),
                    })
                    .collect::<Vec<_>>();
                let total: u64 = files.iter().map(|f| f.bytes).sum();
                let meta = Meta {
                    format: checkpoint::FORMAT.to_string(),
                    lesson: self.lesson.package.to_string(),
                    step,
                    world_size: shards,
                    replicas: w.size() / shards,
                    sum_groups: self.sum_groups.groups,
                    sum_groups_given: self.sum_groups_given,
                    model: self.this_run.model.clone(),
                    data: DataMeta { next_step: step + 1, ..self.this_run.data.clone() },
                    adamw: AdamWMeta { t: step as u32, ..self.this_run.adamw },
                    lesson_flags: self.this_run.lesson_flags.clone(),
                    units: pieces
                        .iter()
                        .map(|p| UnitMeta {
                            name: p.name.clone(),
                            params: p.params.clone(),
                            numel: p.params.iter().map(|&i| self.table.specs[i].numel()).sum(),
                        })
                        .collect(),
                    files,
                };
                checkpoint::commit(ckpt, &meta, self.args.keep as usize)
                    .with_context(|| format!("cannot commit checkpoint {}", ckpt.display()))
                    .map(|dir| Some((dir, total)))
            }
        };
        if let Ok(Some((dir, _))) = &committed {
            *LAST.lock().unwrap_or_else(|p| p.into_inner()) = Some((dir.clone(), ckpt.to_path_buf()));
        }
        if let Ok(Some((dir, total))) = &committed {
            println!(
                "checkpoint: step {step} → {} ({} shard file{}, {} in all, {:.2} s)",
                dir.display(),
                shards,
                if shards == 1 { "" } else { "s" },
                mb(*total),
                t0.elapsed().as_secs_f64()
            );
        }
        agree(w, committed.map(|_| ()))
    }
}

/// The newest checkpoint this run committed (rank 0), and its `--ckpt` folder.
static LAST: std::sync::Mutex<Option<(std::path::PathBuf, std::path::PathBuf)>> = std::sync::Mutex::new(None);

/// The newest checkpoint this run committed and its `--ckpt` folder (rank 0 only knows).
pub(crate) fn last_checkpoint() -> Option<(std::path::PathBuf, std::path::PathBuf)> {
    LAST.lock().unwrap_or_else(|p| p.into_inner()).clone()
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
    if spec.strip_prefix("kill-during-save:").and_then(|s| s.parse::<u64>().ok()) == Some(step)
        && w.rank() == w.size() - 1
    {
        eprintln!("failpoint: rank {} kills itself (SIGKILL) during the save of step {step}", w.rank());
        // SAFETY: raise has no preconditions; SIGKILL ends the process here.
        unsafe { libc::raise(libc::SIGKILL) };
    }
}
