//! The same bits on every machine. candle's matmul (the `gemm` crate) picks
//! its blocking from the cache sizes it reads in /sys/devices/system/cpu, so
//! on another CPU it rounds differently; the model multiplies with its own
//! kernel (`fsdp_gpt::kernels::matmul`), whose order no CPU property changes.
//!
//! The proof fakes another CPU: in a private mount namespace (`unshare -m`
//! as root; as a normal user, inside a user namespace of its own, which
//! Debian 12's kernel allows — where it does not, the tests say so and are
//! counted as skipped), a copy of /sys/devices/system/cpu with other L1d and L2 sizes is
//! bind-mounted over the real one. First the control — candle's own matmul
//! *does* change its bits there, so the fake is seen — then lesson 01 at
//! the small preset, whose contractions (384, 1536) are longer than one of
//! gemm's blocks, in fp32 and bf16: the same report, digest and losses as
//! the committed snapshot.
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common::*;

/// A copy of /sys/devices/system/cpu (its readable files) whose L1d and L2
/// sizes are another CPU's: 32K/128K unless the machine has a 32K L1d, then
/// 48K/128K. A 128K L2 also makes the model's matmul block its contraction
/// (at most 384 steps: the small preset's 1536-long ones in four blocks),
/// where the real caches leave it whole (but for the AVX2 tiles on an Intel
/// core, which block by L1 already).
fn fake_cpu_tree(name: &str) -> PathBuf {
    let dst = scratch().join("test-out").join(name); // one per test: they run in parallel
    let _ = std::fs::remove_dir_all(&dst);
    copy_readable(Path::new("/sys/devices/system/cpu"), &dst);
    let real_l1 = std::fs::read_to_string("/sys/devices/system/cpu/cpu0/cache/index0/size").unwrap_or_default();
    let (l1, l2) = if real_l1.trim() == "32K" { ("48K", "128K") } else { ("32K", "128K") };
    for cpu in std::fs::read_dir(&dst).unwrap().filter_map(Result::ok) {
        let cache = cpu.path().join("cache");
        for index in std::fs::read_dir(&cache).into_iter().flatten().filter_map(Result::ok) {
            let read = |f: &str| std::fs::read_to_string(index.path().join(f)).unwrap_or_default().trim().to_string();
            let size = match (read("level").as_str(), read("type").as_str()) {
                ("1", "Data") => l1,
                ("2", _) => l2,
                _ => continue,
            };
            std::fs::write(index.path().join("size"), format!("{size}\n")).unwrap();
        }
    }
    dst
}

fn copy_readable(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().filter_map(Result::ok) {
        let Ok(kind) = e.file_type() else { continue };
        if kind.is_symlink() {
            continue; // sysfs links lead out of the tree
        } else if kind.is_dir() {
            copy_readable(&e.path(), &to.join(e.file_name()));
        } else if let Ok(bytes) = std::fs::read(e.path()) {
            std::fs::write(to.join(e.file_name()), bytes).unwrap();
        }
    }
}

/// Runs `program args…` with the fake tree mounted over the real one.
fn under_fake_cpu(fake: &Path, program: &Path, args: &[&str]) -> Output {
    std::fs::create_dir_all(fake.with_extension("tmp")).unwrap();
    let script = "mount --bind \"$0\" /sys/devices/system/cpu && exec \"$@\"";
    let unshare = private_mounts().expect("checked by the test (namespaces_or_skip)");
    let o = Command::new("unshare")
        .args(unshare)
        .args(["sh", "-c", script])
        .arg(fake)
        .arg(program)
        .args(args)
        .envs(MPIRUN_ENV) // a normal user is root in its user namespace
        // Open MPI's session folder: one of ours (as root in a user namespace, the real root's
        // /tmp/ompi.<host>.0 is not writable).
        .env("TMPDIR", fake.with_extension("tmp"))
        .output()
        .expect("unshare runs (util-linux)");
    assert!(o.status.success(), "under the fake CPU: {}", String::from_utf8_lossy(&o.stderr));
    o
}

fn example(name: &str) -> PathBuf {
    let p = root().join("target/release/examples").join(name);
    assert!(p.exists(), "{} is missing: `cargo test --release` builds the examples", p.display());
    p
}

/// `candle …` / `ours …` lines of the matmul_bits example.
fn digests(o: &Output) -> (String, String) {
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    let get = |k: &str| {
        text.lines().find_map(|l| l.strip_prefix(k)).unwrap_or_else(|| panic!("no `{k}` in {text}")).to_string()
    };
    (get("candle "), get("ours "))
}

#[test]
fn another_cache_topology_moves_candles_matmul_but_not_ours() {
    if !namespaces_or_skip("machine::another_cache_topology_moves_candles_matmul_but_not_ours") {
        return;
    }
    let fake = fake_cpu_tree("fake-cpu-matmul");
    let here = Command::new(example("matmul_bits")).env("RAYON_NUM_THREADS", "1").output().unwrap();
    let there = under_fake_cpu(&fake, &example("matmul_bits"), &[]);
    let ((candle_here, ours_here), (candle_there, ours_there)) = (digests(&here), digests(&there));
    assert_ne!(
        candle_here, candle_there,
        "the control: gemm must see the fake cache sizes, or this test proves nothing"
    );
    assert_eq!(ours_here, ours_there, "our kernel's bits may not depend on the cache sizes");
    // And ours did block differently there (a 128K L2 cuts the contraction).
    let blocks =
        |o: &Output| String::from_utf8_lossy(&o.stdout).lines().find(|l| l.starts_with("blocks ")).map(str::to_string);
    let (b_here, b_there) = (blocks(&here).expect("a blocks line"), blocks(&there).expect("a blocks line"));
    assert_ne!(b_here, b_there, "our blocks must follow the fake caches, or the equal digests prove nothing");
}

#[test]
fn the_small_preset_in_fp32_and_bf16_computes_the_pinned_bits_under_another_cache_topology() {
    if !namespaces_or_skip(
        "machine::the_small_preset_in_fp32_and_bf16_computes_the_pinned_bits_under_another_cache_topology",
    ) {
        return;
    }
    let fake = fake_cpu_tree("fake-cpu-lessons");
    // The control, here too: gemm sees the fake cache sizes (else this proves nothing).
    let here = Command::new(example("matmul_bits")).env("RAYON_NUM_THREADS", "1").output().unwrap();
    assert_ne!(
        digests(&here).0,
        digests(&under_fake_cpu(&fake, &example("matmul_bits"), &[])).0,
        "gemm must see the fake topology"
    );
    for precision in ["fp32", "bf16"] {
        let name = format!("machine-small-{precision}");
        let args = [
            "--preset",
            "small",
            "--batch-size",
            "2",
            "--seq-len",
            "64",
            "--micro-batches",
            "2",
            "--steps",
            "3",
            "--log-every",
            "1",
            "--precision",
            precision,
        ];
        let (o, out) = run_direct("step01-data-parallel", &args, &name);
        let here = deterministic(&ok_stdout(&o));
        insta::assert_snapshot!(format!("small_{precision}"), here);
        let there_out = out_dir(&format!("{name}-fake"));
        let mut a: Vec<&str> = args.to_vec();
        a.extend(["--out", there_out.to_str().unwrap()]);
        let o = under_fake_cpu(&fake, &binary("step01-data-parallel"), &a);
        let there = deterministic(&String::from_utf8_lossy(&o.stdout));
        assert_eq!(there, here, "{precision}: the report under another cache topology");
        assert_eq!(digest(&there_out), digest(&out), "{precision}");
    }
}
