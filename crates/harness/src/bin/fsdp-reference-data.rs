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
//! - `meta.json`: the model shape, B, T, M, the steps, AdamW's settings, and
//!   the norm of step 1's mean gradient at the initial weights, computed by
//!   the project's model in one process (what every outside trainer must
//!   reproduce at every world size: a sum instead of a mean would not).
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use candle_core::Tensor;
use clap::Parser;
use fsdp_gpt::{AdamWConfig, Gpt, GptConfig, ParamTable, Sampler};
use fsdp_harness::TrainArgs;
use fsdp_harness::session::{DEFAULT_MICRO_BATCHES, training_data};

/// Writes a lesson run's initial weights and batches for an outside reference.
#[derive(Debug, Parser)]
#[command(name = "fsdp-reference-data")]
struct Args {
    #[command(flatten)]
    train: TrainArgs,
}

fn main() -> ExitCode {
    fsdp_harness::launch::tool_main(run)
}

fn run(args: Args) -> anyhow::Result<()> {
    let a = args.train;
    let out = a.out.clone().context("pass --out DIR: the folder to write the reference data into")?;
    let ignored = [
        ("--resume", a.resume.is_some()),
        ("--ckpt", a.ckpt.is_some()),
        ("--save-every", a.save_every.is_some()),
        ("--mem-budget", a.mem_budget.is_some()),
        ("--sum-groups", a.sum_groups.is_some()),
        ("--grad-clip", a.grad_clip.is_some()),
        ("--mine", !a.mine.is_empty()),
    ];
    if let Some((flag, _)) = ignored.iter().find(|(_, given)| *given) {
        bail!("{flag} does not apply: the reference data is the seed's start and batches; leave {flag} out");
    }
    let m = a.micro_batches.map_or(DEFAULT_MICRO_BATCHES, |m| m as usize);
    let (corpus, cfg, sampler) = training_data(&a, m)?;
    std::fs::create_dir_all(&out).with_context(|| format!("cannot create --out folder {}", out.display()))?;

    let table = ParamTable::new(&cfg);
    let init = table.init_flat(a.seed);
    fsdp_gpt::weights_file::save(&out.join("init.safetensors"), &cfg, &corpus.vocab_string(), &init)?;
    let grad_norm = first_step_grad_norm(cfg, &table, &init, &sampler)?;

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
        "seq_len": sampler.seq_len,
        "micro_batches": m,
        "steps": a.steps,
        "lr": adamw.lr,
        "beta1": adamw.beta1,
        "beta2": adamw.beta2,
        "eps": adamw.eps,
        "weight_decay": adamw.weight_decay,
        "step1_grad_norm": grad_norm,
        // nanoGPT's decay rule: how many elements AdamW decays (the rest are 1-D tensors')
        "decayed_elements": table.numel() - table.no_decay_in(0..table.numel()).iter().map(|r| r.len()).sum::<usize>(),
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
        sampler.seq_len,
        corpus.tokens.len()
    );
    Ok(())
}

/// ‖g‖ of step 1's mean gradient over all M micro-batches, at `init`: one
/// process, one backward per micro-batch, summed, divided by M.
fn first_step_grad_norm(cfg: GptConfig, table: &ParamTable, init: &[f32], sampler: &Sampler) -> anyhow::Result<f64> {
    let model = Gpt::new(cfg);
    let vars = model.vars_from_flat(table, init)?;
    let params: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let mut sum = vec![0f32; table.numel()];
    for k in 0..sampler.micro_batches {
        let b = sampler.micro_batch(1, k)?;
        let loss = fsdp_gpt::model::loss(&model.forward(table, &params, &b.inputs)?, &b.targets)?;
        fsdp_gpt::model::add_grads(&loss.backward()?, &vars, &mut sum)?;
    }
    let m = sampler.micro_batches as f64;
    Ok(sum.iter().map(|&g| (g as f64 / m).powi(2)).sum::<f64>().sqrt())
}
