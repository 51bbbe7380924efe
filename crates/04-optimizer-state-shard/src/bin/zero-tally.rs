//! `zero-tally PARAMS RANKS`: model-state bytes per device for data
//! parallelism and ZeRO stages 1, 2, 3, from first principles — e.g.
//! `just tally 7B 64`, `just tally 405B 1024`. `--hsdp S` adds hybrid
//! sharding (shard within groups of S ranks, replicate across groups) and
//! what it trades; `--offload` moves the optimizer state to host memory.
//! No model is built: instant.
use std::process::ExitCode;

use clap::Parser;
use fsdp_harness::table::{Table, thousands};
use step04_optimizer_state_shard::zero::{SCHEMES, model_state_bytes};

/// Model-state bytes per device for data parallelism and ZeRO stages 1–3.
#[derive(Debug, Parser)]
#[command(name = "zero-tally")]
struct Args {
    /// Parameter count: 7B, 70B, 405B, 124M, 1.5e9 … (a whole number, at most 2^53)
    #[arg(allow_hyphen_values = true, value_parser = parse_count)]
    params: f64,
    /// Data-parallel ranks (devices) sharing the model.
    #[arg(allow_negative_numbers = true, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    ranks: u64,
    /// Optimizer bytes per parameter (fp32 master + AdamW m + v = 12).
    #[arg(long, allow_negative_numbers = true, default_value_t = 12.0)]
    k: f64,
    /// Memory per device, in GB, for the "fits?" column.
    #[arg(long, allow_negative_numbers = true, default_value_t = 80.0)]
    device_gb: f64,
    /// Hybrid sharding (PyTorch's HSDP, DeepSpeed's MiCS): shard within
    /// groups of S ranks (e.g. one node), replicate across the N/S groups.
    #[arg(long, allow_negative_numbers = true, value_name = "S", value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    hsdp: Option<u64>,
    /// Keep the optimizer state (the K bytes: fp32 master, m, v) in host
    /// memory and run the update there; the device keeps the rest (ZeRO-Offload
    /// and FSDP2's CPU offload move gradients, FSDP2 also parameters, too).
    #[arg(long)]
    offload: bool,
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
    // f64 holds every whole number up to 2^53 exactly: the count printed is the count used.
    const EXACT: f64 = 9_007_199_254_740_992.0;
    // 4.1 × 10⁶ is 4099999.9999999995 in f64: a product within a few ulps of a whole number is it.
    let whole = |x: f64| if (x - x.round()).abs() <= 4.0 * f64::EPSILON * x.abs() { x.round() } else { x };
    match num.parse::<f64>().map(|x| whole(x * scale)) {
        Ok(x) if (1.0..=EXACT).contains(&x) && x.fract() == 0.0 => Ok(x),
        Ok(x) if x > EXACT => Err(format!(
            "`{s}` is more parameters than the tally counts exactly (at most 2^53 ≈ 9.0e15; 405B is 4.05e11)"
        )),
        Ok(x) if x >= 1.0 && x.fract() != 0.0 => Err(format!("`{s}` is not a whole number of parameters")),
        _ => Err(format!("`{s}` is not a parameter count: try 7B, 70B, 405B or 124M")),
    }
}

fn main() -> ExitCode {
    fsdp_harness::launch::tool_main(|a: Args| {
        anyhow::ensure!(
            a.k >= 0.0 && a.k.is_finite() && a.device_gb > 0.0 && a.device_gb.is_finite(),
            "--k must be ≥ 0 and --device-gb > 0"
        );
        if let Some(s) = a.hsdp {
            anyhow::ensure!(
                a.ranks.is_multiple_of(s),
                "--hsdp {s} does not divide {} ranks into equal shard groups: pass a divisor of {}",
                a.ranks,
                a.ranks
            );
        }
        tally(&a);
        if let Some(s) = a.hsdp {
            hsdp(&a, s);
        }
        Ok(())
    })
}

/// One row per scheme: its formula, bytes per parameter on the device, GB on
/// the device, GB in host memory under `--offload`, and whether it fits.
fn rows(a: &Args, shard_ranks: u64, names: &[(u8, String)], formulas: &[&str]) -> Table {
    let fits_col = format!("fits {} GB?", a.device_gb);
    let mut head = vec!["scheme", "formula", "bytes / param / device", "GB / device"];
    if a.offload {
        head.push("GB in host memory / device");
    }
    head.push(&fits_col);
    let mut t = Table::new(head);
    for ((stage, name), f) in names.iter().zip(formulas) {
        let all = model_state_bytes(a.params, shard_ranks, *stage, a.k);
        // Offload: the K bytes leave the device (sharded from stage 1 on): it keeps the states with K = 0.
        let device = if a.offload { model_state_bytes(a.params, shard_ranks, *stage, 0.0) } else { all };
        let host = all - device;
        let mut row =
            vec![name.clone(), f.to_string(), format!("{:.3}", device / a.params), format!("{:.2}", device / 1e9)];
        if a.offload {
            row.push(format!("{:.2}", host / 1e9));
        }
        row.push(if device <= a.device_gb * 1e9 { "yes" } else { "no" }.to_string());
        t.row(row);
    }
    t
}

/// The table, and which schemes fit the device.
fn tally(a: &Args) {
    let formulas = match a.offload {
        false => ["(2 + 2 + K)·Ψ", "2Ψ + 2Ψ + K·Ψ/N", "2Ψ + (2 + K)·Ψ/N", "(2 + 2 + K)·Ψ/N"],
        true => ["(2 + 2)·Ψ", "2Ψ + 2Ψ", "2Ψ + 2·Ψ/N", "(2 + 2)·Ψ/N"], // on the device; K on the host
    };
    println!(
        "Model states per device: Ψ = {} parameters on N = {} ranks; bf16 weights and gradients (2 + 2 bytes), K = {} bytes of optimizer state (fp32 master, AdamW m and v).\n",
        thousands(a.params as u64),
        thousands(a.ranks),
        a.k
    );
    let names: Vec<(u8, String)> = SCHEMES.iter().map(|&(st, n)| (st, n.to_string())).collect();
    println!("{}", rows(a, a.ranks, &names, &formulas).render());
    println!(
        "GB = 10⁹ bytes. Activations, temporary buffers and fragmentation come on top; ZeRO-3's unsharded unit too."
    );
    if a.offload {
        println!(
            "--offload: the formulas are the device's, with only the K bytes per parameter moved to host memory (K·Ψ, or K·Ψ/N once sharded; /S under --hsdp): each step sends the gradient shard to the host and the updated weights back. ZeRO-Offload keeps the gradients there too, FSDP2's CPUOffloadPolicy the sharded parameters as well."
        );
    }
}

/// Hybrid sharding: every stage sharded over S ranks instead of N, and the
/// communication it buys, per device per step, in units of Ψ elements:
/// within a shard group (a node's fast links) and across groups.
fn hsdp(a: &Args, s: u64) {
    let (n, r) = (a.ranks as f64, (a.ranks / s) as f64);
    let sf = s as f64;
    println!(
        "\nHSDP: shard within groups of S = {s} ranks, replicate across N/S = {} groups (model states as above with N → S):\n",
        a.ranks / s
    );
    let names: Vec<(u8, String)> = SCHEMES[1..].iter().map(|&(st, _)| (st, format!("HSDP, ZeRO-{st}"))).collect();
    let formulas = match a.offload {
        false => ["2Ψ + 2Ψ + K·Ψ/S", "2Ψ + (2 + K)·Ψ/S", "(2 + 2 + K)·Ψ/S"],
        true => ["2Ψ + 2Ψ", "2Ψ + 2·Ψ/S", "(2 + 2)·Ψ/S"],
    };
    println!("{}", rows(a, s, &names, &formulas).render());
    // ZeRO-3 each step: two all-gathers of the weights and one reduce-scatter
    // of the gradient, each moving (G−1)/G of Ψ per device over a group of G;
    // HSDP adds an all-reduce of each device's Ψ/S gradient shard among the R
    // replicas. Across one group's boundary, at least: full sharding must
    // bring in (or send out) the (R−1)/R of Ψ the group does not hold, three
    // times; HSDP's all-reduce moves 2·(R−1)/R of the group's Ψ.
    let mut t = Table::new([
        "ZeRO-3, elements / step",
        "sent per device",
        "of which in collectives spanning groups",
        "crossing one group's boundary (at least)",
    ]);
    let cell = |x: f64| format!("{x:.3} Ψ");
    let full = 3.0 * (n - 1.0) / n;
    t.row(["sharded over all N".to_string(), cell(full), cell(full), cell(3.0 * (r - 1.0) / r)]);
    let (inner, outer) = (3.0 * (sf - 1.0) / sf, 2.0 * (r - 1.0) / r / sf);
    t.row([format!("HSDP, S = {s}"), cell(inner + outer), cell(outer), cell(2.0 * (r - 1.0) / r)]);
    println!("{}", t.render());
    println!(
        "Across group boundaries HSDP moves two thirds of what full sharding must move at the least: one all-reduce of the gradient instead of two gathers and a reduce-scatter (flat collectives, which send every far rank its own copy, move more; `just hsdp` measures both on two simulated nodes). What it wins more is where: every unit's all-gather, on the critical path of forward and backward, stays on a group's fast links, and its latency grows with S, not N. The price is memory: each device holds 1/S of the sharded states instead of 1/N, N/S = {} times as much.",
        a.ranks / s
    );
}
