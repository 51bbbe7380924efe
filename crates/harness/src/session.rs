//! Setup shared by every lesson: validate the flags against the world,
//! load the data, build the model shape (its config table: `config_table`;
//! training's start and each step's end: `run`).
use std::ops::Range;
use std::path::PathBuf;

use anyhow::{Context, bail};
use candle_core::Var;
use fsdp_comm::{ExactSquares, MicroBatchSum, ReduceDtype, SumGroups, World};
use fsdp_gpt::blockwise::{self, Grads};
use fsdp_gpt::kernels::Probs;
use fsdp_gpt::{AdamWConfig, Corpus, Gpt, GptConfig, ParamTable, Sampler};

use crate::checkpoint::{Meta, Part, Reader};
use crate::cli::TrainArgs;
use crate::lesson::{Lesson, agree};
use crate::resume::ThisRun;

/// Everything a lesson's training loop needs besides its own state.
pub struct Session<'w> {
    pub world: &'w World,
    pub lesson: Lesson,
    pub args: TrainArgs,
    pub corpus: Corpus,
    pub cfg: GptConfig,
    pub table: ParamTable,
    pub model: Gpt,
    pub sampler: Sampler,
    pub adamw: AdamWConfig,
    pub out: PathBuf,
    /// How each step's micro-batch gradients are grouped before they are
    /// summed (`--sum-groups`; by default one group per rank).
    pub sum_groups: SumGroups,
    /// Whether `sum_groups` was chosen (`--sum-groups`, or the checkpoint's)
    /// rather than the default one group per rank.
    pub sum_groups_given: bool,
    /// The first step to train: 1, or the checkpoint's step + 1 after `--resume`.
    pub first_step: u64,
    /// `--resume`: where from (the folder, its step, the world size that saved it).
    pub resumed_from: Option<(PathBuf, u64, usize)>,
    /// What a checkpoint records of this run (model, data, AdamW, the
    /// lesson's flags that change the arithmetic) and a resume checks.
    pub this_run: ThisRun,
    /// `--resume`: what this run does differently from an uninterrupted one
    /// (another summation order, another global batch), one line each.
    pub resume_notes: Vec<String>,
    /// `--grad-clip`: this step's gradient norm before clipping, for the log and the report.
    pub grad_norm: std::cell::Cell<Option<f64>>,
    /// The dtype gradients are summed and reduce-scattered in (`--reduce-dtype`,
    /// lessons 03 and 04; fp32 elsewhere): [`Session::grad_sum`]'s.
    pub reduce_dtype: ReduceDtype,
}

/// `--micro-batches` when neither the flag nor a checkpoint says.
pub const DEFAULT_MICRO_BATCHES: usize = 4;

/// What `args` train on: the corpus, the model's shape for its vocabulary,
/// and the sampler of `micro_batches` micro-batches per step. A lesson's
/// session and `fsdp-reference-data` (what PyTorch trains on in `just
/// compare-pytorch`) both take it from here.
pub fn training_data(args: &TrainArgs, micro_batches: usize) -> anyhow::Result<(Corpus, GptConfig, Sampler)> {
    let corpus = match &args.data {
        Some(p) => Corpus::from_file(&p.display().to_string())?,
        None => Corpus::generated(),
    };
    let cfg = GptConfig::preset(&args.preset, corpus.vocab.len())?;
    let seq_len = args.seq_len.map_or(cfg.block_size, |t| t as usize);
    if seq_len > cfg.block_size {
        bail!(
            "--seq-len {seq_len} exceeds the {} preset's block size {}: pass --seq-len {} or less",
            args.preset,
            cfg.block_size,
            cfg.block_size
        );
    }
    let sampler = Sampler::new(&corpus, args.batch_size as usize, seq_len, micro_batches, args.seed)?;
    Ok((corpus, cfg, sampler))
}

/// The state training starts from, handed to the lesson by value: the
/// seed's initial weights, or a checkpoint's weights and AdamW moments. Not
/// held whole anywhere: a lesson asks for the model-order ranges it keeps
/// ([`Start::read`]) and gets exactly those — computed from the seed, or
/// read from the checkpoint files where they lie — so an FSDP rank never
/// holds more than its shard.
pub struct Start {
    source: Source,
}

enum Source {
    Seed { table: ParamTable, seed: u64 },
    Checkpoint(Box<Reader>, u32),
}

/// AdamW's state at some model-order positions, from a checkpoint.
pub struct Moments {
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    pub t: u32,
}

impl Start {
    /// The fp32 weights at the model-order positions `ranges`, concatenated.
    pub fn weights(&self, ranges: &[Range<usize>]) -> anyhow::Result<Vec<f32>> {
        match &self.source {
            Source::Seed { table, seed } => Ok(table.init_ranges(*seed, ranges)),
            Source::Checkpoint(r, _) => r.read(Part::Master, ranges),
        }
    }

    /// AdamW's `m` and `v` at `ranges` and its step count: `None` from the seed.
    pub fn moments(&self, ranges: &[Range<usize>]) -> anyhow::Result<Option<Moments>> {
        match &self.source {
            Source::Seed { .. } => Ok(None),
            Source::Checkpoint(r, t) => {
                Ok(Some(Moments { m: r.read(Part::M, ranges)?, v: r.read(Part::V, ranges)?, t: *t }))
            }
        }
    }

    /// The whole state, for a lesson that keeps it whole (data parallelism).
    pub fn into_parts(self) -> anyhow::Result<(Vec<f32>, Option<Moments>)> {
        let all = 0..self.numel();
        let all = std::slice::from_ref(&all);
        Ok((self.weights(all)?, self.moments(all)?))
    }

    fn numel(&self) -> usize {
        match &self.source {
            Source::Seed { table, .. } => table.numel(),
            Source::Checkpoint(r, _) => r.table().numel(),
        }
    }
}

impl<'w> Session<'w> {
    /// Validates `args` for this world and builds the session. Every rank
    /// agrees on the outcome, so a bad flag or file ends all ranks cleanly.
    pub fn new(world: &'w World, lesson: &Lesson, args: TrainArgs) -> anyhow::Result<(Self, Start)> {
        Self::with_flags(world, lesson, args, &[])
    }

    /// [`Session::new`] for a lesson with flags of its own that change the
    /// arithmetic (e.g. `("--precision", "bf16")`): a checkpoint records them
    /// and resumes only under the same values.
    pub fn with_flags(
        world: &'w World,
        lesson: &Lesson,
        args: TrainArgs,
        flags: &[(&str, String)],
    ) -> anyhow::Result<(Self, Start)> {
        let flags = flags.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
        crate::stop::save_first(args.ckpt.is_some()); // a stop during setup must not cut it short either
        let result = Self::build(world, lesson, args, flags);
        let agreed = agree(world, result)?;
        // From here on an error may leave other ranks waiting in a
        // collective: it ends the whole job (see `launch`).
        crate::lesson::mark_setup_done();
        Ok(agreed)
    }

    fn build(
        world: &'w World,
        lesson: &Lesson,
        mut args: TrainArgs,
        lesson_flags: Vec<(String, String)>,
    ) -> anyhow::Result<(Self, Start)> {
        // Each rank checks the SHA-256 of the files r, r + N, …: every file
        // once, none read whole by everyone. Ranges are read later, by need.
        let (rank, n) = (world.rank(), world.size());
        let loaded: Option<(Meta, Reader)> = match &args.resume {
            Some(dir) => Some(crate::checkpoint::open(dir, "--resume", |file| file % n == rank)?),
            None => None,
        };
        // M: the flag, else the checkpoint's, else 4.
        let m = args
            .micro_batches
            .map(|m| m as usize)
            .or(loaded.as_ref().map(|(meta, _)| meta.data.micro_batches))
            .unwrap_or(DEFAULT_MICRO_BATCHES);
        args.micro_batches = Some(m as u32);
        if n > m {
            bail!(
                "{n} ranks but only {m} micro-batches per step: pass --micro-batches {n} (or a multiple of {n}), or run fewer ranks"
            );
        }
        if !m.is_multiple_of(n) {
            bail!(
                "--micro-batches {m} does not divide among {n} ranks: pass a multiple of {n}, e.g. --micro-batches {}",
                m.div_ceil(n) * n
            );
        }
        crate::exercise::check(lesson.number(), lesson.exercises, &args.mine).map_err(anyhow::Error::msg)?;
        let (corpus, cfg, sampler) = training_data(&args, m)?;
        let out = args.out.clone().unwrap_or_else(|| PathBuf::from("out").join(lesson.short()));
        if world.is_root() {
            std::fs::create_dir_all(&out).with_context(|| format!("cannot create --out folder {}", out.display()))?;
        }
        let adamw = AdamWConfig { lr: args.lr, weight_decay: args.weight_decay, ..AdamWConfig::default() };
        let table = ParamTable::new(&cfg);
        let mut lesson_flags = lesson_flags;
        if let Some(c) = args.grad_clip {
            lesson_flags.push(("--grad-clip".into(), c.to_string())); // a resume must clip alike
        }
        let this_run = ThisRun {
            lesson: lesson.package.to_string(),
            model: crate::resume::model_meta(&args.preset, &cfg, table.numel()),
            data: crate::resume::data_meta(&corpus, &sampler, args.seed),
            adamw: crate::resume::adamw_meta(&adamw),
            lesson_flags,
        };
        if let Some((meta, _)) = &loaded {
            this_run.check_resume(&args, meta)?; // first: another lesson's or model's checkpoint says so
        }
        let (sum_groups, sum_groups_given) = crate::resume::sum_groups(&args, n, loaded.as_ref().map(|(m, _)| m))?;
        crate::resume::check_paths(world, &args, lesson.package)?;
        if let Some(dir) = &args.trace {
            crate::trace_files::check_dir(world, dir)?;
        }
        let budget = args.mem_budget.map(|b| b as usize);
        crate::alloc::set_budget(budget); // building the training state counts
        let (start, resumed_from, resume_notes, first_step) = match loaded {
            Some((meta, r)) => {
                let notes = crate::resume::resume_notes(&meta, sum_groups);
                let from = (r.dir.clone(), meta.step, meta.world_size * meta.replicas); // the ranks that trained it
                (Start { source: Source::Checkpoint(Box::new(r), meta.adamw.t) }, Some(from), notes, meta.step + 1)
            }
            None => (Start { source: Source::Seed { table: table.clone(), seed: args.seed } }, None, vec![], 1),
        };
        crate::exercise::set(lesson.number(), args.mine.clone());
        let probs = if args.selective_recompute { Probs::Recompute } else { Probs::Keep };
        let s = Self {
            world,
            lesson: *lesson,
            args,
            corpus,
            cfg,
            table,
            model: Gpt::new(cfg).with_probs(probs),
            sampler,
            adamw,
            out,
            sum_groups,
            sum_groups_given,
            first_step,
            resumed_from,
            this_run,
            resume_notes,
            grad_norm: std::cell::Cell::new(None),
            reduce_dtype: ReduceDtype::F32,
        };
        Ok((s, start))
    }

    // ANCHOR: clip
    /// `--grad-clip C`: the factor to scale the mean gradient by, min(1,
    /// C / (‖g‖ + 1e-6)) as torch's `clip_grad_norm_`, for the gradient's
    /// global norm `norm` (recorded for the log line and the report). A
    /// lesson whose ranks hold shards forms ‖g‖ from every rank's exact sum
    /// of squares (`World::exact_sum`): one 56-byte message per rank,
    /// the only step of the update that is not elementwise. Exact sums need
    /// no agreed order: every lesson, at every world size, gets the same ‖g‖
    /// and the same factor. `None` without the flag.
    pub fn clip_factor_of(&self, norm: f64) -> Option<f32> {
        let c = self.args.grad_clip?;
        self.grad_norm.set(Some(norm));
        // A NaN norm (a NaN or ∞ in the gradient) gives a NaN factor, as in
        // torch: the broken step shows. An overflowing sum (‖g‖ ≥ 2⁹⁶) gives 0.
        let f = c as f64 / (norm + 1e-6);
        Some(if f.is_nan() { f32::NAN } else { f.min(1.0) as f32 })
    }

    /// Bytes one rank sends per step for `--grad-clip` when the gradient is
    /// sharded: its exact sum to N − 1 ranks (`None` without the flag).
    /// `ranks`: those the gradient is sharded over (the world, or a shard
    /// group under HSDP: the replicas hold the same shards).
    pub fn clip_traffic_over(&self, ranks: usize) -> Option<u64> {
        self.args.grad_clip.map(|_| ((ranks - 1) * ExactSquares::WORDS * 8) as u64)
    }

    /// `--grad-clip` for a rank that holds the whole mean gradient (lessons
    /// 01 and 02): its norm needs no other rank; clips it in place.
    pub fn clip_whole(&self, grads: &mut [f32]) {
        if self.args.grad_clip.is_none() {
            return; // no sum of squares to pay for
        }
        if let Some(f) = self.clip_factor_of(ExactSquares::of(grads).norm()) {
            grads.iter_mut().for_each(|g| *g *= f);
        }
    }
    // ANCHOR_END: clip

    /// An empty sum of my micro-batches' gradients (vectors of `len`
    /// elements), formed in the step's one summation order.
    pub fn grad_sum(&self, len: usize) -> MicroBatchSum {
        MicroBatchSum::new(self.sum_groups, len).in_dtype(self.reduce_dtype)
    }

    /// The elements of the ordered reduce-scatter's all-to-all receive
    /// buffer for vectors of `padded` elements (one per sum of mine), if it
    /// has one: between ranks, or with several sums per rank (`--sum-groups`
    /// on one rank still packs and sums them the same way). What a tally
    /// counts and [`Session::reserve_receive_buffer`] allocates.
    pub fn receive_buffer_len(&self, padded: usize) -> Option<usize> {
        let groups = self.sum_groups.per_rank();
        (self.world.size() > 1 || groups > 1).then_some(groups * padded)
    }

    /// The f32 words `len` elements of the reduce dtype take: the buffers of a
    /// bf16 reduction hold two elements a word.
    pub fn reduce_words(&self, len: usize) -> usize {
        match self.reduce_dtype {
            ReduceDtype::F32 => len,
            ReduceDtype::Bf16 => len.div_ceil(2),
        }
    }

    /// That receive buffer, allocated now, as the tallies count it (kept,
    /// from the first step on), so that step 1 peaks where every step does:
    /// on the communication stream's thread when the reductions go there
    /// (`on_stream`), else on the compute thread.
    pub fn reserve_receive_buffer(&self, padded: usize, on_stream: bool) {
        if let Some(len) = self.receive_buffer_len(padded) {
            let len = self.reduce_words(len);
            let parts = self.sum_groups.per_rank() * self.world.size();
            match on_stream {
                true => self.world.reserve_stream_receive_buffer(len, parts),
                false => self.world.reserve_receive_buffer(len, parts),
            }
        }
    }

    /// Starts the world's communication stream (the overlap flags), every
    /// rank together; an MPI without thread support is refused in one line.
    pub fn start_stream(&self) -> anyhow::Result<()> {
        agree(self.world, self.world.start_stream().map(|_| ()).map_err(anyhow::Error::from))
    }

    /// The steps left to train: `first_step..=steps`.
    pub fn steps(&self) -> std::ops::RangeInclusive<u64> {
        self.first_step..=self.args.steps
    }

    /// The micro-batches this rank trains on each step.
    pub fn my_micro_batches(&self) -> Range<usize> {
        self.sampler.share(self.world.rank(), self.world.size())
    }

    /// Forward and backward of micro-batch `k` of `step` through the model
    /// whose parameters are `vars`; returns the loss and the gradients,
    /// block by block ([`blockwise`]: each block's backward the project's
    /// own, from its tape). With `recompute` (activation checkpointing) each
    /// block keeps only its input, and its forward is run again just before
    /// its backward: less memory, one more forward, the same bits.
    pub fn forward_backward(&self, vars: &[Var], step: u64, k: usize, recompute: bool) -> anyhow::Result<(f32, Grads)> {
        let batch = self.sampler.micro_batch(step, k)?;
        Ok(blockwise::forward_backward_collected(&self.model, &self.table, vars, &batch, recompute)?)
    }

    /// One micro-batch's (B, T).
    pub fn micro_batch_shape(&self) -> (usize, usize) {
        (self.sampler.batch_size, self.sampler.seq_len)
    }

    /// A start state from the seed alone (for a side run beside training,
    /// such as lesson 03's one step of lesson 02 for the memory timeline).
    pub fn seed_start(&self) -> Start {
        Start { source: Source::Seed { table: self.table.clone(), seed: self.args.seed } }
    }
}
