//! Across machines, a heartbeat: a node that dies or a link that goes down
//! ends the job in bounded time, with one line naming the node.
//!
//! On one machine a dead rank is mpirun's own child: it notices at once and
//! tears the job down. Between machines it learns of a node's death only
//! from its daemon's connection, and of a link that goes down not at all
//! until TCP gives up (Open MPI's daemons probe after 300 s of silence by
//! default, and a rank blocked in a collective waits as long as TCP
//! retransmits: measured on the simulated cluster, still hung after 60 s).
//! So when the world spans more than one node, every rank keeps a TCP
//! connection of its own to rank 0 (outside MPI), and both ends send a byte
//! every [`INTERVAL`]:
//!
//! - rank 0 hears a connection close (its process died: the kernel closes
//!   its sockets) → the node is named at once;
//! - rank 0 hears nothing from a rank for `FSDP_HEARTBEAT_TIMEOUT` seconds
//!   (default [`DEFAULT_TIMEOUT`]; 0 turns the heartbeat off) → the link or
//!   the node is down;
//!
//! and rank 0 prints one line ([`on_loss`]: the lessons add the step and the
//! checkpoint). It then leaves the job's end to mpirun, which has lost the
//! node's daemon too — at once when the node died; after a link went down,
//! once its keepalive probes of that idle connection fail (scripts/cluster.sh
//! sets them, 2 + 8 × 1 s: Open MPI's default waits 8 minutes). Rank 0 does
//! not abort by itself first: an abort makes mpirun send to the unreachable
//! daemon, and data unacknowledged on a dead link waits for TCP's
//! retransmissions (15 minutes), not for keepalives — measured here, the job
//! then ran on for 590 s. Only if mpirun has not ended the job [`GRACE`]
//! after the line does rank 0 abort. A rank that stops hearing rank 0 ends
//! itself, so that no rank outlives its job on the far side of a dead link.
//! A rank that ends on its own error says so first ([`crate::job::farewell`]), and the
//! job's normal end is a farewell too: neither is a loss.
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::comm::Comm;
use crate::job::{BYE, CommError, ENDING, PEERS, tell};

/// Between two heartbeats.
pub const INTERVAL: Duration = Duration::from_millis(250);
/// Silence after which a rank counts as lost, unless `FSDP_HEARTBEAT_TIMEOUT` says otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);
/// After its line, how long rank 0 leaves mpirun to end the job before it aborts.
pub const GRACE: Duration = Duration::from_secs(60);

/// What a byte on a heartbeat connection says.
const BEAT: u8 = b'.';
/// From rank 0: "I reported a lost node; mpirun ends the job now" — a rank
/// in reach stops watching, and ends itself if the job has not ended
/// [`GRACE`] (and a margin) later.
const LOST: u8 = b'L';

static HOOK: OnceLock<fn(&str)> = OnceLock::new();

/// What rank 0 says when a rank is lost: `hook(what)` prints one line about
/// `what` (e.g. "node2 (ranks 2, 3) is gone: …"). The default prints
/// `error: {what}`. Then mpirun ends the job (or, [`GRACE`] later, an abort).
pub fn on_loss(hook: fn(&str)) {
    let _ = HOOK.set(hook);
}

/// The silence after which a rank counts as lost: `FSDP_HEARTBEAT_TIMEOUT`
/// seconds, `None` for 0 (off); an error line if it is not a number.
pub fn timeout_from_env() -> Result<Option<Duration>, String> {
    match std::env::var("FSDP_HEARTBEAT_TIMEOUT") {
        Err(_) => Ok(Some(DEFAULT_TIMEOUT)),
        Ok(v) => match v.trim().parse::<f64>() {
            Ok(0.0) => Ok(None),
            Ok(s) if (1.0..=1e6).contains(&s) => Ok(Some(Duration::from_secs_f64(s))),
            _ => Err(format!(
                "FSDP_HEARTBEAT_TIMEOUT={v}: give the seconds of silence after which a rank on another node counts as lost (1 to 1000000, e.g. 5), 0 to turn the heartbeat off, or unset it"
            )),
        },
    }
}

/// Connects every rank to rank 0 and starts this rank's heartbeat thread,
/// all ranks together, right after the world learns its nodes. Rank 0's
/// `FSDP_HEARTBEAT_TIMEOUT` decides for all (a variable mpirun did not pass
/// to another machine must not split the ranks into two programs; an
/// invalid one means the default here, and the lesson's knob check reports
/// it). `names` are the ranks' host names; rank 0's must resolve on the
/// others. A failure on any rank is every rank's error, the same line
/// ([`CommError::Heartbeat`]); one after the ranks agreed is this rank's alone.
pub(crate) fn start(world: &Comm, names: &[String]) -> Result<(), CommError> {
    let n = world.size();
    let mine = timeout_from_env().unwrap_or(Some(DEFAULT_TIMEOUT)).map_or(0, |t| t.as_millis() as u64);
    let listener = match world.rank() {
        0 => Some(TcpListener::bind("0.0.0.0:0").and_then(|l| l.local_addr().map(|a| (l, a.port())))),
        _ => None,
    };
    // Rank 0's timeout (0: off) and port (0: it could not listen), to every rank.
    let port = match &listener {
        Some(Ok((_, p))) => *p as u64,
        _ => 0,
    };
    // Rank 0 accepts while the others connect, on a thread of its own: a listen
    // queue holds 128, so waiting until all have tried would refuse the rest.
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let acceptor = match &listener {
        Some(Ok((l, _))) if mine > 0 => {
            let (l, stop) = (l.try_clone().map_err(|e| CommError::Heartbeat(e.to_string()))?, stop.clone());
            Some(std::thread::spawn(move || accept_all(&l, n, &stop)))
        }
        _ => None,
    };
    let mut all = vec![0u64; 2 * n];
    world.all_gather_untimed(&[mine, port][..], &mut all[..]);
    let (timeout, port) = (all[0], all[1] as u16);
    if timeout == 0 {
        return Ok(()); // off
    }
    let timeout = Duration::from_millis(timeout);
    // Every other rank connects and says who it is (rank 0 accepts once all have tried).
    let connected: Result<Option<TcpStream>, String> = match (world.rank(), &listener) {
        (0, Some(Ok(_))) => Ok(None),
        (0, Some(Err(e))) => Err(format!("rank 0 cannot listen ({e})")),
        _ if port == 0 => Ok(None), // rank 0 says why
        _ => (names[0].as_str(), port)
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| format!("rank {}: rank 0's host {} does not resolve here", world.rank(), names[0]))
            .and_then(|addr| {
                TcpStream::connect_timeout(&addr, Duration::from_secs(10))
                    .and_then(|mut s| s.write_all(&(world.rank() as u32).to_le_bytes()).map(|_| s))
                    .map(Some)
                    .map_err(|e| format!("rank {} cannot reach rank 0 on {} ({e})", world.rank(), names[0]))
            }),
    };
    let why = world.gather_varying(connected.as_ref().err().map_or(&[][..], |e| e.as_bytes()));
    if let Some(e) = why.iter().find(|w| !w.is_empty()) {
        stop.store(true, Ordering::SeqCst);
        if let Some(a) = acceptor {
            let _ = a.join();
        }
        return Err(CommError::Heartbeat(format!(
            "the heartbeat across machines: {}: let the ranks reach rank 0 over TCP, or run with FSDP_HEARTBEAT_TIMEOUT=0 (pass it to every rank: mpirun -x)",
            String::from_utf8_lossy(e)
        )));
    }
    let peers = match (connected, acceptor) {
        (Ok(Some(s)), _) => vec![(0, s)],
        (_, Some(a)) => a
            .join()
            .unwrap_or_else(|_| Err("the heartbeat's acceptor panicked".into()))
            .map_err(CommError::Heartbeat)?,
        _ => unreachable!("every rank connected, so rank 0 listens"),
    };
    for (_, s) in &peers {
        s.set_nonblocking(true)
            .map_err(|e| CommError::HeartbeatHere(format!("rank {}: the heartbeat: {e}", world.rank())))?;
    }
    *PEERS.lock().unwrap_or_else(|p| p.into_inner()) = peers;
    let (rank, nodes) = (world.rank(), world.nodes().to_vec());
    let names = names.to_vec();
    std::thread::Builder::new()
        .name("fsdp-heartbeat".into())
        .spawn(move || beat(rank, timeout, &nodes, &names))
        .map_err(|e| CommError::HeartbeatHere(format!("rank {rank}: the heartbeat's thread: {e}")))?;
    Ok(())
}

/// Rank 0: the other N − 1 ranks' connections, each rank once, as they
/// come; gives up when `stop` is set (another rank could not connect) or
/// after a minute. A connection that does not say which rank it is, or says
/// one already heard, is dropped.
fn accept_all(listener: &TcpListener, n: usize, stop: &AtomicBool) -> Result<Vec<(usize, TcpStream)>, String> {
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut peers: Vec<(usize, TcpStream)> = vec![];
    while peers.len() < n - 1 {
        let mut s = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if stop.load(Ordering::SeqCst) || Instant::now() > deadline {
                    let (got, want) = (peers.len(), n - 1);
                    return Err(format!("the heartbeat: {got} of {want} ranks connected to rank 0 in time"));
                }
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            Err(e) => return Err(format!("the heartbeat: rank 0 cannot accept ({e})")),
        };
        let mut r = [0u8; 4];
        let said = s
            .set_nonblocking(false)
            .and_then(|_| s.set_read_timeout(Some(Duration::from_secs(10))))
            .and_then(|_| s.read_exact(&mut r));
        let r = u32::from_le_bytes(r) as usize;
        if said.is_err() || r == 0 || r >= n || peers.iter().any(|(p, _)| *p == r) {
            continue; // not one of ours, or twice: drop it
        }
        peers.push((r, s));
    }
    Ok(peers)
}

/// The heartbeat thread: sends a beat every [`INTERVAL`], reads what came.
fn beat(rank: usize, timeout: Duration, nodes: &[usize], names: &[String]) {
    let start = Instant::now();
    let (mut last_beat, mut last_loop) = (start - INTERVAL, start);
    let mut told_lost: Option<Instant> = None; // rank 0 reported a loss (the others)
    let mut heard: Vec<(usize, Instant, bool)> = vec![]; // (rank, last heard, said farewell)
    let mut lost: Vec<(usize, &'static str)> = vec![];
    let mut first_loss: Option<Instant> = None;
    loop {
        std::thread::sleep(INTERVAL / 5);
        if ENDING.load(Ordering::SeqCst) {
            return; // this rank ends, and said so
        }
        let now = Instant::now();
        let mut peers = match PEERS.lock() {
            Ok(p) => p,
            Err(_) => return,
        };
        if heard.is_empty() {
            heard = peers.iter().map(|(r, _)| (*r, now, false)).collect();
        }
        if now - last_loop > timeout / 2 {
            // This process itself did not run for a while (stopped, suspended):
            // the silence is ours, not the peers'.
            heard.iter_mut().for_each(|h| h.1 = now);
        }
        last_loop = now;
        let beat_now = last_beat.elapsed() >= INTERVAL;
        if beat_now {
            last_beat = now;
        }
        for (i, (r, s)) in peers.iter_mut().enumerate() {
            if heard[i].2 || lost.iter().any(|(l, _)| l == r) {
                continue;
            }
            if beat_now {
                let _ = s.write(&[BEAT]); // a full buffer or a closed peer shows on the read side
            }
            let mut buf = [0u8; 64];
            loop {
                match s.read(&mut buf) {
                    Ok(0) => {
                        lost.push((*r, "closed"));
                        break;
                    }
                    Ok(k) => {
                        heard[i].1 = Instant::now();
                        if buf[..k].contains(&LOST) {
                            told_lost.get_or_insert_with(Instant::now);
                        }
                        if buf[..k].contains(&BYE) {
                            heard[i].2 = true;
                            break;
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(_) => {
                        lost.push((*r, "closed"));
                        break;
                    }
                }
            }
            if !heard[i].2 && heard[i].1.elapsed() > timeout && !lost.iter().any(|(l, _)| l == r) {
                lost.push((*r, "silent"));
            }
        }
        drop(peers);
        if rank != 0 {
            if heard.first().is_some_and(|h| h.2) {
                return; // rank 0 ends the job, normally or having said why
            }
            if let Some(t) = told_lost {
                // Rank 0 reported a loss: mpirun ends the job; if it has not a while after
                // rank 0's own last resort, this rank must not outlive it.
                if t.elapsed() > GRACE + Duration::from_secs(10) {
                    // SAFETY: _exit ends this process; nothing is left to run.
                    unsafe { libc::_exit(3) }
                }
                continue;
            }
            if !lost.is_empty() {
                // Rank 0 is gone or out of reach: the job is over; end here too.
                // SAFETY: _exit ends this process; nothing is left to run.
                unsafe { libc::_exit(3) }
            }
            continue;
        }
        if heard.iter().any(|h| h.2) && !lost.is_empty() {
            // A rank said it ends on its own error (already reported): the
            // others' closing connections are the job's teardown, not a loss.
            return;
        }
        if !lost.is_empty() {
            // Wait a moment for the other ranks of the same node, to name it once.
            let t = *first_loss.get_or_insert_with(Instant::now);
            if t.elapsed() < Duration::from_millis(400) {
                continue;
            }
            report(&lost, nodes, names, timeout);
        }
    }
}

/// Names the lost ranks' nodes in one line, and ends the job.
fn report(lost: &[(usize, &str)], nodes: &[usize], names: &[String], timeout: Duration) -> ! {
    let mut by_node: Vec<(usize, Vec<usize>, &str)> = vec![];
    for &(r, how) in lost {
        match by_node.iter_mut().find(|(n, _, _)| *n == nodes[r]) {
            Some((_, ranks, _)) => ranks.push(r),
            None => by_node.push((nodes[r], vec![r], how)),
        }
    }
    let what = by_node
        .iter()
        .map(|(_, ranks, how)| {
            let first = ranks.iter().min().copied().unwrap_or(0);
            let list = ranks.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", ");
            let whom = format!("{} (rank{} {list})", names[first], if ranks.len() == 1 { "" } else { "s" });
            match *how {
                "closed" => format!("{whom} is gone: its connection to rank 0 closed (the node or its processes died)"),
                _ => format!(
                    "nothing heard from {whom} for {:.0} s (FSDP_HEARTBEAT_TIMEOUT): the link to it is down, or it hangs",
                    timeout.as_secs_f64()
                ),
            }
        })
        .collect::<Vec<_>>()
        .join("; ");
    match HOOK.get() {
        Some(hook) => hook(&what),
        None => {
            let _ = std::io::stderr().write_all(format!("error: {what}\n").as_bytes());
        }
    }
    // The ranks still in reach stop watching: the job's end is mpirun's now.
    ENDING.store(true, Ordering::SeqCst);
    tell(LOST);
    std::thread::sleep(GRACE); // mpirun, which lost the node's daemon too, ends the job meanwhile
    crate::job::abort_job(3)
}
