//! `fsdp-sample`: what a trained model writes (nanoGPT's `sample.py`).
//!
//! ```text
//! target/release/fsdp-sample                                  # lesson 02's out/…/weights.safetensors
//! target/release/fsdp-sample --ckpt out/ck --prompt "KING:" --tokens 300
//! target/release/fsdp-sample --untrained                      # the lessons' initial weights
//! ```
//! One character at a time: the model's own forward over the last
//! `block_size` characters, the next character drawn from the last
//! position's logits (divided by `--temperature`, cut to the `--top-k`
//! largest) with a seeded generator. No KV cache: every token runs the whole
//! forward over its context — at most the block size (64 characters for the
//! tiny preset), so a cache would save little. The text alone goes to
//! stdout (`fsdp-sample > story.txt` keeps only it); a closing line on
//! stderr says where the weights came from, the settings and the rate. The
//! same weights, prompt and seed give the same text, byte for byte, on every
//! machine the weights' bits are promised on.
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, bail};
use candle_core::{Device, Tensor};
use clap::Parser;
use fsdp_gpt::{Corpus, Gpt, GptConfig, ParamTable};

/// Writes text with a trained model: from a weights file or a (sharded) checkpoint.
#[derive(Debug, Parser)]
#[command(name = "fsdp-sample")]
struct Args {
    /// A weights.safetensors written by a lesson or fsdp-export (default:
    /// out/02-whole-model-shard/weights.safetensors, what `just step 02` writes).
    #[arg(long, conflicts_with_all = ["ckpt", "untrained"])]
    weights: Option<PathBuf>,
    /// A --ckpt folder (its `latest` checkpoint) or one of its step-* folders:
    /// its shards are read and reassembled, as fsdp-export does.
    #[arg(long, conflicts_with = "untrained")]
    ckpt: Option<PathBuf>,
    /// The lessons' initial weights (seed 1337, the generated corpus's
    /// vocabulary) of --preset: what training starts from.
    #[arg(long)]
    untrained: bool,
    /// With --untrained, the model's shape; otherwise, the shape the weights must have.
    #[arg(long)]
    preset: Option<String>,
    /// The text to continue; every character must be in the model's vocabulary.
    #[arg(long, default_value = "\n")]
    prompt: String,
    /// Characters to write.
    #[arg(long, default_value_t = 200, allow_negative_numbers = true, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    tokens: u32,
    /// Logits are divided by it: below 1 more predictable, above 1 more varied.
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true, value_parser = positive)]
    temperature: f32,
    /// Draw only among the K likeliest characters (default: all).
    #[arg(long, value_name = "K", allow_negative_numbers = true, value_parser = clap::value_parser!(u32).range(1..))]
    top_k: Option<u32>,
    /// The sampling generator's seed: the same seed, the same text.
    #[arg(long, default_value_t = 1337, allow_negative_numbers = true)]
    seed: u64,
}

fn positive(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(format!("`{s}` is not a positive temperature (try 0.8; 1 samples the model as it is)")),
    }
}

const DEFAULT_WEIGHTS: &str = "out/02-whole-model-shard/weights.safetensors";
const PRESETS: [&str; 3] = ["tiny", "small", "gpt2"];

fn main() -> ExitCode {
    fsdp_harness::launch::tool_main(run)
}

/// The preset a shape is, if any.
fn preset_of(cfg: &GptConfig) -> Option<&'static str> {
    PRESETS.into_iter().find(|p| GptConfig::preset(p, cfg.vocab_size).is_ok_and(|c| c == *cfg))
}

fn run(a: Args) -> anyhow::Result<()> {
    // The weights, their shape and their vocabulary; and where they came from.
    let (cfg, vocab, flat, from) = match (&a.weights, &a.ckpt, a.untrained) {
        (_, _, true) => {
            let preset = a.preset.as_deref().unwrap_or("tiny");
            let vocab = Corpus::generated_vocab();
            let cfg = GptConfig::preset(preset, vocab.len())?;
            let flat = ParamTable::new(&cfg).init_flat(1337);
            (
                cfg,
                vocab.into_iter().collect::<String>(),
                flat,
                format!("the untrained {preset} model (initial weights of seed 1337)"),
            )
        }
        (None, Some(dir), false) => {
            let (meta, state) = fsdp_harness::checkpoint::read(dir, "--ckpt")?;
            let cfg = meta.model.config();
            let from = format!("{} at step {}", state.from.display(), state.step);
            (cfg, meta.data.vocab.clone(), state.master, from)
        }
        (w, None, false) => {
            let path = w.clone().unwrap_or_else(|| PathBuf::from(DEFAULT_WEIGHTS));
            if w.is_none() && !path.exists() {
                bail!("no {DEFAULT_WEIGHTS}: run `just step 02` first, or pass --weights FILE or --ckpt DIR");
            }
            let file = fsdp_gpt::weights_file::load(&path)?;
            (file.cfg, file.vocab, file.flat, path.display().to_string())
        }
        (Some(_), Some(_), false) => unreachable!("clap refuses --weights with --ckpt"),
    };
    if let (Some(want), false) = (&a.preset, a.untrained) {
        GptConfig::preset(want, cfg.vocab_size)?; // an unknown name says so
        let is = preset_of(&cfg).map_or("a shape of no preset".to_string(), |p| format!("the {p} preset"));
        if preset_of(&cfg) != Some(want.as_str()) {
            bail!("{from} is {is}, not --preset {want}: leave out --preset, or pass weights of that preset");
        }
    }
    let vocab = Corpus::from_text("the model's vocabulary", &vocab)?;
    let outside: Vec<char> = {
        let mut v: Vec<char> = a.prompt.chars().filter(|c| vocab.vocab.binary_search(c).is_err()).collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    if !outside.is_empty() {
        bail!(
            "--prompt has {} character(s) the model has never seen: {}; use only these {}: {:?}",
            outside.len(),
            outside.iter().map(|c| format!("{c:?}")).collect::<Vec<_>>().join(" "),
            vocab.vocab.len(),
            vocab.vocab_string()
        );
    }
    if a.prompt.is_empty() {
        bail!("--prompt is empty: give the model at least one character to continue (the default is a newline)");
    }
    let mut tokens = vocab.encode(&a.prompt).context("the prompt")?;

    let table = ParamTable::new(&cfg);
    let model = Gpt::new(cfg);
    let vars = model.vars_from_flat(&table, &flat)?;
    let params: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let mut rng = fsdp_gpt::rng::SplitMix64::new(a.seed);
    let mut text = String::new();
    let t0 = Instant::now();
    for _ in 0..a.tokens {
        let ctx = &tokens[tokens.len().saturating_sub(cfg.block_size)..]; // (T,), T ≤ block size
        let x = Tensor::from_slice(ctx, (1, ctx.len()), &Device::Cpu)?;
        let logits = model.forward(&table, &params, &x)?; // (1, T, vocab)
        let last = logits.get(0)?.get(ctx.len() - 1)?.to_vec1::<f32>()?; // (vocab,)
        let next = draw(&last, a.temperature, a.top_k.map(|k| k as usize), &mut rng);
        tokens.push(next as u32);
        text.push(vocab.vocab[next]);
    }
    let secs = t0.elapsed().as_secs_f64();
    println!("{}{text}", a.prompt);
    // The rate differs from run to run: on stderr, so that stdout is the text alone.
    eprintln!(
        "\n— {} characters from {from}; temperature {}, top-k {}, seed {}; {:.0} tokens/s, without a KV cache (each token a forward over up to {} characters)",
        a.tokens,
        a.temperature,
        a.top_k.map_or("all".to_string(), |k| k.to_string()),
        a.seed,
        a.tokens as f64 / secs,
        cfg.block_size
    );
    Ok(())
}

/// The next token: softmax(logits / temperature) over the `top_k` largest
/// (ties broken toward the lower index), drawn by one uniform number. In
/// f64, summed in index order: the same bits of logits give the same token.
fn draw(logits: &[f32], temperature: f32, top_k: Option<usize>, rng: &mut fsdp_gpt::rng::SplitMix64) -> usize {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&i, &j| logits[j].total_cmp(&logits[i]).then(i.cmp(&j)));
    let keep = top_k.unwrap_or(logits.len()).min(logits.len());
    let mut kept = order[..keep].to_vec();
    kept.sort_unstable(); // index order for the sum
    let top = logits[order[0]] as f64 / temperature as f64;
    let weights: Vec<f64> = kept.iter().map(|&i| (logits[i] as f64 / temperature as f64 - top).exp()).collect();
    let total: f64 = weights.iter().sum();
    let mut u = rng.next_f64() * total;
    for (&i, &w) in kept.iter().zip(&weights) {
        if u < w {
            return i;
        }
        u -= w;
    }
    *kept.last().expect("at least one character")
}
