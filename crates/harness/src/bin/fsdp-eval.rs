//! `fsdp-eval`: the mean next-character loss of a weights file on a text.
//!
//! ```text
//! target/release/fsdp-eval --weights out/02-whole-model-shard/weights.safetensors
//! target/release/fsdp-eval --weights w.safetensors --data my.txt --batches 20
//! ```
//! The text is cut into consecutive, non-overlapping windows of the model's
//! block size; the loss is averaged over `--batches` batches of them.
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use candle_core::{Device, Tensor};
use clap::Parser;
use fsdp_gpt::{Corpus, Gpt, ParamTable};

/// Reports the mean loss of a weights file (written by any lesson) on a text.
#[derive(Debug, Parser)]
#[command(name = "fsdp-eval")]
struct Args {
    /// A weights.safetensors written by a lesson.
    #[arg(long)]
    weights: PathBuf,
    /// A UTF-8 text; default: the generated corpus the lessons train on.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Batches of 8 windows to average over.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    batches: u32,
    /// Print `{"mean_loss": …, "windows": …}` at full precision instead.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    fsdp_harness::launch::tool_main(run)
}

fn run(args: Args) -> anyhow::Result<()> {
    let w = fsdp_gpt::weights_file::load(&args.weights)?;
    let vocab = Corpus::from_text("weights vocabulary", &w.vocab)?;
    let (source, text) = match &args.data {
        Some(p) => {
            let c = Corpus::from_file(&p.display().to_string())?; // checks UTF-8 and emptiness
            (p.display().to_string(), c.tokens.iter().map(|&t| c.vocab[t as usize]).collect::<String>())
        }
        None => (
            "generated".to_string(),
            Corpus::generated().tokens.iter().map(|&t| Corpus::generated_vocab()[t as usize]).collect(),
        ),
    };
    let tokens = vocab.encode(&text).with_context(|| format!("cannot evaluate on {source}"))?;
    let t = w.cfg.block_size;
    let windows = (tokens.len() - 1) / t;
    if windows == 0 {
        bail!("{source} has {} characters; the model needs at least {} for one window", tokens.len(), t + 1);
    }
    let table = ParamTable::new(&w.cfg);
    let model = Gpt::new(w.cfg);
    let vars = model.vars_from_flat(&table, &w.flat)?;
    let params: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let (b, n) = (8, (args.batches as usize * 8).min(windows));
    let mut sum = 0.0;
    let mut count = 0;
    for chunk in (0..n).collect::<Vec<_>>().chunks(b) {
        let x: Vec<u32> = chunk.iter().flat_map(|&i| tokens[i * t..i * t + t].to_vec()).collect();
        let y: Vec<u32> = chunk.iter().flat_map(|&i| tokens[i * t + 1..i * t + t + 1].to_vec()).collect();
        let x = Tensor::from_vec(x, (chunk.len(), t), &Device::Cpu)?;
        let y = Tensor::from_vec(y, (chunk.len(), t), &Device::Cpu)?;
        let logits = model.forward(&table, &params, &x)?;
        sum += fsdp_gpt::model::loss(&logits, &y)?.to_scalar::<f32>()? as f64 * chunk.len() as f64;
        count += chunk.len();
    }
    if args.json {
        println!("{}", serde_json::json!({"mean_loss": sum / count as f64, "windows": count}));
        return Ok(());
    }
    println!(
        "{}: mean loss {:.4} over {} windows of {t} characters of {source} ({} params)",
        args.weights.display(),
        sum / count as f64,
        count,
        table.numel()
    );
    Ok(())
}
