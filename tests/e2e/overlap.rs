//! Communication overlapped with compute: the communication stream, DDP's
//! buckets, FSDP2's prefetch, DeepSpeed's overlap_comm — the same bits as
//! lesson 01 at every world size; traces that show what ran when; and the
//! simulated cluster, over which lesson 03 computes what it computes over
//! shared memory.
use std::path::Path;
use std::process::Command;

use crate::common::*;

/// Lesson 01's digest at `n` ranks with `extra` (its own run of `FAST`).
fn lesson01(n: usize, extra: &[&str], name: &str) -> String {
    let args: Vec<&str> = FAST.iter().chain(extra).copied().collect();
    let (o, out) = mpirun("step01-data-parallel", n, &args, name);
    ok_stdout(&o);
    digest(&out)
}

/// A run that must succeed; its report and stdout.
fn run(pkg: &str, n: usize, args: &[&str], name: &str) -> (serde_json::Value, String) {
    let (o, out) = mpirun(pkg, n, args, name);
    let stdout = ok_stdout(&o);
    (report(&out), stdout)
}

/// Every overlapped schedule gives lesson 01's weights, bit for bit: DDP's
/// buckets in lessons 01 and 02 at three bucket sizes (every unit its own
/// bucket, two units, one bucket), with several micro-batches and sum groups
/// per rank; FSDP2's prefetch in lesson 03 (in fp32; two units ahead, its
/// default, and one and three) and ZeRO-3 (in bf16, one ahead);
/// overlap_comm in ZeRO-1 and 2 (bf16) — at 1, 2 and 4 ranks; the buckets
/// at 3 as well.
#[test]
fn every_overlapped_schedule_equals_lesson_01() {
    for n in [1, 2, 4] {
        let base = lesson01(n, &[], &format!("ov-01-{n}"));
        let bf16 = lesson01(n, &["--precision", "bf16"], &format!("ov-01-bf16-{n}"));
        let groups = lesson01(n, &["--sum-groups", "12"], &format!("ov-01-g12-{n}")); // another order of the sums
        for (pkg, extra) in [
            ("step01-data-parallel", &["--bucket-mb", "0.1"][..]),
            ("step01-data-parallel", &["--bucket-mb", "100"]),
            ("step01-data-parallel", &["--bucket-mb", "1.2", "--recompute"]),
            ("step01-data-parallel", &["--bucket-mb", "0.1", "--sum-groups", "12"]),
            ("step02-whole-model-shard", &["--bucket-mb", "0.5", "--no-plot"]),
            ("step03-layerwise-shard", &["--prefetch", "--no-plot"]),
            ("step03-layerwise-shard", &["--prefetch", "--no-plot", "--blocks-per-unit", "3", "--sum-groups", "12"]),
            ("step03-layerwise-shard", &["--prefetch", "--prefetch-depth", "3", "--no-plot"]),
            ("step03-layerwise-shard", &["--prefetch", "--prefetch-depth", "1", "--no-plot"]),
        ] {
            let args: Vec<&str> = FAST.iter().chain(extra).copied().collect();
            let name = format!("ov-{pkg}-{n}-{}", extra.join(""));
            let (r, _) = run(pkg, n, &args, &name);
            let expected = if extra.contains(&"--sum-groups") { &groups } else { &base };
            assert_eq!(r["weights_digest"].as_str(), Some(expected.as_str()), "{pkg} {extra:?} at {n} ranks");
        }
        for stage in ["1", "2", "3"] {
            let flags: &[&str] =
                if stage == "3" { &["--prefetch", "--prefetch-depth", "1"] } else { &["--overlap-comm"] };
            let args: Vec<&str> = FAST.iter().chain(&["--stage", stage]).chain(flags).copied().collect();
            let (r, _) = run("step04-optimizer-state-shard", n, &args, &format!("ov-04-bf16-{stage}-{n}"));
            assert_eq!(r["weights_digest"].as_str(), Some(bf16.as_str()), "ZeRO-{stage} {flags:?} bf16 at {n} ranks");
        }
    }
    // Three ranks: each bucket padded to a multiple of 3, not of a power of two.
    let base = lesson01(3, &[], "ov-01-3");
    for (pkg, extra) in [
        ("step01-data-parallel", &["--bucket-mb", "0.1"][..]),
        ("step02-whole-model-shard", &["--bucket-mb", "0.5", "--no-plot"]),
    ] {
        let args: Vec<&str> = FAST.iter().chain(extra).copied().collect();
        let (r, _) = run(pkg, 3, &args, &format!("ov-{pkg}-3"));
        assert_eq!(r["weights_digest"].as_str(), Some(base.as_str()), "{pkg} {extra:?} at 3 ranks");
    }
}

/// The buckets move the bytes the plain all-reduce moves (plus each bucket's
/// padding to a multiple of N, which the theory counts), on the stream: the
/// step waited for less than the collectives took, and the stream's thread
/// reported its CPU time.
#[test]
fn the_stream_reports_what_it_hid_and_what_it_cost() {
    let args: Vec<&str> = FAST.iter().chain(&["--bucket-mb", "0.1"]).copied().collect();
    let (r, stdout) = run("step01-data-parallel", 2, &args, "ov-stream-01");
    let ar = &r["traffic"]["all_reduce"];
    assert_eq!(ar["calls"].as_u64(), Some(3 * 5), "5 buckets per step, 3 steps");
    assert_eq!(ar["bytes_sent"].as_u64().unwrap() / 3, r["expected_bytes_per_step"]["all_reduce"].as_u64().unwrap());
    let (seconds, exposed, cpu) = (
        ar["seconds"].as_f64().unwrap(),
        ar["exposed_seconds"].as_f64().unwrap(),
        ar["stream_cpu_seconds"].as_f64().unwrap(),
    );
    assert!(seconds > 0.0 && cpu > 0.0, "the stream measured its collectives and its CPU: {ar}");
    assert!(exposed <= seconds, "exposed {exposed} s of {seconds} s");
    assert!(stdout.contains("measured on the communication stream, per step:"), "{stdout}");
    // Its buffers travel with each collective and its receive buffer is
    // reserved up front: the stream's thread allocates nothing in training.
    assert!(stdout.contains("and made 0 allocations in training"), "{stdout}");
    assert_eq!(r["stream_allocations"].as_u64(), Some(0));
    for (pkg, extra) in [
        ("step03-layerwise-shard", &["--prefetch", "--no-plot"][..]),
        ("step04-optimizer-state-shard", &["--stage", "2", "--overlap-comm"]),
    ] {
        let args: Vec<&str> = FAST.iter().chain(extra).copied().collect();
        let (r, _) = run(pkg, 2, &args, &format!("ov-stream-allocs-{pkg}"));
        assert_eq!(r["stream_allocations"].as_u64(), Some(0), "{pkg} {extra:?}");
    }
    // Blocking: exposed is all of it, and no stream CPU.
    let (r, _) = run("step01-data-parallel", 2, FAST, "ov-stream-01-blocking");
    let ar = &r["traffic"]["all_reduce"];
    assert_eq!(ar["exposed_seconds"].as_f64(), ar["seconds"].as_f64());
    assert_eq!(ar["stream_cpu_seconds"].as_f64(), Some(0.0));
    assert!(r["stream_allocations"].is_null(), "no stream, no count");
}

/// A Chrome trace of spans with lanes; every collective in it carries the
/// bytes the traffic table counts; under --prefetch the next two entries'
/// all-gathers are handed over while the current unit computes, and under
/// --prefetch-depth 1 the next one's.
#[test]
fn traces_show_what_ran_when() {
    for (pkg, extra, name) in [
        ("step03-layerwise-shard", &["--prefetch", "--prefetch-depth", "1", "--no-plot"][..], "ov-trace-03-depth-1"),
        ("step03-layerwise-shard", &["--no-plot"], "ov-trace-03-blocking"),
        ("step03-layerwise-shard", &["--prefetch", "--no-plot"], "ov-trace-03"),
        ("step01-data-parallel", &["--bucket-mb", "0.1"], "ov-trace-01"),
        ("step04-optimizer-state-shard", &["--stage", "2", "--overlap-comm"], "ov-trace-04"),
    ] {
        let out = out_dir(name);
        let dir = out.join("trace");
        let dir_s = dir.to_string_lossy().to_string();
        let out_s = out.to_string_lossy().to_string();
        let args: Vec<&str> = FAST.iter().chain(extra).copied().chain(["--trace", &dir_s, "--out", &out_s]).collect();
        let (o, _) = mpirun(pkg, 2, &args, &format!("{name}-run"));
        let (stdout, r) = (ok_stdout(&o), report(&out));
        assert!(stdout.contains("trace-rank0.json"), "{stdout}");
        let all = chrome(&dir.join("trace.json"));
        for rank in 0..2 {
            let one = chrome(&dir.join(format!("trace-rank{rank}.json")));
            assert_eq!(one.len(), all.iter().filter(|e| e.pid == rank).count(), "{name}: rank {rank}'s file");
        }
        // Rank 0's collectives, by kind: the bytes the report counted (traffic includes control and all steps).
        let sent = |kind: &str| r["traffic"][kind]["bytes_sent"].as_u64().unwrap_or(0);
        for kind in ["all_gather", "reduce_scatter", "all_reduce"] {
            let traced: u64 =
                all.iter().filter(|e| e.pid == 0 && e.tid == 2 && e.name.starts_with(kind)).map(|e| e.bytes).sum();
            assert_eq!(traced, sent(kind), "{name}: the trace's {kind} bytes against the traffic table");
        }
        let svg = std::fs::read_to_string(dir.join("timeline.svg")).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("rank 1 · comm"), "{name}: timeline.svg");
        if name == "ov-trace-03-depth-1" {
            // The structure of prefetch: the next unit's all-gather is handed to the
            // stream before this unit's compute ends — forward (h.i, then h.i+1) and
            // backward (h.i, then h.i−1). When the stream starts it depends on what is
            // ahead of it in its queue (a reduce-scatter, under load), not on the schedule.
            for step in 1..=3 {
                let rank0: Vec<&Event> = all.iter().filter(|e| e.pid == 0 && e.step == step).collect();
                let span = |name: &str| rank0.iter().find(|e| e.tid == 1 && e.name == name).copied();
                let gathers = |unit: &str| -> Vec<&Event> {
                    rank0.iter().filter(|e| e.tid == 2 && e.name == format!("all_gather {unit}")).copied().collect()
                };
                for (this, next, phase, which) in
                    [(0, 1, "forward", 0), (1, 2, "forward", 0), (2, 3, "forward", 0)].into_iter().chain([
                        (3, 2, "recompute+backward", 1),
                        (2, 1, "recompute+backward", 1),
                        (1, 0, "recompute+backward", 1),
                    ])
                {
                    let f =
                        span(&format!("{phase} h.{this}")).unwrap_or_else(|| panic!("step {step}: {phase} h.{this}"));
                    // each unit is gathered twice per step: for its forward (first), for its backward (second)
                    let g = gathers(&format!("h.{next}"));
                    assert_eq!(g.len(), 2, "step {step}: h.{next} gathered twice");
                    assert!(
                        g[which].issued < f.ts + f.dur,
                        "step {step}: h.{next}'s gather is handed over after {phase} h.{this} ends"
                    );
                }
            }
        }
        if name == "ov-trace-03" {
            // Two entries ahead (--prefetch's default): in the backward, the unit two below is handed to the
            // stream before this unit's backward ends; and the last block's gather for
            // its backward before the head begins, across the head.
            for step in 1..=3 {
                let rank0: Vec<&Event> = all.iter().filter(|e| e.pid == 0 && e.step == step).collect();
                let span = |name: &str| *rank0.iter().find(|e| e.tid == 1 && e.name == name).expect(name);
                let second_gather = |unit: &str| {
                    let g: Vec<&&Event> =
                        rank0.iter().filter(|e| e.tid == 2 && e.name == format!("all_gather {unit}")).collect();
                    assert_eq!(g.len(), 2, "step {step}: {unit} gathered twice");
                    g[1].issued
                };
                for (this, two_below) in [(3, 1), (2, 0)] {
                    let b = span(&format!("recompute+backward h.{this}"));
                    assert!(second_gather(&format!("h.{two_below}")) < b.ts + b.dur, "step {step}: h.{two_below}");
                }
                let head = span("head forward+backward root");
                assert!(second_gather("h.3") < head.ts, "step {step}: h.3's second gather waits for the head");
            }
        }
        if name == "ov-trace-03-blocking" {
            // Without prefetch no collective is handed over or runs while a unit computes.
            let rank0: Vec<&Event> = all.iter().filter(|e| e.pid == 0).collect();
            for f in rank0.iter().filter(|e| e.tid == 1 && e.name.starts_with("forward h.")) {
                let inside = |t: f64| t > f.ts && t < f.ts + f.dur;
                assert!(
                    !rank0.iter().any(|g| g.tid == 2 && (inside(g.ts) || inside(g.issued))),
                    "a collective inside {} without --prefetch",
                    f.name
                );
            }
        }
    }
}

/// `--prefetch` reaches two entries ahead unless memory allows only one:
/// with `--mem-budget` between the tally's peaks at one and at two ahead,
/// lesson 03 and ZeRO-3 say so in their config, gather one ahead (the
/// tally's peak is one-ahead's), fit the budget and give the same bits; the
/// same budget with `--prefetch-depth 2` keeps the depth asked for and runs
/// out of memory, in one line.
#[test]
fn prefetch_reaches_two_ahead_where_memory_allows() {
    fn strs(a: &[String]) -> Vec<&str> {
        a.iter().map(String::as_str).collect()
    }
    for (pkg, extra) in
        [("step03-layerwise-shard", &["--no-plot"][..]), ("step04-optimizer-state-shard", &["--stage", "3"])]
    {
        let args =
            |flags: &[&str]| -> Vec<String> { FAST.iter().chain(extra).chain(flags).map(|a| a.to_string()).collect() };
        let go = |flags: &[&str], name: &str| run(pkg, 2, &strs(&args(flags)), &format!("ov-reach-{pkg}-{name}"));
        let peak = |r: &serde_json::Value| r["tally_expected_peak_bytes"].as_u64().unwrap();
        let (two, out) = go(&["--prefetch"], "default");
        assert!(out.contains("on: the next 2 entries' units gathered"), "{pkg}: {out}");
        let (one, out) = go(&["--prefetch", "--prefetch-depth", "1"], "one");
        assert!(out.contains("on: the next unit gathered") && !out.contains("--mem-budget)"), "{pkg}: {out}");
        assert!(peak(&two) > peak(&one), "{pkg}: a second unit in flight raises the tally's peak");
        let budget = format!("{}B", (peak(&one) + peak(&two)) / 2);
        let (lowered, out) = go(&["--prefetch", "--mem-budget", &budget], "lowered");
        assert!(out.contains("on: the next unit gathered, the last reduce-scattered on the communication stream (2 would take the tally's peak past --mem-budget)"), "{pkg}: {out}");
        assert_eq!(peak(&lowered), peak(&one), "{pkg}: one ahead, tallied as one");
        assert_eq!(lowered["weights_digest"], two["weights_digest"], "{pkg}: the same bits");
        let a = args(&["--prefetch", "--prefetch-depth", "2", "--mem-budget", &budget]);
        let (o, _) = mpirun(pkg, 2, &strs(&a), &format!("ov-reach-{pkg}-given"));
        let (code, lines) = failure(&o);
        assert_eq!(code, 2, "{pkg}: {lines:?}");
        assert!(lines.len() == 1 && lines[0].starts_with("error: out of memory"), "{pkg}: {lines:?}");
    }
}

/// One complete event of a Chrome trace.
struct Event {
    name: String,
    pid: u64,
    tid: u64,
    ts: f64,
    dur: f64,
    bytes: u64,
    step: u64,
    /// When the compute thread handed a collective over (its start, for a blocking one).
    issued: f64,
}

fn chrome(path: &Path) -> Vec<Event> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: serde_json::Value = serde_json::from_str(&text).expect("a trace parses as JSON");
    v["traceEvents"]
        .as_array()
        .expect("traceEvents")
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| Event {
            name: e["name"].as_str().unwrap().to_string(),
            pid: e["pid"].as_u64().unwrap(),
            tid: e["tid"].as_u64().unwrap(),
            ts: e["ts"].as_f64().unwrap(),
            dur: e["dur"].as_f64().unwrap(),
            bytes: e["args"]["bytes"].as_u64().unwrap_or(0),
            step: e["args"]["step"].as_u64().unwrap(),
            issued: e["args"]["issued_us"].as_f64().unwrap_or(e["ts"].as_f64().unwrap()),
        })
        .collect()
}

/// The TCP eager limit the lessons set for themselves gives way to one the
/// user chose (`mpirun --mca btl_tcp_eager_limit …` sets its variable).
#[test]
fn a_tcp_eager_limit_of_the_users_is_kept() {
    let (o, out) = mpirun("step01-data-parallel", 2, FAST, "ov-eager-ours");
    ok_stdout(&o);
    assert_eq!(report(&out)["tcp_eager_limit_bytes"].as_u64(), Some(16 << 20));
    let (mut cmd, out) = mpirun_command("step01-data-parallel", 2, FAST, "ov-eager-theirs");
    let o = cmd.env("OMPI_MCA_btl_tcp_eager_limit", "65536").output().unwrap();
    ok_stdout(&o);
    assert_eq!(report(&out)["tcp_eager_limit_bytes"].as_u64(), Some(65536));
}

/// Bad input: one line, exit code 2, nothing written.
#[test]
fn bad_overlap_flags_get_one_line() {
    let line = fails("step01-data-parallel", 2, &["--bucket-mb", "0"], "ov-bad-bucket");
    assert!(line.contains("--bucket-mb") && line.contains("positive"), "{line}");
    fails("step02-whole-model-shard", 2, &["--bucket-mb", "-1"], "ov-bad-bucket-02");
    let line = fails("step01-data-parallel", 1, &["--bucket-mb", "1", "--accumulate", "2"], "ov-bad-bucket-acc");
    assert!(line.contains("--accumulate"), "{line}");
    let line = fails("step01-data-parallel", 2, &["--bucket-mb", "1", "--reduce", "native"], "ov-bad-bucket-native");
    assert!(line.contains("--reduce native"), "{line}");
    let line = fails("step04-optimizer-state-shard", 2, &["--stage", "1", "--prefetch"], "ov-bad-prefetch-1");
    assert!(line.contains("--overlap-comm"), "{line}");
    let line = fails("step04-optimizer-state-shard", 2, &["--stage", "3", "--overlap-comm"], "ov-bad-overlap-3");
    assert!(line.contains("--prefetch"), "{line}");
    // How far --prefetch reaches: with it, one unit or more, and within the step's schedule (the tiny
    // preset's 4 blocks: 11 entries, 10 ahead of the first; 2 blocks a unit: 7 entries).
    let line = fails("step03-layerwise-shard", 2, &["--prefetch", "--prefetch-depth", "99"], "ov-bad-depth-99");
    assert!(line.contains("--prefetch-depth 99 reaches past") && line.contains("pass 1 to 10"), "{line}");
    let args = ["--prefetch", "--prefetch-depth", "7", "--blocks-per-unit", "2"];
    let line = fails("step03-layerwise-shard", 2, &args, "ov-bad-depth-7");
    assert!(line.contains("its 7 entries") && line.contains("pass 1 to 6"), "{line}");
    let line = fails(
        "step04-optimizer-state-shard",
        2,
        &["--stage", "3", "--prefetch", "--prefetch-depth", "11"],
        "ov-bad-depth-04",
    );
    assert!(line.contains("--prefetch-depth 11 reaches past") && line.contains("pass 1 to 10"), "{line}");
    let line = fails("step03-layerwise-shard", 2, &["--prefetch-depth", "2"], "ov-bad-depth-alone");
    assert!(line.contains("--prefetch-depth 2") && line.contains("add --prefetch"), "{line}");
    let line = fails("step03-layerwise-shard", 2, &["--prefetch", "--prefetch-depth", "0"], "ov-bad-depth-0");
    assert!(line.contains("--prefetch-depth 0") && line.contains("1 or more"), "{line}");
    let line = fails("step04-optimizer-state-shard", 2, &["--stage", "2", "--prefetch-depth", "2"], "ov-bad-depth-2");
    assert!(line.contains("--prefetch-depth applies to stage 3"), "{line}");
    // A trace folder that cannot be made: under a regular file.
    let blocker = out_dir("ov-bad-trace").join("a-file");
    std::fs::write(&blocker, b"x").unwrap();
    let target = blocker.join("trace").to_string_lossy().to_string();
    let line = fails("step03-layerwise-shard", 2, &["--trace", &target], "ov-bad-trace-run");
    assert!(line.contains("--trace"), "{line}");
    // The cluster's wire rate, as tc writes it.
    let o = Command::new("bash")
        .arg(root().join("scripts/cluster.sh"))
        .args(["--rate", "fast", "--", "true"])
        .env("FSDP_CLUSTER_DIR", out_dir("ov-bad-rate"))
        .output()
        .unwrap();
    let (code, lines) = failure(&o);
    assert_eq!((code, lines.len()), (2, 1), "{lines:?}");
    assert!(lines[0].contains("--rate fast") && lines[0].contains("500mbit"), "{lines:?}");
    // A cluster name too long for Linux's 15-character interface names, refused before anything is made.
    let o = Command::new("bash")
        .arg(root().join("scripts/cluster.sh"))
        .args(["--", "true"])
        .env("FSDP_CLUSTER_DIR", out_dir("ov-bad-id"))
        .env("FSDP_CLUSTER_ID", "toolong12")
        .output()
        .unwrap();
    let (code, lines) = failure(&o);
    assert_eq!((code, lines.len()), (2, 1), "{lines:?}");
    assert!(lines[0].contains("FSDP_CLUSTER_ID=toolong12") && lines[0].contains("1 to 7"), "{lines:?}");
}

/// The simulated cluster: two network namespaces joined by a shaped veth
/// link, mpirun starting the far node's ranks through scripts/cluster-rsh.sh.
/// Lesson 03 over it — 2 nodes × 1 rank, and 2 × 2 — computes the digest it
/// computes over shared memory, and bytes crossed the link. Needs namespaces
/// of its own, as the fake-CPU tests do (root, or a user namespace).
#[test]
fn lesson_03_on_the_simulated_cluster_gives_the_shared_memory_digest() {
    if !namespaces_or_skip("overlap::lesson_03_on_the_simulated_cluster_gives_the_shared_memory_digest") {
        return;
    }
    for (slots, ranks) in [(1, 2), (2, 4)] {
        let name = format!("ov-cluster-{slots}");
        let (o, local) = mpirun("step03-layerwise-shard", ranks, &[FAST, &["--no-plot"]].concat(), &name);
        ok_stdout(&o);
        let out = out_dir(&format!("{name}-out"));
        let dir = out_dir(&format!("{name}-state"));
        let args = [FAST, &["--no-plot", "--prefetch"]].concat();
        let o = Command::new("bash")
            .arg(root().join("scripts/cluster.sh"))
            .args(["--nodes", "2", "--rate", "1gbit", "--slots", &slots.to_string(), "--", "mpirun", "-q"])
            .arg("--hostfile")
            .arg(dir.join("hosts"))
            .args(["-n", &ranks.to_string(), "-x", "RAYON_NUM_THREADS=1"])
            .arg(binary("step03-layerwise-shard"))
            .args(&args)
            .arg("--out")
            .arg(&out)
            .env("FSDP_CLUSTER_DIR", &dir)
            .env("FSDP_CLUSTER_ID", format!("t{slots}{}", std::process::id() % 10_000))
            .env("TMPDIR", &dir)
            .envs([NO_EPOLL])
            .env_remove("LD_LIBRARY_PATH") // cargo's, for the test binary: not for ip, tc and mpirun
            .output()
            .expect("bash runs");
        let stdout = ok_stdout(&o);
        assert!(stdout.contains("final weights digest"), "{stdout}");
        assert_eq!(digest(&out), digest(&local), "{ranks} ranks on 2 simulated nodes against shared memory");
        // The bytes crossed the link: node1's counters against what rank 0 sent.
        let links = std::fs::read_to_string(dir.join("links.txt")).expect("links.txt");
        let tx: u64 = links
            .lines()
            .find(|l| l.starts_with("node1 "))
            .and_then(|l| l.split_whitespace().find_map(|w| w.strip_prefix("tx_bytes=")))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let r = report(&out);
        // Between the nodes a unit's shard goes in one eager message (fsdp_comm::world::TCP_EAGER_LIMIT).
        assert_eq!(r["tcp_eager_limit_bytes"].as_u64(), Some(16 << 20), "the TCP eager limit the ranks ran with");
        let sent: u64 = r["traffic"].as_object().unwrap().values().map(|t| t["bytes_sent"].as_u64().unwrap()).sum();
        if slots == 1 {
            // All of rank 0's bytes go to the other node, with TCP's and MPI's headers on top, and
            // besides training the setup's agreement and the final gather of the weights (1.6 MB).
            assert!(tx >= sent && tx < sent + sent / 5 + (4 << 20), "node1 sent {tx} bytes, rank 0 counted {sent}");
        } else {
            assert!(tx >= sent / 2, "node1 sent {tx} bytes, rank 0 counted {sent} (half of it to the other node)");
        }
        let leftover = Command::new("ip").args(["netns", "list"]).output().unwrap();
        let id = format!("fsdpt{slots}");
        assert!(!String::from_utf8_lossy(&leftover.stdout).contains(&id), "the cluster removed its namespaces");
    }
}
