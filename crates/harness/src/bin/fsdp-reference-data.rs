//! `fsdp-reference-data`: what an outside implementation needs to train
//! exactly what a lesson trains — for `just compare-pytorch`.
//!
//! ```text
//! target/release/fsdp-reference-data --out out/ref --steps 20 --micro-batches 2
//! python3 pytorch/gpt.py … --data out/ref
//! ```
//! Takes a lesson's flags (the same defaults, the same seed) and writes:
//! - `init.safetensors`: the seed's initial weights, nanoGPT's names (as
//!   `fsdp-export` writes them);
//! - `batches.u32`: every step's global batch, little-endian u32, shaped
//!   (steps, M, 2, B, T): each micro-batch's inputs, then its targets;
//! - `corpus.u32`: the training text as token ids (what `fsdp-eval` reads);
//! - `meta.json`: the model shape, B, T, M, the steps and AdamW's settings.
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::Parser;
use fsdp_gpt::{AdamWConfig, Corpus, GptConfig, ParamTable, Sampler};
use fsdp_harness::TrainArgs;

/// Writes a lesson run's initial weights and batches for an outside reference.
#[derive(Debug, Parser)]
#[command(name = "fsdp-reference-data")]
struct Args {
    #[command(flatten)]
    train: TrainArgs,
}

fn main() -> ExitCode {
    fsdp_harness::edge::tool_main(run)
}

fn run(args: Args) -> anyhow::Result<()> {
    let a = args.train;
    let out = a.out.clone().context("pass --out DIR: the folder to write the reference data into")?;
    let corpus = match &a.data {
        Some(p) => Corpus::from_file(&p.display().to_string())?,
        None => Corpus::generated(),
    };
    let cfg = GptConfig::preset(&a.preset, corpus.vocab.len())?;
    let seq_len = a.seq_len.map_or(cfg.block_size, |t| t as usize);
    if seq_len > cfg.block_size {
        bail!("--seq-len {seq_len} exceeds the {} preset's block size {}", a.preset, cfg.block_size);
    }
    let m = a.micro_batches.unwrap_or(4) as usize; // the lessons' default
    let sampler = Sampler::new(&corpus, a.batch_size as usize, seq_len, m, a.seed)?;
    std::fs::create_dir_all(&out).with_context(|| format!("cannot create --out folder {}", out.display()))?;

    let table = ParamTable::new(&cfg);
    fsdp_gpt::weights_file::save(
        &out.join("init.safetensors"),
        &cfg,
        &corpus.vocab_string(),
        &table.init_flat(a.seed),
    )?;

    let mut batches = Vec::with_capacity(a.steps as usize * sampler.tokens_per_step() * 2 * 4);
    for step in 1..=a.steps {
        for k in 0..m {
            let b = sampler.micro_batch(step, k)?;
            for t in [&b.inputs, &b.targets] {
                batches.extend(t.flatten_all()?.to_vec1::<u32>()?.iter().flat_map(|x| x.to_le_bytes()));
            }
        }
    }
    let write = |name: &str, data: &[u8]| -> anyhow::Result<()> {
        let p: PathBuf = out.join(name);
        fsdp_gpt::weights_file::write_atomically(&p, data).with_context(|| format!("cannot write {}", p.display()))
    };
    write("batches.u32", &batches)?;
    write("corpus.u32", &corpus.tokens.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>())?;
    let adamw = AdamWConfig { lr: a.lr, weight_decay: a.weight_decay, ..AdamWConfig::default() };
    let meta = serde_json::json!({
        "preset": a.preset,
        "seed": a.seed,
        "vocab_size": cfg.vocab_size,
        "block_size": cfg.block_size,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_embd": cfg.n_embd,
        "params": table.numel(),
        "batch_size": a.batch_size,
        "seq_len": seq_len,
        "micro_batches": m,
        "steps": a.steps,
        "lr": adamw.lr,
        "beta1": adamw.beta1,
        "beta2": adamw.beta2,
        "eps": adamw.eps,
        "weight_decay": adamw.weight_decay,
    });
    write("meta.json", serde_json::to_string_pretty(&meta)?.as_bytes())?;
    println!(
        "{}: {} initial weights ({} params), {} steps × {} micro-batches of {} × {} tokens, {} corpus tokens",
        out.display(),
        a.preset,
        table.numel(),
        a.steps,
        m,
        a.batch_size,
        seq_len,
        corpus.tokens.len()
    );
    Ok(())
}
