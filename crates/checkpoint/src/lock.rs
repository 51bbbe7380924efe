//! One job per checkpoint folder.
//!
//! Two jobs pointed at one `--ckpt` folder would write into each other's
//! partial folders and remove each other's saves. So a job's rank 0 holds
//! `DIR/.lock` from its start to its end: an exclusive `flock(2)` on the
//! file, which names the holder (`host`, `pid`, when it started, the
//! lesson). The kernel drops a `flock` when its process ends, however it
//! ends, so a lock that can be taken while the file still names a holder was
//! left by a job that died (SIGKILL, a lost node): it is taken over, and the
//! caller says so. A job that ends normally removes the file.
//!
//! `flock` is local to one machine's kernel, and to NFS since Linux 2.6.12,
//! where the client turns it into an NFS lock: a folder shared by several
//! machines' jobs is covered too.
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The lock file's name inside a checkpoint folder.
pub const LOCK: &str = ".lock";

/// A held lock on a checkpoint folder; released (the file removed) on drop.
#[derive(Debug)]
pub struct FolderLock {
    /// Held open for the lock's life: closing it drops the flock.
    _file: File,
    path: PathBuf,
}

/// Who holds (or held) a folder's lock, as its file says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder(pub String);

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// What [`FolderLock::take`] found.
#[derive(Debug)]
pub enum Taken {
    /// The folder was free; or its last holder had died, and this is who it was.
    Held(FolderLock, Option<Holder>),
    /// Another live job holds it: who.
    Busy(Holder),
}

impl FolderLock {
    /// Takes `dir`'s lock for this process, `who` written into it
    /// (for example "host h, pid 42, started …, lesson …"); `dir` must exist.
    pub fn take(dir: &Path, who: &str) -> std::io::Result<Taken> {
        let path = dir.join(LOCK);
        loop {
            let mut file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path)?;
            // SAFETY: flock on a file descriptor this function owns.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::WouldBlock {
                    return Err(e);
                }
                return Ok(Taken::Busy(
                    read_holder(&mut file)
                        .unwrap_or_else(|| Holder("a job that has not yet written its name".to_string())),
                ));
            }
            // The holder before may have removed the file between our open and our lock:
            // then we hold a lock on a file no one else will open. Start again.
            let same = std::fs::metadata(&path).ok().is_some_and(|m| file.metadata().is_ok_and(|f| f.ino() == m.ino()));
            if !same {
                continue;
            }
            let before = read_holder(&mut file);
            file.set_len(0)?;
            file.rewind()?;
            file.write_all(format!("{who}\n").as_bytes())?;
            file.sync_all()?;
            return Ok(Taken::Held(FolderLock { _file: file, path }, before));
        }
    }
}

impl Drop for FolderLock {
    fn drop(&mut self) {
        // Removed while still held: a job that opens the old file afterwards
        // finds it gone when it checks, and starts again on a new one.
        let _ = std::fs::remove_file(&self.path);
    } // then `_file` closes, which drops the flock
}

fn read_holder(file: &mut File) -> Option<Holder> {
    let mut text = String::new();
    file.rewind().ok()?;
    file.read_to_string(&mut text).ok()?;
    let line = text.lines().next()?.trim();
    (!line.is_empty()).then(|| Holder(line.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("fsdp-lock-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_second_taker_is_told_who_holds_it_and_a_release_frees_it() {
        let dir = temp("busy");
        let Taken::Held(first, None) = FolderLock::take(&dir, "job A").unwrap() else {
            panic!("a fresh folder is free")
        };
        // flock is per open file: a second open in this very process conflicts like another process's.
        match FolderLock::take(&dir, "job B").unwrap() {
            Taken::Busy(h) => assert_eq!(h, Holder("job A".into())),
            t => panic!("job B must be refused, got {t:?}"),
        }
        drop(first);
        assert!(!dir.join(LOCK).exists(), "a normal release removes the file");
        let Taken::Held(_b, None) = FolderLock::take(&dir, "job B").unwrap() else { panic!("free again") };
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_dead_holders_lock_is_taken_over_and_named() {
        let dir = temp("stale");
        // What a SIGKILLed job leaves: the file naming it, no flock on it.
        std::fs::write(dir.join(LOCK), "host h, pid 1234, lesson step01\n").unwrap();
        match FolderLock::take(&dir, "job C").unwrap() {
            Taken::Held(_c, Some(h)) => assert_eq!(h.0, "host h, pid 1234, lesson step01"),
            t => panic!("a stale lock must be taken over and its holder named, got {t:?}"),
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
