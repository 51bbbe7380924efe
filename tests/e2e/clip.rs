//! `--grad-clip`: clipping by the global norm, the one step of the update
//! that needs every shard, gives lesson 01's bits in every lesson at every
//! world size — its sum of squares is exact, so no order needs agreeing on.
use crate::common::*;

const CLIP: &[&str] = &["--grad-clip", "0.3"];

/// Every lesson and ZeRO stage, at 1, 2, 3, 4 and 8 ranks, with clipping on
/// (0.3 against norms of 1.9–5.7: every step clips): lesson 01's weights at
/// the same world size, byte for byte, and the same norm, bit for bit — and
/// at 1, 2, 4 and 8 ranks (the pairwise tree's world sizes for M = 24) the
/// weights of one rank. Not the weights of an unclipped run (the test is not
/// vacuous). Sharded lessons send one 56-byte exact sum per rank per step.
#[test]
fn clipping_is_bitwise_lesson_01_in_every_lesson_and_world_size() {
    let args = |extra: &[&'static str]| -> Vec<&'static str> { [FAST, CLIP, extra].concat() };
    let norms = |out: &std::path::Path| -> Vec<u64> {
        report(out)["grad_norms"].as_array().unwrap().iter().map(|n| n.as_f64().unwrap().to_bits()).collect()
    };
    let (o, unclipped) = mpirun("step01-data-parallel", 1, FAST, "clip-off");
    ok_stdout(&o);
    let mut one_rank = None;
    let runs: &[(&str, &[&str], bool)] = &[
        ("step02-whole-model-shard", &["--no-plot"], false),
        ("step03-layerwise-shard", &["--no-plot"], true),
        ("step04-optimizer-state-shard", &["--stage", "1", "--precision", "fp32"], true),
        ("step04-optimizer-state-shard", &["--stage", "2", "--precision", "fp32"], true),
        ("step04-optimizer-state-shard", &["--stage", "3", "--precision", "fp32"], true),
    ];
    for n in [1usize, 2, 3, 4, 8] {
        let (o, oracle) = mpirun("step01-data-parallel", n, &args(&[]), &format!("clip-oracle-{n}"));
        assert!(ok_stdout(&o).contains("clipped to 0.3"));
        let (want, weights) = (norms(&oracle), std::fs::read(oracle.join("weights.safetensors")).unwrap());
        assert_eq!(want.len(), 3);
        assert!(want.iter().all(|&x| f64::from_bits(x) > 0.3), "every step clips: {want:?}");
        assert_eq!(report(&oracle)["traffic"]["grad_norm"]["bytes_sent"], 0, "lesson 01 holds the whole gradient");
        match (&one_rank, n.is_power_of_two()) {
            (None, _) => {
                assert_ne!(digest(&oracle), digest(&unclipped), "clipping changes the weights");
                one_rank = Some(weights.clone());
            }
            (Some(w1), true) => assert!(*w1 == weights, "lesson 01 at {n} ranks: not one rank's weights"),
            _ => {}
        }
        for (pkg, extra, sharded) in runs {
            let name = format!("clip-{pkg}-{n}-{}", extra.join(""));
            let (o, out) = mpirun(pkg, n, &args(extra), &name);
            let stdout = ok_stdout(&o);
            assert!(stdout.contains("grad norm") && stdout.contains("clipped to 0.3"), "{name}: {stdout}");
            assert_eq!(norms(&out), want, "{name}: the norms");
            assert!(weights == std::fs::read(out.join("weights.safetensors")).unwrap(), "{name}: weights differ");
            let sent = report(&out)["traffic"]["grad_norm"]["bytes_sent"].as_u64().unwrap();
            let per_step = if *sharded { (n as u64 - 1) * 56 } else { 0 };
            assert_eq!(sent, 3 * per_step, "{name}: the exact sums on the wire");
        }
    }
}

/// bf16 compute: ZeRO-1/2/3 clip to lesson 01's bf16 bits and norms at 2 and 4 ranks.
#[test]
fn clipping_keeps_bf16_bits_across_stages() {
    let bf16 = ["--precision", "bf16"];
    let norms = |out: &std::path::Path| report(out)["grad_norms"].clone();
    for n in [2usize, 4] {
        let (o, dp) = mpirun("step01-data-parallel", n, &[FAST, CLIP, &bf16].concat(), &format!("clip-bf16-dp-{n}"));
        assert!(ok_stdout(&o).contains("clipped to 0.3"));
        for stage in ["1", "2", "3"] {
            let (o, z) = mpirun(
                "step04-optimizer-state-shard",
                n,
                &[FAST, CLIP, &bf16, &["--stage", stage]].concat(),
                &format!("clip-bf16-z{stage}-{n}"),
            );
            assert!(ok_stdout(&o).contains("clipped to 0.3"));
            assert_eq!(digest(&dp), digest(&z), "bf16, N = {n}, stage {stage}");
            assert_eq!(norms(&dp), norms(&z), "bf16, N = {n}, stage {stage}: the norms");
        }
    }
}

/// The other paths an update takes: lesson 01's one-process `--accumulate 2`
/// clips as 2 ranks do; lesson 02's and lesson 03's `--check` references,
/// clipped the same way, stay at a divergence of exactly 0.
#[test]
fn clipping_in_one_process_and_beside_the_checks() {
    let (o, two) = mpirun("step01-data-parallel", 2, &[FAST, CLIP].concat(), "clip-two");
    ok_stdout(&o);
    let (o, acc) = mpirun("step01-data-parallel", 1, &[FAST, CLIP, &["--accumulate", "2"]].concat(), "clip-acc");
    ok_stdout(&o);
    assert_eq!(digest(&two), digest(&acc));
    assert_eq!(report(&two)["grad_norms"], report(&acc)["grad_norms"]);
    for (pkg, extra) in
        [("step02-whole-model-shard", &[][..]), ("step03-layerwise-shard", &["--check", "--no-plot"][..])]
    {
        let (o, out) = mpirun(pkg, 3, &[FAST, CLIP, extra].concat(), &format!("clip-check-{pkg}"));
        assert!(ok_stdout(&o).contains("clipped to 0.3"), "{pkg}");
        let div: Vec<f64> =
            report(&out)["divergence"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        assert_eq!(div, vec![0.0; 3], "{pkg}: --check beside a clipped run");
    }
}
