//! `zero-tally PARAMS RANKS`: model-state bytes per device for data
//! parallelism and ZeRO stages 1, 2, 3, from first principles — e.g.
//! `just tally 7B 64`, `just tally 405B 1024`. No model is built: instant.
use std::process::ExitCode;

use clap::Parser;
use fsdp_harness::table::{Table, thousands};
use step04_optimizer_state_shard::zero::{SCHEMES, model_state_bytes};

/// Model-state bytes per device for data parallelism and ZeRO stages 1–3.
#[derive(Debug, Parser)]
#[command(name = "zero-tally")]
struct Args {
    /// Parameter count: 7B, 70B, 405B, 124M, 1.5e9 …
    #[arg(value_parser = parse_count)]
    params: f64,
    /// Data-parallel ranks (devices) sharing the model.
    #[arg(value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    ranks: u64,
    /// Optimizer bytes per parameter (fp32 master + AdamW m + v = 12).
    #[arg(long, default_value_t = 12.0)]
    k: f64,
    /// Memory per device, in GB, for the "fits?" column.
    #[arg(long, default_value_t = 80.0)]
    device_gb: f64,
}

fn parse_count(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let (num, scale) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 1e3),
        Some('M') => (&t[..t.len() - 1], 1e6),
        Some('B') | Some('G') => (&t[..t.len() - 1], 1e9),
        Some('T') => (&t[..t.len() - 1], 1e12),
        _ => (t, 1.0),
    };
    match num.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x * scale),
        _ => Err(format!("`{s}` is not a parameter count: try 7B, 70B, 405B or 124M")),
    }
}

fn main() -> ExitCode {
    fsdp_harness::edge::tool_main(|a: Args| {
        anyhow::ensure!(
            a.k >= 0.0 && a.k.is_finite() && a.device_gb > 0.0 && a.device_gb.is_finite(),
            "--k must be ≥ 0 and --device-gb > 0"
        );
        tally(&a);
        Ok(())
    })
}

/// The table, and which schemes fit the device.
fn tally(a: &Args) {
    let formulas = ["(2 + 2 + K)·Ψ", "2Ψ + 2Ψ + K·Ψ/N", "2Ψ + (2 + K)·Ψ/N", "(2 + 2 + K)·Ψ/N"];
    println!(
        "Model states per device: Ψ = {} parameters on N = {} ranks; bf16 weights and gradients (2 + 2 bytes), K = {} bytes of optimizer state (fp32 master, AdamW m and v).\n",
        thousands(a.params as u64),
        thousands(a.ranks),
        a.k
    );
    let mut t = Table::new([
        "scheme",
        "formula",
        "bytes / param / device",
        "GB / device",
        &format!("fits {} GB?", a.device_gb),
    ]);
    for (&(stage, name), f) in SCHEMES.iter().zip(formulas) {
        let bytes = model_state_bytes(a.params, a.ranks, stage, a.k);
        let fits = if bytes <= a.device_gb * 1e9 { "yes" } else { "no" };
        t.row([
            name.to_string(),
            f.to_string(),
            format!("{:.3}", bytes / a.params),
            format!("{:.2}", bytes / 1e9),
            fits.to_string(),
        ]);
    }
    println!("{}", t.render());
    println!(
        "GB = 10⁹ bytes. Activations, temporary buffers and fragmentation come on top; ZeRO-3's unsharded unit too."
    );
}
