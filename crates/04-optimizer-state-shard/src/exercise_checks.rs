//! The checks of lesson 04's exercises: one named snapshot test each.
//! Run one with `cargo test --release -p step04-optimizer-state-shard exercise_4_1`.
use fsdp_gpt::rng::SplitMix64;
use fsdp_harness::table::{Table, thousands};
use step04_optimizer_state_shard::zero::{SCHEMES, model_state_bytes};

use crate::exercises::*;

const MODELS: [(&str, f64); 3] = [("7B", 7e9), ("70B", 70e9), ("405B", 405e9)];

#[test]
fn exercise_4_1_the_16_bytes() {
    let mut t = Table::new(["model", "ranks", "data parallel GB", "ZeRO-1 GB", "ZeRO-2 GB", "ZeRO-3 GB"]);
    for (name, p) in MODELS {
        for ranks in [8, 64, 1024] {
            let mut row = vec![name.to_string(), ranks.to_string()];
            for (stage, _) in SCHEMES {
                let yours = bytes_per_device(p, ranks, stage, 12.0);
                let lesson = model_state_bytes(p, ranks, stage, 12.0);
                assert!(
                    (yours - lesson).abs() <= 1e-6 * lesson,
                    "{name} on {ranks} ranks, stage {stage}: {yours} vs {lesson}"
                );
                row.push(format!("{:.2}", yours / 1e9));
            }
            t.row(row);
        }
    }
    insta::assert_snapshot!(t.render());
}

#[test]
fn exercise_4_2_how_many_gpus() {
    let device = 80e9;
    let mut t = Table::new(["model", "data parallel", "ZeRO-1", "ZeRO-2", "ZeRO-3"]);
    for (name, p) in MODELS {
        let mut row = vec![name.to_string()];
        for (stage, _) in SCHEMES {
            let n = min_ranks_to_fit(p, stage, device);
            // Check against the formula: n fits, n − 1 does not.
            if let Some(n) = n {
                assert!(model_state_bytes(p, n, stage, 12.0) <= device, "{name} stage {stage}: {n} ranks do not fit");
                assert!(
                    n == 1 || model_state_bytes(p, n - 1, stage, 12.0) > device,
                    "{name} stage {stage}: {} ranks already fit",
                    n - 1
                );
            } else {
                assert!(
                    model_state_bytes(p, 1 << 40, stage, 12.0) > device,
                    "{name} stage {stage}: enough ranks do fit"
                );
            }
            row.push(n.map_or("never".to_string(), thousands));
        }
        t.row(row);
    }
    insta::assert_snapshot!(t.render());
}

#[test]
fn exercise_4_3_round_to_bf16() {
    let mut rng = SplitMix64::new(43);
    let mut xs: Vec<f32> =
        (0..100_000).map(|_| (rng.normal() * 10f64.powi((rng.below(20) as i32) - 10)) as f32).collect();
    xs.extend([
        0.0,
        -0.0,
        1.0,
        1.003_906_3,
        1.011_718_8,
        f32::MAX,
        f32::MIN_POSITIVE,
        1e-45,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
    ]);
    let mut ties = 0;
    let mut truncation_differs = 0;
    for &x in &xs {
        let yours = round_to_bf16(x);
        let candle = half::bf16::from_f32(x).to_bits();
        if x.is_nan() {
            assert!(half::bf16::from_bits(yours).is_nan(), "NaN must stay NaN");
            continue;
        }
        assert_eq!(yours, candle, "{x:e} (bits {:#010x})", x.to_bits());
        ties += usize::from(x.to_bits() & 0xFFFF == 0x8000);
        truncation_differs += usize::from(yours != (x.to_bits() >> 16) as u16);
    }
    insta::assert_snapshot!(format!(
        "{} values: every one rounds as candle does; {} exact ties (went to even); truncating instead would change {} of them",
        thousands(xs.len() as u64),
        ties,
        thousands(truncation_differs as u64)
    ));
}
