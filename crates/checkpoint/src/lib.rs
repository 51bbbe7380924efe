//! # fsdp-checkpoint — sharded checkpoint files
//!
//! Infrastructure, not a lesson: checkpoints that survive a killed rank and
//! load at any world size. (The collective save and the checks before a
//! resume are the harness's `save` and `resume`.)
//!
//! A checkpoint is a folder `DIR/step-000040/` holding one safetensors file
//! per rank — that rank's shard of the fp32 master weights and of AdamW's `m`
//! and `v`, unit by unit — and `meta.json`: the format version, the lesson,
//! the model shape, the data and its position, the sum grouping, each unit's
//! parameters (the layout), and every shard file's size and SHA-256.
//!
//! **Atomic.** Every rank writes into `DIR/.step-000040.partial/` and fsyncs;
//! rank 0 then writes `meta.json`, renames the folder to `step-000040`, and
//! only then points `DIR/latest` at it (itself written to a temporary file
//! and renamed). A kill at any moment leaves `latest` naming a complete
//! checkpoint. `--keep N` removes all but the newest N afterwards.
//!
//! **Any world size, read by need.** [`open`] checks `meta.json` and every
//! shard's size and header, and the SHA-256 of the files it is told to
//! (a run spreads them over its ranks); a [`Reader`] then returns any
//! model-order positions of the master weights, `m` or `v`, reading only
//! the bytes of the shard files that hold them. Each lesson asks for its own
//! shards, exactly as it cuts them from the initial weights, so no rank
//! holds the whole state; [`read`] reassembles all of it (for export).
//!
//! ```no_run
//! use std::path::Path;
//! let (meta, state) = fsdp_checkpoint::read(Path::new("out/ckpt"), "--resume").unwrap();
//! println!("{} at step {}, saved by {} ranks", meta.lesson, state.step, meta.world_size);
//! ```
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, anyhow, bail};
use safetensors::tensor::{Dtype, TensorView};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

mod lock;
pub use lock::{FolderLock, Holder, LOCK, Taken};

use fsdp_comm::ShardLayout;
use fsdp_gpt::weights_file::write_atomically;
use fsdp_gpt::{GptConfig, ParamTable};

/// The format written here; a checkpoint saying anything else is refused.
pub const FORMAT: &str = "fsdp-from-scratch/checkpoint/v2";
const META: &str = "meta.json";
const LATEST: &str = "latest";

/// One unit's shard on this rank, as a lesson hands it over for saving.
pub struct ShardPiece<'a> {
    /// The unit's name (`model` for a flat layout, `root`, `h.0`, …).
    pub name: String,
    /// The parameter-table entries of the unit, in the unit's flat order.
    pub params: Vec<usize>,
    /// My shard of the unit's fp32 weights, `m` and `v` (padding included).
    pub master: Cow<'a, [f32]>,
    pub m: Cow<'a, [f32]>,
    pub v: Cow<'a, [f32]>,
}

impl<'a> ShardPiece<'a> {
    /// The whole model as one flat unit (lessons 01 and 02): `master`, `m`
    /// and `v` are my shard of the model's padded flat vector.
    pub fn flat(table: &ParamTable, master: Cow<'a, [f32]>, m: Cow<'a, [f32]>, v: Cow<'a, [f32]>) -> Self {
        Self { name: "model".into(), params: (0..table.specs.len()).collect(), master, m, v }
    }
}

/// My shard of a replicated flat vector (padded with zeros where it runs past the end).
pub fn cut_shard(full: &[f32], layout: ShardLayout, rank: usize) -> Vec<f32> {
    let mut out = vec![0.0; layout.shard_len];
    let r = layout.shard(rank).range();
    let real = layout.real_len(rank);
    out[..real].copy_from_slice(&full[r.start..r.start + real]);
    out
}

/// `meta.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Meta {
    pub format: String,
    /// The package that wrote it, e.g. `step03-layerwise-shard`.
    pub lesson: String,
    /// Steps completed; training resumes at `step + 1`.
    pub step: u64,
    /// The shards the state is cut into: one file each, written by the
    /// ranks 0 … world_size − 1 — the whole world, or under HSDP the first
    /// shard group (every replica group holds the same shards).
    pub world_size: usize,
    /// Under HSDP, the replica groups the run had (its ranks: world_size × replicas); 1 otherwise.
    #[serde(default = "one")]
    pub replicas: usize,
    /// `--sum-groups`: how many groups the M micro-batch gradients were summed in.
    pub sum_groups: usize,
    /// Whether that grouping was chosen with `--sum-groups` (a resume keeps
    /// it) or is the default, one group per rank (a resume takes its own).
    #[serde(default)]
    pub sum_groups_given: bool,
    pub model: ModelMeta,
    pub data: DataMeta,
    pub adamw: AdamWMeta,
    /// Flags of the lesson that change the arithmetic (e.g. `--precision`), as given.
    pub lesson_flags: Vec<(String, String)>,
    pub units: Vec<UnitMeta>,
    pub files: Vec<FileMeta>,
}

fn one() -> usize {
    1
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ModelMeta {
    pub preset: String,
    pub vocab_size: usize,
    pub block_size: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    pub params: usize,
}

impl ModelMeta {
    /// The model's shape, as the model crate builds it.
    pub fn config(&self) -> GptConfig {
        GptConfig {
            vocab_size: self.vocab_size,
            block_size: self.block_size,
            n_layer: self.n_layer,
            n_head: self.n_head,
            n_embd: self.n_embd,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct DataMeta {
    /// The generated corpus or the `--data` path, as given.
    pub source: String,
    pub vocab: String,
    pub tokens: usize,
    /// FNV-1a of the token ids: the same text, the same batches.
    pub tokens_digest: String,
    pub batch_size: usize,
    pub seq_len: usize,
    pub micro_batches: usize,
    pub seed: u64,
    /// The data position: batches are a pure function of (seed, step), so the
    /// next step's batch is all a resumed run needs to know.
    pub next_step: u64,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct AdamWMeta {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// AdamW's step count `t` (its bias corrections depend on it).
    pub t: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UnitMeta {
    pub name: String,
    pub params: Vec<usize>,
    pub numel: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FileMeta {
    pub rank: usize,
    pub path: String,
    pub bytes: u64,
    pub sha256: String,
}

/// A checkpoint's training state in the model's flat order: no trace of the
/// world size or the layout it was saved with.
#[derive(Debug, Clone)]
pub struct Resumed {
    pub from: PathBuf,
    pub step: u64,
    pub master: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    /// AdamW's step count.
    pub t: u32,
    pub saved_world: usize,
    pub sum_groups: usize,
}

/// `step-000040`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:06}")
}

/// The shard file of `rank` out of `world`.
pub fn shard_file_name(rank: usize, world: usize) -> String {
    format!("shard-{rank:03}-of-{world:03}.safetensors")
}

/// The partial folder a save writes into before it is renamed.
pub fn partial_dir(ckpt: &Path, step: u64) -> PathBuf {
    ckpt.join(format!(".{}.partial", step_dir_name(step)))
}

const SHARD_KEY: &str = "fsdp_shard";

/// The header every shard carries: whose shard of which checkpoint it is.
fn shard_header(rank: usize, world: usize, step: u64) -> String {
    format!("{{\"rank\":{rank},\"world\":{world},\"step\":{step}}}")
}

/// Serialises my shard pieces: tensors `<unit>.master`, `<unit>.m`, `<unit>.v`.
pub fn shard_bytes(pieces: &[ShardPiece], rank: usize, world: usize, step: u64) -> anyhow::Result<Vec<u8>> {
    let mut bufs: Vec<(String, Vec<u8>)> = vec![];
    for p in pieces {
        for (what, data) in [("master", &p.master), ("m", &p.m), ("v", &p.v)] {
            bufs.push((format!("{}.{what}", p.name), data.iter().flat_map(|x| x.to_le_bytes()).collect()));
        }
    }
    let views: Vec<(String, TensorView)> = bufs
        .iter()
        .map(|(n, b)| Ok((n.clone(), TensorView::new(Dtype::F32, vec![b.len() / 4], b)?)))
        .collect::<anyhow::Result<_>>()?;
    let meta: HashMap<String, String> = [(SHARD_KEY.to_string(), shard_header(rank, world, step))].into();
    Ok(safetensors::serialize(views, Some(meta))?)
}

/// Writes a file and fsyncs it (inside a partial folder: the folder's rename is the commit).
pub fn write_synced(path: &Path, data: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path)?;
    f.write_all(data)?;
    f.sync_all()
}

/// Hex SHA-256.
pub fn sha256_hex(data: &[u8]) -> String {
    Sha256::digest(data).iter().map(|b| format!("{b:02x}")).collect()
}

/// fsync of a folder, so a rename inside it is on disk.
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// Rank 0's half of a save, once every shard is on disk: `meta.json`, the
/// rename that commits the checkpoint, the `latest` pointer, then `--keep`.
pub fn commit(ckpt: &Path, meta: &Meta, keep: usize) -> anyhow::Result<PathBuf> {
    let partial = partial_dir(ckpt, meta.step);
    write_synced(&partial.join(META), serde_json::to_string_pretty(meta)?.as_bytes())?;
    sync_dir(&partial)?;
    let done = ckpt.join(step_dir_name(meta.step));
    std::fs::rename(&partial, &done)?;
    sync_dir(ckpt)?;
    write_atomically(&ckpt.join(LATEST), format!("{}\n", step_dir_name(meta.step)).as_bytes())?;
    sync_dir(ckpt)?;
    prune(ckpt, keep, &done)
        .with_context(|| format!("checkpoint {} is saved, but removing older ones failed", done.display()))?;
    Ok(done)
}

/// Before saving step `step`: a run resumed from an older checkpoint into
/// the same folder abandons the checkpoints after it. `latest` is first
/// moved back to the newest one before `step` (or removed if there is
/// none), then the abandoned folders go — so `latest` never names a folder
/// that is being removed.
pub fn abandon_from(ckpt: &Path, step: u64) -> anyhow::Result<()> {
    let all = list(ckpt);
    let (keep, abandon): (Vec<_>, Vec<_>) = all.into_iter().partition(|p| step_of(p).is_some_and(|s| s < step));
    if abandon.is_empty() {
        return Ok(());
    }
    match keep.last().and_then(|p| p.file_name()).and_then(|n| n.to_str()) {
        Some(name) => write_atomically(&ckpt.join(LATEST), format!("{name}\n").as_bytes())?,
        None => std::fs::remove_file(ckpt.join(LATEST))
            .or_else(|e| if e.kind() == std::io::ErrorKind::NotFound { Ok(()) } else { Err(e) })?,
    }
    sync_dir(ckpt)?;
    for p in abandon {
        std::fs::remove_dir_all(&p).with_context(|| format!("cannot remove abandoned checkpoint {}", p.display()))?;
    }
    Ok(())
}

/// The step of a `step-NNNNNN` folder.
fn step_of(p: &Path) -> Option<u64> {
    p.file_name()?.to_str()?.strip_prefix("step-")?.parse().ok()
}

/// The committed checkpoints in `ckpt`, oldest first.
pub fn list(ckpt: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(ckpt)
        .map(|d| d.filter_map(Result::ok).map(|e| e.path()).filter(|p| is_step_dir(p)).collect())
        .unwrap_or_default();
    v.sort_by_key(|p| step_of(p)); // by number: step-1000000 comes after step-999999
    v
}

fn is_step_dir(p: &Path) -> bool {
    p.is_dir() && step_of(p).is_some()
}

/// Keeps the newest `keep` checkpoints (and always `current`).
fn prune(ckpt: &Path, keep: usize, current: &Path) -> anyhow::Result<()> {
    let all = list(ckpt);
    for old in all.iter().take(all.len().saturating_sub(keep)) {
        if old != current {
            std::fs::remove_dir_all(old).with_context(|| format!("cannot remove old checkpoint {}", old.display()))?;
        }
    }
    Ok(())
}

/// Partial folders (and pointer temp files) a killed save left behind: removed before the next save.
pub fn remove_partials(ckpt: &Path) {
    if let Ok(d) = std::fs::read_dir(ckpt) {
        for e in d.filter_map(Result::ok) {
            let name = e.file_name();
            let name = name.to_str().unwrap_or("");
            if name.starts_with(".step-") && name.ends_with(".partial") {
                let _ = std::fs::remove_dir_all(e.path());
            } else if name.starts_with(".latest.tmp") {
                let _ = std::fs::remove_file(e.path()); // a pointer write a kill interrupted
            }
        }
    }
}

/// `--resume DIR` (or `fsdp-export --ckpt DIR`; `flag` names it in errors):
/// DIR is a checkpoint folder itself (it holds meta.json) or a `--ckpt`
/// folder whose `latest` names one.
pub fn resolve(dir: &Path, flag: &str) -> anyhow::Result<PathBuf> {
    if dir.join(META).is_file() {
        return Ok(dir.to_path_buf());
    }
    let latest = dir.join(LATEST);
    if !dir.is_dir() {
        bail!("{flag} {}: no such folder: pass a --ckpt folder of an earlier run", dir.display());
    }
    let name = match std::fs::read_to_string(&latest) {
        Ok(name) => name,
        // No `latest` (a kill between a commit and the pointer, or every later
        // checkpoint abandoned): the newest committed folder is complete.
        Err(_) => match list(dir).into_iter().rev().find(|p| p.join(META).is_file()) {
            Some(p) => return Ok(p),
            None => bail!(
                "{flag} {}: no checkpoint there (no meta.json, no `latest` pointer): pass the --ckpt folder of an earlier run",
                dir.display()
            ),
        },
    };
    let step_dir = dir.join(name.trim());
    if !step_dir.join(META).is_file() {
        bail!(
            "{flag} {}: `latest` names {}, which holds no meta.json: pass one of its step-* folders instead",
            dir.display(),
            name.trim()
        );
    }
    Ok(step_dir)
}

/// Reads and checks a checkpoint (every file's size and SHA-256, every
/// tensor's name and length) and reassembles its whole state in model order.
pub fn read(dir: &Path, flag: &str) -> anyhow::Result<(Meta, Resumed)> {
    let (meta, reader) = open(dir, flag, |_| true)?;
    let all = 0..reader.table.numel();
    let all = std::slice::from_ref(&all);
    let resumed = Resumed {
        from: reader.dir.clone(),
        step: meta.step,
        master: reader.read(Part::Master, all)?,
        m: reader.read(Part::M, all)?,
        v: reader.read(Part::V, all)?,
        t: meta.adamw.t,
        saved_world: meta.world_size,
        sum_groups: meta.sum_groups,
    };
    Ok((meta, resumed))
}

/// Which of a checkpoint's three vectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Master,
    M,
    V,
}

impl Part {
    fn name(self) -> &'static str {
        match self {
            Part::Master => "master",
            Part::M => "m",
            Part::V => "v",
        }
    }
}

/// An opened checkpoint: reads any part of its state, in model order, by
/// reading only the bytes of the shard files that hold it (a rank resuming
/// FSDP reads its own shard, never the whole model).
#[derive(Debug, Clone)]
pub struct Reader {
    pub dir: PathBuf,
    meta: Meta,
    table: ParamTable,
    /// Per file: where each tensor's data starts in it (bytes from the file's start).
    offsets: Vec<HashMap<String, u64>>,
}

/// Opens a checkpoint: checks `meta.json` (format, model, a layout that
/// covers every parameter once, the file list) and every file's size and
/// header; reads whole (and checks the SHA-256 of) only the files for which
/// `verify(rank)` holds — spread them over the ranks so that each file is
/// verified once and no rank reads them all.
pub fn open(dir: &Path, flag: &str, verify: impl Fn(usize) -> bool) -> anyhow::Result<(Meta, Reader)> {
    let dir = resolve(dir, flag)?;
    let at = dir.display().to_string();
    let text =
        std::fs::read_to_string(dir.join(META)).with_context(|| format!("checkpoint {at}: cannot read meta.json"))?;
    let meta: Meta =
        serde_json::from_str(&text).map_err(|e| anyhow!("checkpoint {at}: meta.json is not valid ({e})"))?;
    if meta.format != FORMAT {
        bail!("checkpoint {at}: format `{}`, this build reads `{FORMAT}`", meta.format);
    }
    let cfg = GptConfig {
        vocab_size: meta.model.vocab_size,
        block_size: meta.model.block_size,
        n_layer: meta.model.n_layer,
        n_head: meta.model.n_head,
        n_embd: meta.model.n_embd,
    };
    let table = ParamTable::new(&cfg);
    let numel = table.numel();
    if numel != meta.model.params {
        bail!("checkpoint {at}: meta.json says {} parameters but its model shape has {numel}", meta.model.params);
    }
    // The layout must cover every parameter exactly once.
    let mut seen = vec![false; table.specs.len()];
    for u in &meta.units {
        let n: usize = u.params.iter().map(|&i| table.specs.get(i).map_or(0, |s| s.numel())).sum();
        if u.params.iter().any(|&i| i >= seen.len() || std::mem::replace(&mut seen[i], true)) || n != u.numel {
            bail!("checkpoint {at}: meta.json's layout is inconsistent (unit `{}`)", u.name);
        }
    }
    if seen.iter().any(|s| !s)
        || meta.world_size == 0
        || meta.files.len() != meta.world_size
        || meta.sum_groups == 0
        || meta.adamw.t as u64 != meta.step
    {
        bail!("checkpoint {at}: meta.json's layout, file list or counters are inconsistent");
    }
    // Shard r must be rank r's file: a swapped or renamed file would put
    // every element of its shard in the wrong place, silently.
    for (r, f) in meta.files.iter().enumerate() {
        if f.rank != r || f.path != shard_file_name(r, meta.world_size) {
            bail!(
                "checkpoint {at}: meta.json lists {} as rank {}'s shard at position {r}: the file list is out of order",
                f.path,
                f.rank
            );
        }
    }
    let mut offsets = vec![];
    for f in &meta.files {
        let path = dir.join(&f.path);
        let cannot = |e: std::io::Error| anyhow!("checkpoint {at}: cannot read shard {} ({e})", f.path);
        let len = std::fs::metadata(&path).map_err(cannot)?.len();
        if len != f.bytes {
            bail!(
                "checkpoint {at}: shard {} is {len} bytes, meta.json says {}: the file is truncated or replaced",
                f.path,
                f.bytes
            );
        }
        if verify(f.rank) && sha256_file(&path).map_err(cannot)? != f.sha256 {
            bail!("checkpoint {at}: shard {} fails its SHA-256 check: the file is corrupt", f.path);
        }
        offsets.push(check_header(&path, &meta, f).map_err(|e| anyhow!("checkpoint {at}: {e}"))?);
    }
    let reader = Reader { dir: dir.clone(), meta: meta.clone(), table, offsets };
    Ok((meta, reader))
}

/// SHA-256 of a file, streamed (a megabyte at a time, whatever its size).
fn sha256_file(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    let (mut h, mut buf) = (Sha256::new(), vec![0u8; 1 << 20]);
    loop {
        match f.read(&mut buf)? {
            0 => return Ok(format!("{:x}", h.finalize())),
            n => h.update(&buf[..n]),
        }
    }
}

/// Reads a shard's safetensors header alone: checks who wrote it and that
/// it holds every unit's three tensors (F32, my shard's length); returns
/// where each tensor's bytes start in the file.
fn check_header(path: &Path, meta: &Meta, f: &FileMeta) -> anyhow::Result<HashMap<String, u64>> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).map_err(|e| anyhow!("cannot read shard {} ({e})", f.path))?;
    let not_st = |why: &str| anyhow!("shard {} is not safetensors ({why})", f.path);
    let mut n = [0u8; 8];
    file.read_exact(&mut n).map_err(|_| not_st("too short"))?;
    let n = u64::from_le_bytes(n);
    if n > f.bytes.saturating_sub(8) || n > 100 << 20 {
        return Err(not_st("its header length is impossible"));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header).map_err(|_| not_st("its header is cut short"))?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|_| not_st("its header is not JSON"))?;
    let expected = shard_header(f.rank, meta.world_size, meta.step);
    if header.get("__metadata__").and_then(|m| m.get(SHARD_KEY)).and_then(|v| v.as_str()) != Some(&expected) {
        bail!("shard {} was not written by rank {} of {} at step {}", f.path, f.rank, meta.world_size, meta.step);
    }
    let mut at = HashMap::new();
    for u in &meta.units {
        let len = ShardLayout::new(u.numel, meta.world_size).shard_len as u64;
        for part in [Part::Master, Part::M, Part::V] {
            let name = format!("{}.{}", u.name, part.name());
            let t = header.get(&name).ok_or_else(|| anyhow!("shard {} has no tensor `{name}`", f.path))?;
            let (dtype, shape) = (t["dtype"].as_str(), t["shape"].as_array());
            let offs: Vec<u64> =
                t["data_offsets"].as_array().map_or(vec![], |a| a.iter().filter_map(|x| x.as_u64()).collect());
            let fits = offs.len() == 2 && offs[1].checked_sub(offs[0]) == Some(4 * len) && 8 + n + offs[1] <= f.bytes;
            if dtype != Some("F32")
                || shape.map(|s| s.len()) != Some(1)
                || shape.and_then(|s| s[0].as_u64()) != Some(len)
                || !fits
            {
                bail!("tensor `{name}` in {} is {:?} {:?}, expected F32 [{len}]", f.path, dtype.unwrap_or("?"), shape);
            }
            at.insert(name, 8 + n + offs[0]);
        }
    }
    Ok(at)
}

impl Reader {
    /// `part` at the model-order positions `ranges`, concatenated: read from
    /// the shard files where they lie, and nothing else.
    pub fn read(&self, part: Part, ranges: &[std::ops::Range<usize>]) -> anyhow::Result<Vec<f32>> {
        use std::io::{Read, Seek, SeekFrom};
        let mut out = vec![0f32; ranges.iter().map(|r| r.len()).sum()];
        let at = self.dir.display().to_string();
        for (f, offsets) in self.meta.files.iter().zip(&self.offsets) {
            let mut file: Option<std::fs::File> = None;
            for u in &self.meta.units {
                let shard = ShardLayout::new(u.numel, self.meta.world_size).shard(f.rank);
                let start = offsets[&format!("{}.{}", u.name, part.name())];
                // Each parameter of the unit: unit-local [ua, ua + n) is model [offset, offset + n).
                let mut ua = 0;
                for &i in &u.params {
                    let spec = &self.table.specs[i];
                    let (lo, hi) = (ua.max(shard.offset), (ua + spec.numel()).min(shard.offset + shard.len));
                    if lo >= hi {
                        ua += spec.numel(); // this file holds none of the parameter
                        continue;
                    }
                    let mut out_at = 0;
                    for r in ranges {
                        // The part of this file's piece (model positions) inside `r`.
                        let (a, b) = ((spec.offset + lo - ua).max(r.start), (spec.offset + hi - ua).min(r.end));
                        if a < b {
                            let file = match &mut file {
                                Some(fl) => fl,
                                None => file.insert(
                                    std::fs::File::open(self.dir.join(&f.path))
                                        .with_context(|| format!("checkpoint {at}: cannot read shard {}", f.path))?,
                                ),
                            };
                            let in_shard = (a - spec.offset + ua - shard.offset) as u64;
                            let mut bytes = vec![0u8; 4 * (b - a)];
                            file.seek(SeekFrom::Start(start + 4 * in_shard))?;
                            file.read_exact(&mut bytes)
                                .with_context(|| format!("checkpoint {at}: shard {} is cut short", f.path))?;
                            let dst = &mut out[out_at + a - r.start..out_at + b - r.start];
                            for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
                                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                            }
                        }
                        out_at += r.len();
                    }
                    ua += spec.numel();
                }
            }
        }
        Ok(out)
    }

    /// The parameter table of the checkpoint's model.
    pub fn table(&self) -> &ParamTable {
        &self.table
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("fsdp-ckpt-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// A unit's shard of a model-order vector, cut as the lessons cut it.
    fn cut(table: &ParamTable, params: &[usize], full: &[f32], layout: ShardLayout, rank: usize) -> Vec<f32> {
        let mut flat: Vec<f32> = params.iter().flat_map(|&i| full[table.specs[i].range()].to_vec()).collect();
        flat.resize(layout.padded, 0.0);
        flat[layout.shard(rank).range()].to_vec()
    }

    /// Writes a checkpoint of `step` the way the ranks and rank 0 do, at `world` ranks.
    fn write_checkpoint(dir: &Path, table: &ParamTable, state: [&[f32]; 3], world: usize, step: u64) -> Meta {
        let units: Vec<(String, Vec<usize>)> =
            vec![("tail".into(), (40..table.specs.len()).collect()), ("head".into(), (0..40).rev().collect())];
        let partial = partial_dir(dir, step);
        std::fs::create_dir_all(&partial).unwrap();
        let mut files = vec![];
        for r in 0..world {
            let pieces: Vec<ShardPiece> = units
                .iter()
                .map(|(name, params)| {
                    let layout = ShardLayout::new(params.iter().map(|&i| table.specs[i].numel()).sum(), world);
                    let [master, m, v] = state.map(|x| Cow::Owned(cut(table, params, x, layout, r)));
                    ShardPiece { name: name.clone(), params: params.clone(), master, m, v }
                })
                .collect();
            let bytes = shard_bytes(&pieces, r, world, step).unwrap();
            write_synced(&partial.join(shard_file_name(r, world)), &bytes).unwrap();
            files.push(FileMeta {
                rank: r,
                path: shard_file_name(r, world),
                bytes: bytes.len() as u64,
                sha256: sha256_hex(&bytes),
            });
        }
        let c = GptConfig::preset("tiny", 65).unwrap();
        let meta = Meta {
            format: FORMAT.into(),
            lesson: "unit-test".into(),
            step,
            world_size: world,
            replicas: 1,
            sum_groups: world,
            sum_groups_given: false,
            model: ModelMeta {
                preset: "tiny".into(),
                vocab_size: 65,
                block_size: c.block_size,
                n_layer: c.n_layer,
                n_head: c.n_head,
                n_embd: c.n_embd,
                params: table.numel(),
            },
            data: DataMeta {
                source: "generated".into(),
                vocab: String::new(),
                tokens: 0,
                tokens_digest: String::new(),
                batch_size: 1,
                seq_len: 1,
                micro_batches: world,
                seed: 1,
                next_step: step + 1,
            },
            adamw: AdamWMeta { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, t: step as u32 },
            lesson_flags: vec![],
            units: units
                .iter()
                .map(|(n, p)| UnitMeta {
                    name: n.clone(),
                    params: p.clone(),
                    numel: p.iter().map(|&i| table.specs[i].numel()).sum(),
                })
                .collect(),
            files,
        };
        commit(dir, &meta, 2).unwrap();
        meta
    }

    #[test]
    fn a_checkpoint_saved_at_3_ranks_reads_back_bit_for_bit_and_damage_is_caught() {
        use fsdp_gpt::params::digest_f32;
        let table = ParamTable::new(&GptConfig::preset("tiny", 65).unwrap());
        let (master, m, v) = (table.init_flat(1), table.init_flat(2), table.init_flat(3));
        let dir = temp("roundtrip");
        write_checkpoint(&dir, &table, [&master, &m, &v], 3, 7);
        assert_eq!(std::fs::read_to_string(dir.join("latest")).unwrap(), "step-000007\n");
        let (meta, state) = read(&dir, "--resume").unwrap();
        assert_eq!((meta.world_size, state.step, state.t, state.saved_world), (3, 7, 7, 3));
        for (got, want) in [(&state.master, &master), (&state.m, &m), (&state.v, &v)] {
            assert_eq!(digest_f32(got), digest_f32(want));
        }
        // A second save at 2 ranks, then --keep 2 and a third: the oldest goes.
        write_checkpoint(&dir, &table, [&m, &v, &master], 2, 8);
        write_checkpoint(&dir, &table, [&v, &master, &m], 1, 9);
        let names: Vec<String> =
            list(&dir).iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
        assert_eq!(names, ["step-000008", "step-000009"]);
        assert_eq!(digest_f32(&read(&dir.join("step-000008"), "--resume").unwrap().1.master), digest_f32(&m));
        // No `latest` (a kill between a commit and the pointer): the newest committed folder.
        std::fs::remove_file(dir.join(LATEST)).unwrap();
        assert_eq!(read(&dir, "--resume").unwrap().1.step, 9);
        // One flipped bit in a shard: refused, naming the file.
        let shard = dir.join("step-000008").join(shard_file_name(1, 2));
        let mut data = std::fs::read(&shard).unwrap();
        let n = data.len();
        data[n - 5] ^= 1;
        std::fs::write(&shard, &data).unwrap();
        let e = read(&dir.join("step-000008"), "--resume").unwrap_err().to_string();
        assert!(e.ends_with("shard shard-001-of-002.safetensors fails its SHA-256 check: the file is corrupt"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn checkpoints_sort_by_step_and_abandoning_moves_latest_first() {
        let dir = temp("abandon");
        for s in [5u64, 999_999, 1_000_000] {
            std::fs::create_dir_all(dir.join(step_dir_name(s))).unwrap();
        }
        std::fs::write(dir.join(LATEST), "step-1000000\n").unwrap();
        let names = |d: &Path| {
            list(d).iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect::<Vec<_>>()
        };
        assert_eq!(names(&dir), ["step-000005", "step-999999", "step-1000000"], "by number, not by name");
        // Resumed at step 5 and saving step 6: the two later ones are abandoned.
        abandon_from(&dir, 6).unwrap();
        assert_eq!(names(&dir), ["step-000005"]);
        assert_eq!(std::fs::read_to_string(dir.join(LATEST)).unwrap(), "step-000005\n");
        abandon_from(&dir, 1).unwrap();
        assert!(names(&dir).is_empty() && !dir.join(LATEST).exists(), "nothing older: no latest");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Any model-order ranges read back from shards written out of order
    /// and padded: the reader reads only what lies inside them, and a rank
    /// that verifies no file still reads correct values.
    #[test]
    fn reading_any_ranges_gives_the_model_order_values() {
        let dir = temp("ranges");
        let table = ParamTable::new(&GptConfig::preset("tiny", 65).unwrap());
        let (master, m, v) = (table.init_flat(1), table.init_flat(2), table.init_flat(3));
        write_checkpoint(&dir, &table, [&master, &m, &v], 3, 4);
        let (_, reader) = open(&dir, "--resume", |_| false).unwrap();
        let n = table.numel();
        let ranges = [0..7, 5000..5003, n - 10..n, 100..100, 42..300_000];
        let want = |x: &[f32]| ranges.iter().flat_map(|r| x[r.clone()].to_vec()).collect::<Vec<f32>>();
        assert_eq!(reader.read(Part::Master, &ranges).unwrap(), want(&master));
        assert_eq!(reader.read(Part::M, &ranges).unwrap(), want(&m));
        assert_eq!(reader.read(Part::V, &ranges).unwrap(), want(&v));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
