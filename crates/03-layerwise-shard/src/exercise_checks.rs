//! The checks of lesson 03's exercises: one named snapshot test each.
//! Run one with `cargo test --release -p step03-layerwise-shard exercise_3_1`.
use fsdp_comm::ShardLayout;
use fsdp_gpt::rng::SplitMix64;
use fsdp_gpt::{GptConfig, ParamTable};
use fsdp_harness::table::{Table, mb, thousands};
use step03_layerwise_shard::HeadGrad;
use step03_layerwise_shard::tally::bytes_per_step;
use step03_layerwise_shard::units::unit_params;

use crate::exercises::*;

/// The element count of each unit with `g` blocks per unit, root first.
fn unit_sizes(cfg: &GptConfig, g: usize) -> Vec<usize> {
    let table = ParamTable::new(cfg);
    unit_params(&table, cfg.n_layer, g).iter().map(|(_, ps)| ps.iter().map(|&i| table.specs[i].numel()).sum()).collect()
}

#[test]
fn exercise_3_1_group_two_blocks_per_unit() {
    let mut t = Table::new(["preset", "blocks per unit", "units", "largest unit", "MB unsharded", "whole model MB"]);
    for name in ["tiny", "small", "gpt2"] {
        let vocab = if name == "gpt2" { 50_257 } else { 65 };
        let cfg = GptConfig::preset(name, vocab).expect("preset exists");
        let one = unit_sizes(&cfg, 1);
        let (root, block, whole) = (one[0], one[1], one.iter().sum::<usize>());
        for g in [1, 2, 3, cfg.n_layer] {
            let sizes = unit_sizes(&cfg, g);
            let largest = *sizes.iter().max().expect("units");
            assert_eq!(largest_unit(root, block, cfg.n_layer, g), largest, "{name}, {g} blocks per unit");
            t.row([
                name.to_string(),
                g.to_string(),
                sizes.len().to_string(),
                thousands(largest as u64),
                mb(4 * largest as u64),
                mb(4 * whole as u64),
            ]);
        }
    }
    insta::assert_snapshot!(t.render());
}

#[test]
fn exercise_3_2_count_the_all_gathers() {
    let cfg = GptConfig::preset("tiny", 65).expect("tiny exists");
    let sizes = unit_sizes(&cfg, 1);
    let whole: usize = sizes.iter().sum();
    let mut t =
        Table::new(["ranks", "lesson 03 all-gather bytes / step", "lesson 02 all-gather bytes / step", "ratio"]);
    for ranks in [1, 2, 3, 4, 8] {
        let layouts: Vec<ShardLayout> = sizes.iter().map(|&n| ShardLayout::new(n, ranks)).collect();
        let (lesson, _) = bytes_per_step(&layouts, HeadGrad::Keep, 4); // the root gathered twice, fp32
        assert_eq!(all_gather_bytes(&sizes, ranks), lesson, "{ranks} ranks");
        let l = ShardLayout::new(whole, ranks);
        let whole_model = ((ranks - 1) * l.shard_len * 4) as u64;
        let ratio =
            if whole_model == 0 { "—".to_string() } else { format!("{:.2}×", lesson as f64 / whole_model as f64) };
        t.row([ranks.to_string(), thousands(lesson), thousands(whole_model), ratio]);
    }
    insta::assert_snapshot!(t.render());
}

#[test]
fn exercise_3_3_reduce_once_or_per_micro_batch() {
    let (ranks, k, len) = (4, 3, 10_000);
    let mut rng = SplitMix64::new(33);
    let grads: Vec<Vec<Vec<f32>>> =
        (0..ranks).map(|_| (0..k).map(|_| (0..len).map(|_| rng.normal() as f32).collect()).collect()).collect();
    // Reduce once: each rank sums its micro-batches, then one reduce over the ranks (here left to right).
    let sum = |vs: &mut dyn Iterator<Item = &Vec<f32>>| {
        vs.fold(vec![0.0f32; len], |acc, g| acc.iter().zip(g).map(|(a, b)| a + b).collect::<Vec<f32>>())
    };
    let local: Vec<Vec<f32>> = grads.iter().map(|r| sum(&mut r.iter())).collect();
    let once = sum(&mut local.iter());
    // The exercise's order, worked out here independently.
    let mut expected = vec![0.0f32; len];
    for kk in 0..k {
        let reduced = sum(&mut grads.iter().map(|r| &r[kk]));
        expected.iter_mut().zip(&reduced).for_each(|(t, x)| *t += x);
    }
    let every = reduce_every_micro_batch(&grads);
    assert_eq!(every, expected, "for each micro-batch: the rank-order sum, then onto the running total");
    let differ = once.iter().zip(&every).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
    insta::assert_snapshot!(format!(
        "{ranks} ranks × {k} micro-batches, {} elements: {} sums differ in their bits; reducing after every micro-batch sends {k}× the reduce-scatter bytes",
        thousands(len as u64),
        thousands(differ as u64)
    ));
}
