//! # fsdp-harness — everything around the algorithm
//!
//! Each lesson's binary is its algorithm plus this crate: the command line,
//! the config table, the progress bar, the memory tally beside the measured
//! heap, the traffic table, the JSON report, the SVG plots and the error
//! handling that ends every rank cleanly. The harness offers mechanisms; it
//! never decides what a lesson shards (llm.c's warning about `zero_stage`
//! branches in shared code).
//!
//! ```no_run
//! use fsdp_harness::{Lesson, Session, TrainArgs};
//! const LESSON: Lesson = Lesson { package: "step01-data-parallel", title: "data parallelism", exercises: 2 };
//! fn main() -> std::process::ExitCode {
//!     fsdp_harness::main(LESSON, |world, lesson| {
//!         let args: TrainArgs = fsdp_harness::parse_args(lesson)?;
//!         let (session, start) = Session::new(world, lesson, args)?;
//!         // … the lesson's state, cut from `start`; the training loop …
//!         # let _ = (session, start);
//!         Ok(())
//!     })
//! }
//! ```
//!
//! | module | what it holds |
//! |---|---|
//! | [`alloc`] | the counting global allocator (live and peak heap, per rank) |
//! | [`cli`] | the flags every lesson shares |
//! | [`session`] | config validation, data, model |
//! | [`config_table`] | the config table, printed once with derived quantities |
//! | [`run`] | the training-loop bookkeeping: progress, losses, timing; training's start and each step's end (budget, checkpoint, stop) |
//! | [`memory_tally`] | the memory tally from shapes, and the moments of a step it models |
//! | [`report`] | the report: memory tally beside the measured heap, traffic table, JSON, weights |
//! | [`table`], [`plot`] | boxed text tables, SVG charts (re-exported from `fsdp-plot`) |
//! | [`memory_timeline`] | the heap sampled at the events of one step |
//! | [`trace_files`] | `--trace`: when things happened, as Chrome trace events and an SVG timeline |
//! | [`checkpoint`] | checkpoint files (re-exported from `fsdp-checkpoint`) |
//! | [`resume`] | before training: the checkpoint flags, and a checkpoint checked against this run |
//! | [`save`] | the collective, atomic save of a checkpoint |
//! | [`lesson`] | what a lesson is; `is_root`; setup's agreement (`agree`) |
//! | [`launch`] | `main`: errors reported once, on rank 0, every rank ends |
//! | [`exercise`] | `--mine K`: the learner's code in place of an answer, inside the real step |
//! | [`stop`] | SIGTERM / Ctrl-C: finish the step, save a checkpoint, exit |

pub mod alloc;
pub mod cli;
pub mod config_table;
pub mod exercise;
pub mod launch;
pub mod lesson;
pub mod memory_tally;
pub mod memory_timeline;
pub mod report;
pub mod resume;
pub mod run;
pub mod save;
pub mod session;
pub mod stop;
pub mod trace_files;

/// The checkpoint files (crate `fsdp-checkpoint`), and the tables and charts
/// (crate `fsdp-plot`): infrastructure, kept in crates of their own.
pub use fsdp_checkpoint as checkpoint;
pub use fsdp_plot::{plot, table};

pub use cli::{TrainArgs, parse_args};
pub use launch::main;
pub use lesson::Lesson;
pub use memory_tally::{MemoryTally, Moment, Residency};
pub use memory_timeline::MemoryTimeline;
pub use report::Report;
pub use run::Run;
pub use session::{Moments, Session, Start};

/// Prints on rank 0 only (rank-0 output is the report; other ranks stay quiet).
#[macro_export]
macro_rules! print0 {
    ($($arg:tt)*) => {
        if $crate::lesson::is_root() { println!($($arg)*); }
    };
}
