//! `fsdp-sample`: the same weights, prompt and seed give the same text (a
//! pinned snapshot), from a weights file and from the sharded checkpoint of
//! the same run alike, and stdout holds the text alone (the closing line, with
//! its rate, goes to stderr); each bad input is one line.
use std::path::Path;
use std::process::{Command, Output};

use crate::common::*;

fn sample(args: &[&str]) -> Output {
    Command::new(binary("fsdp-sample")).args(args).env("RAYON_NUM_THREADS", "1").output().unwrap()
}

/// The text a run wrote: its whole stdout. Its closing line (where the
/// weights came from, the rate, which varies) is on stderr, alone.
fn text(o: &Output) -> String {
    let out = ok_stdout(o);
    let err = String::from_utf8_lossy(&o.stderr);
    let closing: Vec<&str> = err.lines().filter(|l| !l.is_empty()).collect();
    assert!(
        closing.len() == 1 && closing[0].starts_with("— ") && closing[0].contains("tokens/s, without a KV cache"),
        "stderr: {err:?}"
    );
    assert!(!out.contains("tokens/s"), "the rate on stdout: {out:?}");
    out
}

fn refused(args: &[&str], says: &str) {
    let o = sample(args);
    let (code, lines) = failure(&o);
    assert_eq!((code, lines.len()), (2, 1), "{args:?}: {lines:?}");
    assert!(lines[0].starts_with("error: ") && lines[0].contains(says), "{args:?}: {}", lines[0]);
    assert!(o.stdout.is_empty(), "{args:?}: a refused sample printed text");
}

#[test]
fn the_same_seed_gives_the_same_text_from_weights_and_from_a_checkpoint() {
    let ck = scratch().join("test-out/sample-ckpt");
    let _ = std::fs::remove_dir_all(&ck);
    let args: Vec<&str> = FAST.iter().copied().chain(["--ckpt", ck.to_str().unwrap()]).collect();
    let (o, out) = mpirun("step01-data-parallel", 2, &args, "sample-train");
    ok_stdout(&o);
    let weights = out.join("weights.safetensors");
    let w = weights.to_str().unwrap();
    let base = ["--prompt", "KING:", "--tokens", "120", "--seed", "7"];
    let from_file = text(&sample(&[&["--weights", w][..], &base].concat()));
    insta::assert_snapshot!(from_file);
    // `fsdp-sample > story.txt` twice with one seed: the same bytes.
    let again = sample(&[&["--weights", w][..], &base].concat());
    assert_eq!(again.stdout, from_file.as_bytes(), "two runs with --seed 7, stdout byte for byte");
    let from_ckpt = text(&sample(&[&["--ckpt", ck.to_str().unwrap()][..], &base].concat()));
    assert_eq!(from_ckpt, from_file, "the checkpoint's shards are the same weights");
    let other_seed = text(&sample(&[&["--weights", w][..], &base[..4], &["--seed", "8"]].concat()));
    assert_ne!(other_seed, from_file, "another seed, another text");
    // top-k 1 is greedy: no randomness left, so any seed writes the same.
    let greedy = |seed: &str| text(&sample(&["--weights", w, "--top-k", "1", "--tokens", "40", "--seed", seed]));
    assert_eq!(greedy("1"), greedy("2"));
    // The untrained model: what training starts from.
    let untrained = text(&sample(&["--untrained", "--tokens", "40"]));
    assert_eq!(
        untrained.chars().count(),
        1 + 40 + 1,
        "the newline prompt, 40 characters, the end of the line: {untrained:?}"
    );

    refused(
        &["--weights", w, "--prompt", "Ünïcode"],
        "--prompt has 2 character(s) the model has never seen: 'Ü' 'ï'; use only these 65",
    );
    for t in ["0", "-1", "nan", "inf"] {
        refused(&["--weights", w, "--temperature", t], &format!("`{t}` is not a positive temperature"));
    }
    refused(&["--weights", w, "--top-k", "0"], "'0' for '--top-k <K>'");
    refused(&["--weights", w, "--preset", "small"], "is the tiny preset, not --preset small");
    refused(
        &["--weights", "/no/such/weights.safetensors"],
        "weights file /no/such/weights.safetensors: cannot read it",
    );
    refused(&["--weights", w, "--ckpt", ck.to_str().unwrap()], "cannot be used with");
    assert!(Path::new(w).exists());
}
