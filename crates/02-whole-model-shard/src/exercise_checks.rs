//! The checks of lesson 02's exercises: one named snapshot test each.
//! Run one with `cargo test --release -p step02-whole-model-shard exercise_2_1`.
use fsdp_comm::ShardLayout;
use fsdp_gpt::rng::SplitMix64;
use fsdp_gpt::{AdamW, AdamWConfig, GptConfig, ParamTable};
use fsdp_harness::table::{Table, mb, sci, thousands};

use crate::exercises::*;

fn tiny_numel() -> usize {
    ParamTable::new(&GptConfig::preset("tiny", 65).expect("tiny exists")).numel()
}

#[test]
fn exercise_2_1_predict_the_tally_at_4_ranks() {
    let numel = tiny_numel();
    let mut t = Table::new(["ranks", "shard elements", "padding", "master+m+v per rank"]);
    for ranks in [1, 2, 3, 4, 7, 8] {
        let (shard, padding) = shard_len_and_padding(numel, ranks);
        let l = ShardLayout::new(numel, ranks);
        assert_eq!((shard, padding), (l.shard_len, l.padding()), "{ranks} ranks");
        t.row([ranks.to_string(), thousands(shard as u64), padding.to_string(), mb(3 * 4 * shard as u64)]);
    }
    insta::assert_snapshot!(t.render());
}

#[test]
fn exercise_2_2_the_order_of_a_sum() {
    let mut rng = SplitMix64::new(22);
    let ranks: Vec<Vec<f32>> = (0..4).map(|_| (0..10_000).map(|_| rng.normal() as f32).collect()).collect();
    let ordered: Vec<f32> =
        ranks.iter().fold(vec![0.0; 10_000], |acc, r| acc.iter().zip(r).map(|(a, b)| a + b).collect());
    let reversed = sum_in_reverse_rank_order(&ranks);
    let exact_same: Vec<f32> =
        ranks.iter().rev().fold(vec![0.0; 10_000], |acc, r| acc.iter().zip(r).map(|(a, b)| a + b).collect());
    assert_eq!(reversed, exact_same, "add rank N−1 first, then N−2, …, then rank 0");
    let differ = ordered.iter().zip(&reversed).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
    let max = ordered.iter().zip(&reversed).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    insta::assert_snapshot!(format!(
        "4 ranks, 10,000 elements: {differ} sums differ in their bits; largest difference {}",
        sci(max as f64)
    ));
}

#[test]
fn exercise_2_3_break_the_proof() {
    // Two ranks, the tiny model's size, one AdamW step each way.
    let numel = tiny_numel();
    let layout = ShardLayout::new(numel, 2);
    let mut rng = SplitMix64::new(23);
    let init: Vec<f32> = (0..numel).map(|_| (rng.normal() * 0.02) as f32).collect();
    let grads: Vec<f32> = (0..numel).map(|_| (rng.normal() * 1e-2) as f32).collect();
    let cfg = AdamWConfig::default();
    let mut replicated = init.clone();
    AdamW::new(cfg, numel).step(&mut replicated, &grads);
    let mut sharded = init.clone();
    for rank in 0..2 {
        let shard = layout.shard(rank).range();
        let part = elements_to_update(shard.clone());
        assert!(part.start >= shard.start && part.end <= shard.end, "stay inside your shard");
        AdamW::new(cfg, part.len()).step(&mut sharded[part.clone()], &grads[part]);
    }
    let stale = sharded.iter().zip(&init).filter(|(a, b)| a == b).count();
    let max = sharded.iter().zip(&replicated).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    insta::assert_snapshot!(format!(
        "max |sharded − replicated| = {} after one step; {} of {} elements never updated",
        sci(max as f64),
        thousands(stale as u64),
        thousands(numel as u64)
    ));
}
