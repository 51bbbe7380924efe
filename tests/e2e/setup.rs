//! `scripts/deps.sh`, the probe `just setup` and `.ci/run` share, against
//! folders laid out like a fresh machine: it must name exactly what is missing.
//! (A probe that believed `libclang-cpp.so.14` was libclang once made the
//! README's first command fail six minutes into the build.)

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A fake machine: `root` laid out like `/` with the given library files, and
/// a `bin` folder holding the given commands (empty scripts).
struct FakeMachine {
    root: PathBuf,
    bin: PathBuf,
}

impl FakeMachine {
    fn new(name: &str, libs: &[&str], commands: &[&str]) -> Self {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/test-out/deps").join(name);
        let _ = fs::remove_dir_all(&dir);
        let (root, bin) = (dir.join("root"), dir.join("bin"));
        fs::create_dir_all(&bin).unwrap();
        for lib in libs {
            let p = root.join(lib.trim_start_matches('/'));
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(&p, b"").unwrap();
        }
        for c in commands {
            let p = bin.join(c);
            fs::write(&p, "#!/bin/sh\n").unwrap();
            fs::set_permissions(&p, fs::Permissions::from_mode(0o755)).unwrap();
        }
        FakeMachine { root, bin }
    }

    /// The packages the probe says are missing.
    fn missing(&self, browser: bool) -> Vec<String> {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/deps.sh");
        let mut cmd = Command::new("/bin/bash");
        cmd.arg(script).env_clear().env("PATH", &self.bin).env("FSDP_DEPS_ROOT", &self.root);
        if browser {
            cmd.arg("--browser");
        }
        let o = cmd.output().unwrap();
        assert!(o.status.success(), "deps.sh failed: {}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap().lines().map(str::to_owned).collect()
    }
}

const ALL_COMMANDS: &[&str] =
    &["cc", "mpirun", "ompi_info", "mpicc", "pkg-config", "ip", "tc", "sysctl", "chromium", "python3"];

#[test]
fn libclang_cpp_alone_is_not_libclang() {
    // This image: LLVM 14's C++ library and libLLVM, no libclang.
    let m = FakeMachine::new(
        "cpp-only",
        &[
            "/usr/lib/llvm-14/lib/libclang-cpp.so.14",
            "/usr/lib/x86_64-linux-gnu/libclang-cpp.so.14",
            "/usr/lib/llvm-14/lib/libLLVM-14.so",
        ],
        ALL_COMMANDS,
    );
    assert_eq!(m.missing(true), ["libclang-dev"]);
}

#[test]
fn each_file_bindgen_loads_counts_as_libclang() {
    for (name, lib) in [
        ("so1", "/usr/lib/llvm-14/lib/libclang.so.1"),
        ("dev", "/usr/lib/llvm-14/lib/libclang.so"),
        ("versioned", "/usr/lib/x86_64-linux-gnu/libclang-14.so.1"),
        ("lib64", "/usr/lib64/libclang.so.16"),
    ] {
        let m = FakeMachine::new(name, &["/usr/lib/llvm-14/lib/libclang-cpp.so.14", lib], ALL_COMMANDS);
        assert_eq!(m.missing(true), Vec::<String>::new(), "{lib} is a libclang bindgen can load");
    }
}

#[test]
fn each_missing_command_names_its_package() {
    let lib = ["/usr/lib/llvm-14/lib/libclang.so.1"];
    for (absent, packages) in [
        ("mpirun", &["openmpi-bin", "libopenmpi-dev"][..]),
        ("mpicc", &["openmpi-bin", "libopenmpi-dev"]),
        ("ompi_info", &["openmpi-bin", "libopenmpi-dev"]), // an mpirun that is not Open MPI's
        ("pkg-config", &["pkg-config"]),
        ("cc", &["gcc"]),
        ("ip", &["iproute2"]),
        ("tc", &["iproute2"]),
        ("sysctl", &["procps"]),
        ("chromium", &["chromium"]),
        ("python3", &["python3"]),
    ] {
        let commands: Vec<&str> = ALL_COMMANDS.iter().copied().filter(|c| *c != absent).collect();
        let m = FakeMachine::new(&format!("no-{absent}"), &lib, &commands);
        assert_eq!(m.missing(true), packages, "without {absent}");
    }
    // chromium-browser (Ubuntu's name) serves as well.
    let m = FakeMachine::new(
        "chromium-browser",
        &lib,
        &["cc", "mpirun", "ompi_info", "mpicc", "pkg-config", "ip", "tc", "sysctl", "chromium-browser", "python3"],
    );
    assert_eq!(m.missing(true), Vec::<String>::new());
}

#[test]
fn tc_and_sysctl_in_sbin_count_though_a_users_path_leaves_it_out() {
    let commands: Vec<&str> = ALL_COMMANDS.iter().copied().filter(|c| !["tc", "sysctl"].contains(c)).collect();
    let m = FakeMachine::new("sbin", &["/usr/lib/llvm-14/lib/libclang.so.1"], &commands);
    for (dir, c) in [("usr/sbin", "tc"), ("sbin", "sysctl")] {
        let p = m.root.join(dir).join(c);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(&p, "#!/bin/sh\n").unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(0o755)).unwrap();
    }
    assert_eq!(m.missing(true), Vec::<String>::new());
}

#[test]
fn a_missing_c_compiler_is_named_in_one_line() {
    let commands: Vec<&str> = ALL_COMMANDS.iter().copied().filter(|c| *c != "cc").collect();
    let m = FakeMachine::new("no-cc-note", &["/usr/lib/llvm-14/lib/libclang.so.1"], &commands);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/deps.sh");
    let o = Command::new("/bin/bash")
        .arg(script)
        .env_clear()
        .env("PATH", &m.bin)
        .env("FSDP_DEPS_ROOT", &m.root)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("no C compiler (cc)") && err.contains("install gcc"), "{err}");
}

#[test]
fn a_bare_machine_lacks_everything_and_the_browser_only_when_asked() {
    let m = FakeMachine::new("bare", &[], &[]);
    let base = ["gcc", "openmpi-bin", "libopenmpi-dev", "pkg-config", "libclang-dev", "iproute2", "procps"];
    assert_eq!(m.missing(false), base);
    assert_eq!(m.missing(true), [&base[..], &["chromium", "python3"]].concat());
}
