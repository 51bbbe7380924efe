//! Setup shared by every lesson: validate the flags against the world,
//! load the data, build the model shape, and print the config table.
use std::ops::Range;
use std::path::PathBuf;

use anyhow::{Context, bail};
use candle_core::Var;
use fsdp_comm::{ExactSquares, MicroBatchSum, ReduceDtype, SumGroups, World};
use fsdp_gpt::Unit;
use fsdp_gpt::blockwise::{self, Grads};
use fsdp_gpt::kernels::Probs;
use fsdp_gpt::memory::{Footprint, ModelShapes};
use fsdp_gpt::{AdamWConfig, Corpus, Gpt, GptConfig, ParamTable, Sampler};

use crate::checkpoint::{Meta, Part, Reader};
use crate::cli::TrainArgs;
use crate::edge::{Lesson, agree};
use crate::report::{MemoryTally, Moment};
use crate::resume::ThisRun;
use crate::table::{Table, thousands};

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
        // collective: it ends the whole job (see `edge`).
        crate::edge::mark_setup_done();
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
            crate::trace::check_dir(world, dir)?;
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

    /// The shapes of this run's model in a compute dtype of `elem` bytes
    /// per element, for [`fsdp_gpt::memory`]'s accounting.
    pub fn shapes(&self, elem: usize) -> ModelShapes {
        ModelShapes { cfg: self.cfg, elem, probs: self.model.probs }
    }

    /// One micro-batch's (B, T).
    pub fn micro_batch_shape(&self) -> (usize, usize) {
        (self.sampler.batch_size, self.sampler.seq_len)
    }

    /// The moments of one micro-batch of [`fsdp_gpt::blockwise`]: the head,
    /// each block's backward and the hand-off of its gradients, the
    /// embedding's backward and the root's hand-off — what the mechanism
    /// holds at each, and what the lesson holds (`held(unit, handed, m)`:
    /// `FinalNorm` for the head; `handed` once the unit's gradients are
    /// being handed on). `label` names the micro-batch.
    pub fn blockwise_moments(
        &self,
        elem: usize,
        recompute: bool,
        label: &str,
        held: &mut dyn FnMut(Unit, bool, &mut Moment),
    ) -> Vec<Moment> {
        // `held` is asked what the lesson holds besides: at a hand-off the
        // unit's own gradients are counted here, not by the lesson.
        let (e, (b, t), c, v) = (elem, self.micro_batch_shape(), self.cfg.n_embd, self.cfg.vocab_size);
        let (btc, layers, dt) = (b * t * c, self.cfg.n_layer, if elem == 2 { "bf16" } else { "fp32" });
        let shapes = self.shapes(e);
        let block = shapes.block_taped((b, t));
        // What waits for the blocks before it: their inputs (recompute) or tapes.
        let waiting = |m: &mut Moment, blocks: usize| {
            match recompute {
                true => m.add(
                    &format!("saved block inputs ({dt})"),
                    blocks * btc,
                    e,
                    "(B, T, C) per block: each block is recomputed from its input",
                ),
                false => m.add(
                    "block tapes waiting for backward",
                    blocks * block.activations,
                    1,
                    "each block's activations, kept (its input among them)",
                ),
            };
        };
        let carried = |m: &mut Moment| {
            m.add(&format!("upstream gradient ({dt})"), btc, e, "dL/dx at the current block boundary")
                .add(&format!("lm_head part of wte grad ({dt})"), v * c, e, "until the embedding's backward")
                .add(&format!("ln_f grads ({dt})"), 2 * c, e, "until the root's gradient is complete");
        };
        let ids = |m: &mut Moment| {
            m.add("micro-batch token ids", 2 * b * t, 4, "inputs and targets (B, T)");
        };
        let mut moments = vec![];
        let mut m = Moment::new(format!("head forward+backward, {label}"));
        waiting(&mut m, layers);
        m.add(&format!("the head's input as a Var ({dt})"), btc, e, "a copy, so backward reaches it");
        ids(&mut m);
        pass_rows(&mut m, &shapes.head_and_loss((b, t)), "the head's graph");
        held(Unit::FinalNorm, false, &mut m);
        moments.push(m);
        for i in (0..layers).rev() {
            let what = if recompute { "recompute+backward" } else { "backward" };
            let mut m = Moment::new(format!("{what} of h.{i}, {label}"));
            waiting(&mut m, i);
            carried(&mut m);
            ids(&mut m);
            tape_rows(&mut m, &block);
            held(Unit::Block(i), false, &mut m);
            moments.push(m);
            // Its tape gone, its gradients are handed on.
            let mut m = Moment::new(format!("handing on h.{i}'s gradients, {label}"));
            waiting(&mut m, i);
            carried(&mut m);
            ids(&mut m);
            let n = self.table.unit_range(Unit::Block(i)).len();
            m.add(&format!("the block's gradients ({dt})"), n, e, "handed to the lesson");
            held(Unit::Block(i), true, &mut m);
            moments.push(m);
        }
        let mut m = Moment::new(format!("embedding backward, {label}"));
        carried(&mut m);
        ids(&mut m);
        embedding_rows(&mut m, &shapes.embedding_backward((b, t)), v * c * e);
        held(Unit::Embedding, false, &mut m);
        moments.push(m);
        let mut m = Moment::new(format!("handing on the root's gradients, {label}"));
        m.add(&format!("the root's gradients ({dt})"), v * c + self.cfg.block_size * c + 2 * c, e, "wte, wpe, ln_f")
            .add(&format!("upstream gradient ({dt})"), btc, e, "the rows' gradient is a view of it, until the hand-off")
            .add(&format!("lm_head part of wte grad ({dt})"), v * c, e, "the tied gradient was formed from it");
        ids(&mut m);
        held(Unit::Embedding, true, &mut m);
        moments.push(m);
        moments
    }

    /// The moments of one micro-batch of [`Session::forward_backward`]: its
    /// backward, block by block (the gradients collected so far waiting),
    /// with or without `recompute`, then the adding of its gradients
    /// to the sums (`add_label`). `held(adding, m)`: what the lesson holds
    /// besides, at the backward (`false`) or at the add (`true`).
    pub fn whole_model_moments(
        &self,
        elem: usize,
        recompute: bool,
        label: &str,
        add_label: &str,
        held: &mut dyn FnMut(bool, &mut Moment),
    ) -> Vec<Moment> {
        let dt = if elem == 2 { "bf16" } else { "fp32" };
        let mut moments = self.blockwise_moments(elem, recompute, label, &mut |unit, _handed, m| {
            held(false, m);
            m.add(&format!("gradients collected ({dt})"), self.grads_collected(unit), elem, "the blocks done so far");
        });
        let mut add = Moment::new(add_label);
        held(true, &mut add);
        self.gradient_add_tally(&mut add, elem);
        moments.push(add);
        moments
    }

    /// Gradient elements a collecting backward (`forward_backward`) holds
    /// when `unit`'s backward runs, block by block, last
    /// first: every block after it. (At a hand-off, [`Session::blockwise_moments`]
    /// counts the unit's own.)
    pub fn grads_collected(&self, unit: Unit) -> usize {
        let block = |i: usize| self.table.unit_range(Unit::Block(i)).len();
        match unit {
            Unit::FinalNorm => 0,
            Unit::Block(i) => (i + 1..self.cfg.n_layer).map(block).sum(),
            Unit::Embedding => (0..self.cfg.n_layer).map(block).sum(),
        }
    }

    /// What adding a micro-batch's gradients onto the sums holds besides
    /// them, after [`Session::forward_backward`]: every parameter's gradient
    /// (a bf16 one widened as it is added, no copy).
    pub fn gradient_add_tally(&self, m: &mut Moment, elem: usize) {
        m.add("the micro-batch's gradients", self.table.numel(), elem, "every parameter's, block by block");
    }

    /// The token ids the run holds, kept: the corpus and the sampler's copy.
    pub fn data_tally(&self, t: &mut MemoryTally) {
        t.add("training text as token ids", self.data_bytes() / 4, 4, "the corpus and the sampler's copy (u32)");
    }

    /// Bytes of [`Session::data_tally`].
    pub fn data_bytes(&self) -> usize {
        2 * self.corpus.tokens.len() * 4
    }

    /// A start state from the seed alone (for a side run beside training,
    /// such as lesson 03's one step of lesson 02 for the memory timeline).
    pub fn seed_start(&self) -> Start {
        Start { source: Source::Seed { table: self.table.clone(), seed: self.args.seed } }
    }

    /// Training begins: the step clock and a fresh peak-heap measurement
    /// start, and `--mem-budget` is checked once before the first step (does
    /// the training state alone fit?).
    pub fn start_training(&self) -> anyhow::Result<crate::Run> {
        if self.args.trace.is_some() {
            self.world.start_trace(); // its storage is allocated now, before the peak is measured
            self.world.trace_step(self.first_step);
        }
        let run = crate::Run::start(self);
        self.check_memory_budget(self.first_step - 1)?;
        Ok(run)
    }

    /// Everything a step's end does besides the lesson's own work: record
    /// the loss (and print it), check `--mem-budget`, save a checkpoint when
    /// one is due, and stop the job if it was asked to (after saving one,
    /// with `--ckpt`). Every rank calls it after every step.
    pub fn end_step<'a>(
        &self,
        step: u64,
        run: &mut crate::Run,
        loss: f32,
        pieces: impl FnOnce() -> Vec<crate::checkpoint::ShardPiece<'a>>,
    ) -> anyhow::Result<()> {
        run.step_done(step, loss, self.grad_norm.take().map(|n| (n, self.args.grad_clip.unwrap_or(f32::INFINITY))));
        crate::edge::failpoint_panic(step);
        self.check_memory_budget(step)?;
        let stop = crate::stop::agreed(self.world);
        let save = self.checkpoint_due(step) || (stop.is_some() && self.args.ckpt.is_some());
        if save {
            self.save_checkpoint(step, pieces)?;
            run.leave_out_pause(); // the save is not part of the next step's time
        }
        crate::stop::step_started(step + 1);
        self.world.trace_step(step + 1);
        if step == self.args.steps {
            self.world.stop_trace(); // training is over: the report's gathers are not part of it
        }
        let Some(sig) = stop.filter(|_| step < self.args.steps) else { return Ok(()) }; // after the last step: done anyway
        if self.world.is_root() {
            let how = crate::stop::cause(sig);
            match &self.args.ckpt {
                Some(dir) => eprintln!(
                    "stopped {how} after step {step}: checkpoint {}; resume with --resume {}",
                    dir.join(crate::checkpoint::step_dir_name(step)).display(),
                    dir.display()
                ),
                None => eprintln!("stopped {how} after step {step}: {}", crate::stop::NOTHING_SAVED),
            }
        }
        crate::stop::exit_now(crate::stop::exit_code(sig))
    }

    /// `--mem-budget`: before the first step and after each step, every rank learns whether any rank
    /// allocated beyond its budget; if one did, rank 0 prints one line and
    /// every rank stops with exit code 2, like a GPU's out-of-memory error.
    /// Without a budget it does nothing (and no collective).
    pub fn check_memory_budget(&self, step: u64) -> anyhow::Result<()> {
        if self.args.mem_budget.is_none() {
            return Ok(());
        }
        let o = crate::alloc::overrun();
        let mine = o.map_or([0, 0, 0, 0], |o| [1, o.needed as u64, o.live as u64, o.before_training as u64]);
        let all = self.world.gather_control(&mine);
        let Some((rank, r)) = all.chunks_exact(4).enumerate().find(|(_, r)| r[0] == 1) else { return Ok(()) };
        if self.world.is_root() {
            let budget = self.args.mem_budget.unwrap_or(0);
            let fix = "pass a larger --mem-budget, more ranks, or a higher ZeRO stage";
            let b = crate::table::mb_or_bytes(budget);
            let (needed, live) = (crate::table::mb(r[1]), crate::table::mb(r[2]));
            let first = self.first_step;
            if r[3] == 1 && r[2] > budget {
                // More than the budget was live when it was set.
                eprintln!(
                    "error: out of memory on rank {rank}: {live} live before training already exceeds the budget {b} ({fix})"
                );
            } else if r[3] == 1 {
                // While building the training state: the state alone does not fit.
                eprintln!(
                    "error: out of memory on rank {rank}: needed {needed}, budget {b}, live {live} (building the training state, before step {first}; {fix})"
                );
            } else {
                eprintln!(
                    "error: out of memory on rank {rank}: needed {needed}, budget {b}, live {live} (step {step}; {fix})"
                );
            }
        }
        Err(crate::edge::Stop::Reported.into())
    }

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

/// A pass's footprint as two rows: what its graph keeps from the forward,
/// and the most its backward holds on top (gradients, sums, temporaries).
pub fn pass_rows(m: &mut Moment, f: &Footprint, graph: &str) {
    m.add("activations the graph keeps", f.activations, 1, &format!("{graph}: every op's output, until backward ends"));
    backward_rows(m, f);
}

/// The embedding's backward ([`fsdp_gpt::model::Gpt::embedding_backward`],
/// no graph), then `wte`'s whole gradient formed from it (`tied` bytes, an
/// index_add): at the busiest of the two, the backward's scratch, or wpe's
/// gradient and the tied one.
pub fn embedding_rows(m: &mut Moment, f: &Footprint, tied: usize) {
    if f.backward_peak > f.grad_store + tied {
        m.add("the embedding's backward", f.backward_peak, 1, "wpe's gradient being made: the positions' sums");
    } else {
        m.add("wpe's gradient", f.grad_store, 1, "the positions' sums, zeros beyond").add(
            "wte's whole gradient",
            tied,
            1,
            "lm_head part + the rows, index-added",
        );
    }
}

/// A block on a tape ([`fsdp_gpt::model::BlockTape`]): what it keeps, and
/// what its backward holds on top.
pub fn tape_rows(m: &mut Moment, f: &Footprint) {
    m.add("activations the tape keeps", f.activations, 1, "the block's: every op's output, its input among them")
        .add("backward: parameter gradients", f.var_grads_at_peak, 1, "made by the tape's backward at its busiest")
        .add(
            "backward: other gradients, temporaries",
            f.backward_peak - f.var_grads_at_peak,
            1,
            "activations' gradients in flight (none added into zeros), the ops' scratch",
        );
}

/// The most a pass's backward holds on top of its activations.
fn backward_rows(m: &mut Moment, f: &Footprint) {
    m.add("backward: parameter gradients", f.var_grads_at_peak, 1, "in candle's GradStore at the backward's busiest")
        .add(
            "backward: other gradients, temporaries",
            f.backward_peak - f.var_grads_at_peak,
            1,
            "activations' gradients in flight, the ops' scratch",
        );
}

/// The config table's line for the activation policy.
pub fn recompute_note(recompute: bool) -> String {
    match recompute {
        true => "recomputed block by block (--recompute): inputs kept, one more forward".into(),
        false => "kept for backward (on each block's tape)".into(),
    }
}
