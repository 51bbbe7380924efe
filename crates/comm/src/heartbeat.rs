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
//! A rank that ends on its own error says so first ([`farewell`]), and the
//! job's normal end is a farewell too: neither is a loss.
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::comm::Comm;

/// Between two heartbeats.
pub const INTERVAL: Duration = Duration::from_millis(250);
/// Silence after which a rank counts as lost, unless `FSDP_HEARTBEAT_TIMEOUT` says otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);
/// After its line, how long rank 0 leaves mpirun to end the job before it aborts.
pub const GRACE: Duration = Duration::from_secs(60);

/// What a byte on a heartbeat connection says.
const BEAT: u8 = b'.';
/// "I end, and that is no loss": the job's end, or my own error, already reported.
const BYE: u8 = b'B';

/// The connections of this rank: rank 0's to every other rank, another rank's to rank 0.
static PEERS: Mutex<Vec<(usize, TcpStream)>> = Mutex::new(Vec::new());
static ENDING: AtomicBool = AtomicBool::new(false);
static HOOK: OnceLock<fn(&str)> = OnceLock::new();

/// What rank 0 says when a rank is lost: `hook(what)` prints one line about
/// `what` (e.g. "node2 (ranks 2, 3) is gone: …"). The default prints
/// `error: {what}`. Then mpirun ends the job (or, [`GRACE`] later, an abort).
pub fn on_loss(hook: fn(&str)) {
    let _ = HOOK.set(hook);
}

/// This rank ends and has said why, or the job ends normally: tells rank 0
/// (or, on rank 0, every rank) that what follows is no loss. Idempotent.
pub fn farewell() {
    if ENDING.swap(true, Ordering::SeqCst) {
        return;
    }
    if let Ok(peers) = PEERS.try_lock() {
        for (_, s) in peers.iter() {
            let _ = (&*s).write_all(&[BYE]);
        }
    }
}

/// The silence after which a rank counts as lost: `FSDP_HEARTBEAT_TIMEOUT`
/// seconds, `None` for 0 (off); an error line if it is not a number.
pub fn timeout_from_env() -> Result<Option<Duration>, String> {
    match std::env::var("FSDP_HEARTBEAT_TIMEOUT") {
        Err(_) => Ok(Some(DEFAULT_TIMEOUT)),
        Ok(v) => match v.trim().parse::<f64>() {
            Ok(0.0) => Ok(None),
            Ok(s) if s.is_finite() && s >= 1.0 => Ok(Some(Duration::from_secs_f64(s))),
            _ => Err(format!(
                "FSDP_HEARTBEAT_TIMEOUT={v}: give the seconds of silence after which a rank on another node counts as lost (1 or more, e.g. 5), 0 to turn the heartbeat off, or unset it"
            )),
        },
    }
}

/// Connects every rank to rank 0 (every rank calls, right after the world
/// learns its nodes) and starts this rank's heartbeat thread. `names` are
/// the ranks' host names; rank 0's must resolve on the others.
pub(crate) fn start(world: &Comm, names: &[String], timeout: Duration) -> Result<(), String> {
    let n = world.size();
    match world.rank() {
        0 => {
            let listener = TcpListener::bind("0.0.0.0:0").map_err(|e| format!("the heartbeat cannot listen: {e}"))?;
            let port = listener.local_addr().map_err(|e| e.to_string())?.port();
            // Every rank learns the port, then connects; rank 0 accepts them all.
            let mut all = vec![0u64; n];
            world.all_gather_untimed(&[port as u64][..], &mut all[..]);
            let deadline = Instant::now() + Duration::from_secs(30);
            listener.set_nonblocking(true).map_err(|e| e.to_string())?;
            let mut peers = vec![];
            while peers.len() < n - 1 {
                match listener.accept() {
                    Ok((mut s, _)) => {
                        s.set_nonblocking(false).map_err(|e| e.to_string())?;
                        s.set_read_timeout(Some(Duration::from_secs(5))).map_err(|e| e.to_string())?;
                        let mut r = [0u8; 4];
                        s.read_exact(&mut r)
                            .map_err(|e| format!("the heartbeat: a rank connected but did not say who ({e})"))?;
                        s.set_nonblocking(true).map_err(|e| e.to_string())?;
                        peers.push((u32::from_le_bytes(r) as usize, s));
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock && Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(5))
                    }
                    Err(e) => {
                        return Err(format!(
                            "the heartbeat: {} of {} ranks connected to rank 0 ({e})",
                            peers.len(),
                            n - 1
                        ));
                    }
                }
            }
            *PEERS.lock().expect("heartbeat peers") = peers;
        }
        _ => {
            let mut all = vec![0u64; n];
            world.all_gather_untimed(&[0u64][..], &mut all[..]);
            let port = all[0] as u16;
            let addr = (names[0].as_str(), port)
                .to_socket_addrs()
                .ok()
                .and_then(|mut a| a.next())
                .ok_or_else(|| format!("the heartbeat: rank 0's host {} does not resolve here", names[0]))?;
            let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10))
                .map_err(|e| format!("the heartbeat cannot reach rank 0 on {} ({e})", names[0]))?;
            s.write_all(&(world.rank() as u32).to_le_bytes()).map_err(|e| e.to_string())?;
            s.set_nonblocking(true).map_err(|e| e.to_string())?;
            *PEERS.lock().expect("heartbeat peers") = vec![(0, s)];
        }
    }
    let (rank, nodes) = (world.rank(), world.nodes().to_vec());
    let names = names.to_vec();
    std::thread::Builder::new()
        .name("fsdp-heartbeat".into())
        .spawn(move || beat(rank, timeout, &nodes, &names))
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// The heartbeat thread: sends a beat every [`INTERVAL`], reads what came.
fn beat(rank: usize, timeout: Duration, nodes: &[usize], names: &[String]) {
    let (start, mut last_beat) = (Instant::now(), Instant::now() - INTERVAL);
    let mut heard: Vec<(usize, Instant, bool)> = vec![]; // (rank, last heard, said farewell)
    let mut lost: Vec<(usize, &'static str)> = vec![];
    let mut first_loss: Option<Instant> = None;
    loop {
        std::thread::sleep(INTERVAL / 5);
        if ENDING.load(Ordering::SeqCst) {
            return; // this rank ends, and said so
        }
        let mut peers = match PEERS.lock() {
            Ok(p) => p,
            Err(_) => return,
        };
        if heard.is_empty() {
            heard = peers.iter().map(|(r, _)| (*r, start, false)).collect();
        }
        let beat_now = last_beat.elapsed() >= INTERVAL;
        if beat_now {
            last_beat = Instant::now();
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
                return; // rank 0 ends the job normally
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
    std::thread::sleep(GRACE); // mpirun, which lost the node's daemon too, ends the job meanwhile
    crate::world::abort_job(3)
}
