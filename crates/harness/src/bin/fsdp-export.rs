//! `fsdp-export`: one consolidated weights file from a sharded checkpoint.
//!
//! ```text
//! target/release/fsdp-export --ckpt out/ckpt --out model.safetensors
//! target/release/fsdp-eval --weights model.safetensors
//! ```
//! The checkpoint may come from any lesson and any world size: its shards
//! are checked (size, SHA-256), reassembled in rank order, and the fp32
//! master weights written with nanoGPT's names (`transformer.h.0.attn.c_attn.weight`, …).
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

/// Writes a sharded checkpoint's weights as one safetensors file with nanoGPT names.
#[derive(Debug, Parser)]
#[command(name = "fsdp-export")]
struct Args {
    /// A --ckpt folder (its `latest` checkpoint) or one of its step-* folders.
    #[arg(long)]
    ckpt: PathBuf,
    /// The consolidated weights file to write (written atomically).
    #[arg(long)]
    out: PathBuf,
}

fn main() -> ExitCode {
    fsdp_harness::launch::tool_main(run)
}

fn run(args: Args) -> anyhow::Result<()> {
    let (meta, state) = fsdp_harness::checkpoint::read(&args.ckpt, "--ckpt")?;
    let (m, cfg) = (&meta.model, meta.model.config());
    fsdp_gpt::weights_file::save(&args.out, &cfg, &meta.data.vocab, &state.master)?;
    println!(
        "{}: {} at step {}, {} shard file(s) from {} rank(s) → {} ({} params, digest {:016x})",
        state.from.display(),
        meta.lesson,
        state.step,
        meta.files.len(),
        meta.world_size * meta.replicas,
        args.out.display(),
        m.params,
        fsdp_gpt::params::digest_f32(&state.master)
    );
    Ok(())
}
