//! Prints the digest of one product, (512 × 1536) @ (1536 × 384), computed
//! by candle's own matmul and by ours (`fsdp_gpt::kernels::matmul`).
//! candle's blocks the 1536-long contraction by the cache sizes it reads
//! from the machine, so its digest can change with them; ours blocks by
//! them too (the `blocks` line) but adds each output's products in one
//! order whatever the blocks, so its digest cannot.
//! `tests/e2e/machine.rs` runs this under a faked cache topology.
use candle_core::{Device, Tensor};
use fsdp_gpt::params::digest_f32;
use fsdp_gpt::rng::SplitMix64;

fn main() -> candle_core::Result<()> {
    let mut rng = SplitMix64::new(7);
    let mut random = |r: usize, c: usize| {
        Tensor::from_vec((0..r * c).map(|_| rng.normal() as f32).collect::<Vec<_>>(), (r, c), &Device::Cpu)
    };
    let (a, b) = (random(512, 1536)?, random(1536, 384)?);
    let bits = |t: Tensor| -> candle_core::Result<u64> { Ok(digest_f32(&t.flatten_all()?.to_vec1::<f32>()?)) };
    println!("candle {:016x}", bits(a.matmul(&b)?)?);
    println!("ours {:016x}", bits(fsdp_gpt::kernels::matmul(&a, &b)?)?);
    let blocks = fsdp_gpt::kernels::Blocks::for_this_cpu();
    println!(
        "blocks kc {} (for k = 1536: {}), mc {}, nc {}; kc {} for an output of at most {} bytes",
        blocks.kc,
        blocks.kc_for(1536, 1024, 1024),
        blocks.mc,
        blocks.nc,
        blocks.kc_small,
        blocks.small_out
    );
    Ok(())
}
