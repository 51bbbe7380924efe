//! Training-loop bookkeeping: the progress bar (or plain lines when stdout
//! is not a terminal), the loss history and the step timings.
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
