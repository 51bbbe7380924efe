//! Lesson 01, data parallelism: the oracle every other lesson is measured against.
use crate::common::*;

const PKG: &str = "step01-data-parallel";

/// The report at N = 1..4 ranks: config, losses, memory tally from shapes,
/// bytes on the wire and the digest of the final weights, pinned exactly.
#[test]
fn report_is_pinned_at_1_to_4_ranks() {
    for n in 1..=4 {
        let (o, _) = mpirun(PKG, n, FAST, &format!("l01-report-{n}"));
        insta::assert_snapshot!(format!("report_{n}_ranks"), deterministic(&ok_stdout(&o)));
    }
}

/// N-rank data parallelism and one process accumulating the same micro-batches
/// in the same groups produce the same weights, bit for bit.
#[test]
fn data_parallel_equals_accumulation_bitwise() {
    for n in [1usize, 2, 3, 4] {
        let (o, dp) = mpirun(PKG, n, FAST, &format!("l01-dp-{n}"));
        ok_stdout(&o);
        let mut args = FAST.to_vec();
        let ns = n.to_string();
        args.extend(["--accumulate", &ns]);
        let (o, acc) = run_direct(PKG, &args, &format!("l01-acc-{n}"));
        ok_stdout(&o);
        assert_eq!(digest(&dp), digest(&acc), "N = {n}");
        // And the weights files are byte-identical, not only their digests.
        assert!(
            std::fs::read(dp.join("weights.safetensors")).unwrap()
                == std::fs::read(acc.join("weights.safetensors")).unwrap(),
            "N = {n}: weights files differ"
        );
    }
}

/// The ordered all-reduce moves exactly 2(N−1)/N of the gradient's bytes per rank.
#[test]
fn all_reduce_moves_the_theoretical_bytes() {
    let (o, out) = mpirun(PKG, 4, FAST, "l01-bytes");
    ok_stdout(&o);
    let r = report(&out);
    let sent = r["traffic"]["all_reduce"]["bytes_sent"].as_u64().unwrap();
    assert_eq!(sent, 3 * 2 * 3 * 202_464 * 4, "3 steps × 2·(N−1) shards of 202,464 floats");
    assert_eq!(r["traffic"]["all_reduce"]["calls"].as_u64(), Some(3));
}

/// The loss falls well below ln(65) ≈ 4.17 on the generated corpus.
#[test]
fn loss_falls() {
    let (o, out) = mpirun(PKG, 2, &["--steps", "30", "--micro-batches", "2"], "l01-learns");
    ok_stdout(&o);
    let losses: Vec<f64> = report(&out)["losses"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    assert!(losses[0] > 4.0, "starts near ln(65): {}", losses[0]);
    assert!(*losses.last().unwrap() < 3.0, "falls: {losses:?}");
}

/// MPI's native all-reduce runs too (its bits may differ from the ordered one's).
#[test]
fn native_all_reduce_trains() {
    let mut args = FAST.to_vec();
    args.extend(["--reduce", "native"]);
    let (o, out) = mpirun(PKG, 2, &args, "l01-native");
    assert!(ok_stdout(&o).lines().any(|l| l.contains("all-reduce") && l.contains("native")));
    assert!(report(&out)["final_loss"].as_f64().unwrap() < 4.2);
}

/// `fsdp-eval` reads the weights a run wrote and reports a loss near the
/// run's last training loss; a file that is not safetensors is one clear error.
#[test]
fn eval_reads_the_weights_a_run_wrote() {
    let (o, out) = mpirun(PKG, 2, &["--steps", "20", "--micro-batches", "2"], "l01-eval");
    ok_stdout(&o);
    let final_loss = report(&out)["final_loss"].as_f64().unwrap();
    let weights = out.join("weights.safetensors");
    let o = std::process::Command::new(binary("fsdp-eval")).arg("--weights").arg(&weights).output().unwrap();
    let stdout = ok_stdout(&o);
    let loss: f64 = stdout.split("mean loss ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    assert!((loss - final_loss).abs() < 0.25, "eval {loss} vs last training loss {final_loss}");

    let bad = out.join("not-weights.safetensors");
    std::fs::write(&bad, b"this is not a weights file").unwrap();
    let o = std::process::Command::new(binary("fsdp-eval")).arg("--weights").arg(&bad).output().unwrap();
    let (code, lines) = failure(&o);
    assert_eq!(code, 2);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].starts_with("error: weights file ") && lines[0].contains("not a safetensors file"), "{lines:?}");
}

/// The replica check says what it did: with --check-every 0, that it was off.
#[test]
fn the_replica_check_reports_only_what_it_checked() {
    let (o, _) =
        mpirun(PKG, 2, &["--steps", "3", "--batch-size", "2", "--seq-len", "16", "--check-every", "0"], "l01-no-check");
    let stdout = ok_stdout(&o);
    assert!(
        stdout.contains("replica check: off (--check-every 0)") && !stdout.contains("bitwise identical"),
        "{stdout}"
    );
    let (o, _) =
        mpirun(PKG, 2, &["--steps", "3", "--batch-size", "2", "--seq-len", "16", "--check-every", "2"], "l01-check-2");
    assert!(ok_stdout(&o).contains("replica check: 2 checks, every rank's weights bitwise identical"));
}

/// What `just compare-pytorch` hands PyTorch: the seed's initial weights (a
/// weights file `fsdp-eval` reads: an untrained model's loss is about
/// ln 65), every step's micro-batches (targets are the inputs shifted by
/// one), the corpus and the settings — and `fsdp-eval --json` at full precision.
#[test]
fn reference_data_holds_what_an_outside_trainer_needs() {
    let out = out_dir("l01-reference-data");
    let o = std::process::Command::new(binary("fsdp-reference-data"))
        .args(["--steps", "3", "--micro-batches", "2", "--batch-size", "2", "--seq-len", "16", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    ok_stdout(&o);
    let meta: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("meta.json")).unwrap()).unwrap();
    assert_eq!(
        (&meta["params"], &meta["micro_batches"], &meta["steps"], &meta["seq_len"], &meta["vocab_size"]),
        (
            &serde_json::json!(809_856),
            &serde_json::json!(2),
            &serde_json::json!(3),
            &serde_json::json!(16),
            &serde_json::json!(65)
        )
    );
    assert_eq!((meta["lr"].as_f64(), meta["weight_decay"].as_f64()), (Some(0.001f32 as f64), Some(0.01f32 as f64)));
    // (steps, M, 2, B, T) little-endian u32
    let ids: Vec<u32> = std::fs::read(out.join("batches.u32"))
        .unwrap()
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(ids.len(), 3 * 2 * 2 * 2 * 16);
    for mb in ids.chunks_exact(2 * 2 * 16) {
        let (inputs, targets) = mb.split_at(2 * 16);
        for (x, y) in inputs.chunks_exact(16).zip(targets.chunks_exact(16)) {
            assert_eq!(x[1..], y[..15], "targets are the inputs shifted by one");
        }
        assert!(mb.iter().all(|&t| t < 65));
    }
    assert_eq!(std::fs::metadata(out.join("corpus.u32")).unwrap().len(), 4 * 262_200);
    // The very batches and start a lesson trains on: step s's micro-batch k from the
    // sampler, the weights from the seed.
    let corpus = fsdp_gpt::Corpus::generated();
    let sampler = fsdp_gpt::Sampler::new(&corpus, 2, 16, 2, 1337).unwrap();
    for (i, mb) in ids.chunks_exact(2 * 2 * 16).enumerate() {
        let b = sampler.micro_batch(1 + i as u64 / 2, i % 2).unwrap();
        let want: Vec<u32> =
            [b.inputs, b.targets].iter().flat_map(|t| t.flatten_all().unwrap().to_vec1::<u32>().unwrap()).collect();
        assert_eq!(mb, want.as_slice(), "step {}, micro-batch {}", 1 + i / 2, i % 2);
    }
    let init = fsdp_gpt::weights_file::load(&out.join("init.safetensors")).unwrap();
    assert!(init.flat == fsdp_gpt::ParamTable::new(&init.cfg).init_flat(1337), "the seed's initial weights");
    // nanoGPT's decay rule: the 2-D tensors' elements, the count PyTorch is held to
    let decayed: usize =
        fsdp_gpt::ParamTable::new(&init.cfg).specs.iter().filter(|s| s.shape.len() >= 2).map(|s| s.numel()).sum();
    assert_eq!(meta["decayed_elements"], decayed);
    // Step 1's gradient norm, the one PyTorch is held to, is lesson 01's own
    // (which sums its micro-batches as a pairwise tree: the same to rounding).
    let norm = meta["step1_grad_norm"].as_f64().unwrap();
    let flags = ["--steps", "1", "--micro-batches", "2", "--batch-size", "2", "--seq-len", "16", "--grad-clip", "1e9"];
    let (o, l01) = mpirun(PKG, 1, &flags, "l01-reference-norm");
    ok_stdout(&o);
    let lesson = report(&l01)["grad_norms"][0].as_f64().unwrap();
    assert!((lesson / norm - 1.0).abs() < 1e-6, "lesson 01's step-1 norm {lesson}, the reference's {norm}");
    let o = std::process::Command::new(binary("fsdp-eval"))
        .args(["--json", "--batches", "2", "--weights"])
        .arg(out.join("init.safetensors"))
        .output()
        .unwrap();
    let r: serde_json::Value = serde_json::from_str(&ok_stdout(&o)).unwrap();
    assert_eq!(r["windows"], 16);
    let loss = r["mean_loss"].as_f64().unwrap();
    assert!((loss - 65f64.ln()).abs() < 0.1, "an untrained model's loss {loss}, ln 65 = {}", 65f64.ln());
}
