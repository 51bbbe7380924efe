//! Training-loop bookkeeping: the progress bar (or plain lines when stdout
//! is not a terminal), the loss history and the step timings; and what the
//! session does when training starts and at each step's end (`--mem-budget`,
//! checkpoints, a stop asked for).
use std::io::IsTerminal;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::session::Session;
use crate::table::thousands;

/// One training run, as rank 0 reports it.
pub struct Run {
    steps: u64,
    first_step: u64,
    log_every: u64,
    tokens_per_step: usize,
    bar: Option<ProgressBar>,
    started: Instant,
    step_started: Instant,
    /// Mean loss over the global batch, per step.
    pub losses: Vec<f32>,
    /// `--grad-clip`: each step's gradient norm before clipping.
    pub grad_norms: Vec<f64>,
    /// Lessons that keep gradients unit by unit: each step's (unit, digest
    /// of this rank's shard of its gradient), in backward order.
    pub unit_grad_digests: Vec<Vec<(String, String)>>,
    /// Wall seconds per step.
    pub step_seconds: Vec<f64>,
    /// Live heap when training started (data, runtime, the lesson's state).
    pub baseline_live: usize,
    /// The highest live heap before training: while the session and the
    /// lesson's state were built (from the seed, or read from a checkpoint).
    pub setup_peak: usize,
    /// The highest live heap while training, taken at [`Run::finish`]
    /// (before the report's own work, such as gathering the final weights).
    pub training_peak: usize,
    /// The live heap when training ended: what is kept from step to step.
    pub final_live: usize,
}

impl Run {
    /// Starts the clock and a fresh peak-heap measurement.
    pub fn start(s: &Session) -> Self {
        let bar = (s.world.is_root() && wants_bar()).then(|| {
            let b = ProgressBar::with_draw_target(Some(s.args.steps), ProgressDrawTarget::stdout());
            b.set_position(s.first_step - 1);
            b.set_style(
                ProgressStyle::with_template("{bar:30.cyan/blue} step {pos}/{len} · {msg} · eta {eta}")
                    .expect("valid template"),
            );
            b
        });
        let setup_peak = crate::alloc::peak_bytes();
        crate::alloc::reset_peak();
        crate::alloc::training_begins();
        crate::stop::step_started(s.first_step);
        Self {
            steps: s.args.steps,
            first_step: s.first_step,
            log_every: s.args.log_every,
            tokens_per_step: s.sampler.tokens_per_step(),
            bar,
            started: Instant::now(),
            step_started: Instant::now(),
            losses: vec![],
            grad_norms: vec![],
            unit_grad_digests: vec![],
            step_seconds: vec![],
            baseline_live: crate::alloc::live_bytes(),
            setup_peak,
            training_peak: 0,
            final_live: 0,
        }
    }

    /// Records step `step`'s mean loss; prints a line every `--log-every` steps.
    /// A step ended: its loss and, under `--grad-clip`, (‖g‖ before clipping, C).
    pub fn step_done(&mut self, step: u64, loss: f32, grad_norm: Option<(f64, f32)>) {
        let secs = self.step_started.elapsed().as_secs_f64();
        self.step_started = Instant::now();
        self.losses.push(loss);
        self.step_seconds.push(secs);
        let tps = self.tokens_per_step as f64 / secs;
        let mut line = format!("step {step:>5}/{} | loss {loss:.6} | {} tok/s", self.steps, thousands(tps as u64));
        if let Some((norm, c)) = grad_norm {
            self.grad_norms.push(norm);
            let clipped = if norm > c as f64 { format!(", clipped to {c}") } else { String::new() };
            line += &format!(" | grad norm {norm:.4}{clipped}");
        }
        if let Some(b) = &self.bar {
            b.set_message(format!("loss {loss:.4} · {} tok/s", thousands(tps as u64)));
            b.inc(1);
        }
        if step == self.first_step || step.is_multiple_of(self.log_every) || step == self.steps {
            match &self.bar {
                Some(b) => b.println(line),
                None => crate::print0!("{line}"),
            }
        }
    }

    /// Restarts the step clock: time since the last step (a checkpoint
    /// save) is not counted in the next step.
    pub fn leave_out_pause(&mut self) {
        self.step_started = Instant::now();
    }

    pub fn finish(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
        (self.training_peak, self.final_live) = (crate::alloc::peak_bytes(), crate::alloc::live_bytes());
    }

    /// Median seconds per step, leaving out the first (warm-up) step when there are others.
    pub fn median_step_seconds(&self) -> f64 {
        let mut v: Vec<f64> =
            self.step_seconds.iter().skip(usize::from(self.step_seconds.len() > 1)).copied().collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    }

    /// Tokens per second over all ranks, from the median step.
    pub fn tokens_per_second(&self) -> f64 {
        let m = self.median_step_seconds();
        if m > 0.0 { self.tokens_per_step as f64 / m } else { 0.0 }
    }

    pub fn total_seconds(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }
}

/// A live bar only where a person watches: `FSDP_PROGRESS=bar|plain` decides;
/// otherwise a terminal outside mpirun. Under mpirun every rank's stdout is a
/// pseudo-terminal even when mpirun's own output goes to a file, so the
/// justfile sets `FSDP_PROGRESS=bar` only when *its* stdout is a terminal.
fn wants_bar() -> bool {
    match std::env::var("FSDP_PROGRESS").as_deref() {
        Ok("bar") => true,
        Ok("plain") => false,
        _ => std::io::stdout().is_terminal() && std::env::var_os("OMPI_COMM_WORLD_SIZE").is_none(),
    }
}

impl Session<'_> {
    /// Training begins: the step clock and a fresh peak-heap measurement
    /// start, and `--mem-budget` is checked once before the first step (does
    /// the training state alone fit?).
    pub fn start_training(&self) -> anyhow::Result<Run> {
        if self.args.trace.is_some() {
            self.world.start_trace(); // its storage is allocated now, before the peak is measured
            self.world.trace_step(self.first_step);
        }
        let run = Run::start(self);
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
        run: &mut Run,
        loss: f32,
        pieces: impl FnOnce() -> Vec<crate::checkpoint::ShardPiece<'a>>,
    ) -> anyhow::Result<()> {
        run.step_done(step, loss, self.grad_norm.take().map(|n| (n, self.args.grad_clip.unwrap_or(f32::INFINITY))));
        crate::lesson::failpoint_panic(step);
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
        Err(crate::lesson::Stop::Reported.into())
    }
}
