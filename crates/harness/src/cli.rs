//! The flags every lesson shares. A lesson adds its own with
//! `#[command(flatten)] train: TrainArgs` and passes the whole struct to
//! [`parse_args`]. Every `///` line here becomes `--help` text.
use std::path::PathBuf;

use clap::Parser;

use crate::lesson::{Lesson, Stop};

#[derive(Debug, Clone, Parser)]
pub struct TrainArgs {
    /// Model shape: tiny (0.8M params), small (10.7M) or gpt2 (86M, GPT-2 small's body).
    #[arg(long, default_value = "tiny")]
    pub preset: String,

    /// Optimizer steps to train.
    #[arg(long, allow_negative_numbers = true, default_value_t = 50, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub steps: u64,

    /// Seed of the initial weights and of the batches; same seed, same bits.
    #[arg(long, allow_negative_numbers = true, default_value_t = 1337)]
    pub seed: u64,

    /// AdamW learning rate.
    #[arg(long, allow_negative_numbers = true, default_value_t = 1e-3, value_parser = positive_f32)]
    pub lr: f32,

    /// AdamW decoupled weight decay (torch's default 0.01).
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.01, value_parser = non_negative_f32)]
    pub weight_decay: f32,

    /// Clip the gradient by its global norm (torch's `clip_grad_norm_`):
    /// scale the mean gradient by min(1, C / (‖g‖ + 1e-6)). ‖g‖ is summed
    /// exactly over every shard, so every lesson and world size gets the same bits.
    #[arg(long, allow_negative_numbers = true, value_name = "C", value_parser = positive_f32)]
    pub grad_clip: Option<f32>,

    // Shared, where --recompute is each lesson's: it changes only what the
    // attention op keeps, inside the model every lesson runs, and no bit.
    /// Selective recompute: attention keeps no probabilities (B, nh, T, T)
    /// for its backward, which computes them again from q and k. The same
    /// bits; saves the one activation that grows with T², for one more q·kᵀ
    /// and softmax per block.
    #[arg(long)]
    pub selective_recompute: bool,

    /// Sequences per micro-batch (B).
    #[arg(long, allow_negative_numbers = true, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub batch_size: u32,

    /// Tokens per sequence (T); at most the preset's block size. Default: the block size.
    #[arg(long, allow_negative_numbers = true, value_parser = clap::value_parser!(u32).range(1..))]
    pub seq_len: Option<u32>,

    /// Micro-batches per optimizer step (M), over all ranks together: the
    /// global batch is M·B·T tokens at every world size; each rank takes M/N.
    /// Default: 4, or the checkpoint's under --resume.
    #[arg(long, allow_negative_numbers = true, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub micro_batches: Option<u32>,

    /// Train on this UTF-8 text file instead of the generated corpus.
    #[arg(long)]
    pub data: Option<PathBuf>,

    /// Folder for report.json, the plots and the final weights. Default: out/<lesson>.
    #[arg(long)]
    pub out: Option<PathBuf>,

    /// Print a loss line every this many steps (and at the first and last).
    #[arg(long, allow_negative_numbers = true, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub log_every: u64,

    /// Heap budget per rank, like a GPU's memory (e.g. 120MB, 1.5GB): the
    /// counting allocator flags the first allocation beyond it, and the run
    /// stops on every rank with an out-of-memory error at the end of that step.
    #[arg(long, allow_negative_numbers = true, value_name = "SIZE", value_parser = parse_size)]
    pub mem_budget: Option<u64>,

    /// Sum each step's micro-batch gradients in G groups of consecutive
    /// micro-batches (G divides --micro-batches; the world size divides G):
    /// the same bits at every world size dividing G, at G/N times the
    /// reduce-scatter bytes. Default: one group per rank, which already gives
    /// every power-of-two world size dividing M the same bits (a checkpoint
    /// saved with --sum-groups keeps its G).
    #[arg(long, allow_negative_numbers = true, value_name = "G", value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub sum_groups: Option<u32>,

    /// Write sharded checkpoints into this folder: at the last step, and
    /// every --save-every steps.
    #[arg(long, value_name = "DIR")]
    pub ckpt: Option<PathBuf>,

    /// Save a checkpoint every K steps (needs --ckpt).
    #[arg(long, allow_negative_numbers = true, value_name = "K", value_parser = clap::value_parser!(u64).range(1..))]
    pub save_every: Option<u64>,

    /// Keep the newest N checkpoints in --ckpt, removing older ones.
    #[arg(long, allow_negative_numbers = true, value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub keep: u64,

    /// Resume from a checkpoint saved at any world size: a --ckpt folder
    /// (its `latest`) or one of its step-* folders.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,

    /// Write a trace of every step into this folder: one Chrome trace-event
    /// file per rank (trace-rank<R>.json) and all ranks in trace.json, to
    /// open in Perfetto or chrome://tracing, and timeline.svg (the last step):
    /// each unit's compute, each collective with its bytes, each wait.
    #[arg(long, value_name = "DIR")]
    pub trace: Option<PathBuf>,

    /// Run exercise NN.K with your code (the lesson's src/exercises.rs)
    /// instead of the answer; repeat or list for several (--mine 1,2).
    /// `just exercise NN-K` checks it against the committed snapshot.
    #[arg(long, allow_negative_numbers = true, value_name = "K", value_delimiter = ',', value_parser = clap::value_parser!(u8))]
    pub mine: Vec<u8>,
}

/// `120MB`, `1.5GB`, `512MiB`, `2e9`, `4096`: a size in bytes (MB = 10⁶, MiB = 2²⁰).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic() && c != 'e').unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let scale: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        _ => return Err(format!("`{s}` is not a size: use a number with B, KB, MB, GB, KiB, MiB or GiB, e.g. 120MB")),
    };
    match num.parse::<f64>() {
        Ok(x) if x.is_finite() && x * scale >= 1.0 && x * scale < 1.8e19 => Ok((x * scale).round() as u64),
        _ => Err(format!("`{s}` is not a size: use a positive number with B, KB, MB, GB, KiB, MiB or GiB, e.g. 120MB")),
    }
}

/// `--bucket-mb`: a positive, finite number of MB.
pub fn positive_mb(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(format!("`{s}` is not a positive number of MB (e.g. 0.5 or 25)")),
    }
}

fn positive_f32(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(format!("`{s}` is not a positive number")),
    }
}

fn non_negative_f32(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
        _ => Err(format!("`{s}` is not a number ≥ 0")),
    }
}

/// Parses the command line. `--help` prints on rank 0 and ends the run with
/// success; a bad flag becomes one line naming it (clap's first line).
pub fn parse_args<P: Parser>(lesson: &Lesson) -> anyhow::Result<P> {
    let cmd = P::command().name(lesson.package).about(lesson.title);
    let matches = match cmd.try_get_matches() {
        Ok(m) => m,
        Err(e) => {
            use clap::error::ErrorKind::*;
            if matches!(e.kind(), DisplayHelp | DisplayVersion | DisplayHelpOnMissingArgumentOrSubcommand) {
                if crate::lesson::is_root() {
                    print!("{}", e.render());
                }
                return Err(Stop::Success.into());
            }
            let first = e
                .render()
                .to_string()
                .lines()
                .next()
                .unwrap_or("bad arguments")
                .trim_start_matches("error: ")
                .to_string();
            anyhow::bail!("{first} (see --help)");
        }
    };
    P::from_arg_matches(&matches).map_err(|e| anyhow::anyhow!("{}", e.to_string().lines().next().unwrap_or("")))
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_parse_in_decimal_and_binary_units() {
        assert_eq!(parse_size("120MB"), Ok(120_000_000));
        assert_eq!(parse_size("1.5GB"), Ok(1_500_000_000));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("2e9"), Ok(2_000_000_000));
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("-5MB").is_err());
        assert!(parse_size("MB").is_err());
        assert!(parse_size("0.4B").is_err(), "a budget rounds to at least one byte");
    }
}
