//! The run directory's fencing token (`checkpoint/elastic.fence`): which launch of the job,
//! which membership epoch of it and which worker may write there. Rank 0 of every new epoch
//! raises it as the epoch forms; every file a rank 0 writes afterwards (metrics, the world log,
//! checkpoints and their pruning, the elastic state, the exported model, the plots) lands
//! through a [`Gate`] whose guard checks, under the run directory's lock
//! (`checkpoint/elastic.lock`) and after the file was written whole, that the token on disk is
//! still exactly its own, and only then renames it into place. Raising takes the same lock, so
//! a writer that passed its check has landed before any newer epoch's token exists, and a
//! writer cut off between two writes (stopped, or partitioned while it still believed itself
//! rank 0) is refused at its next one with nothing of it landed. Two rank 0s of the same
//! epoch number (a coordinator that died between its verdicts, each half hearing another
//! survivor announce) cannot both hold the token: the first to raise it wins and the other is
//! refused. The token and every file it guards are synced before their rename.
//!
//! The quorum rule ([`burn_dist::elastic::membership::quorum`]) already keeps a cut-off worker
//! from forming a world of its own; the fence covers the rank 0 that was cut off while still
//! in an old epoch and had not noticed yet.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::super::gate::Gate;
use crate::{HearthError, Result};

/// How long a writer waits for the run directory's lock: it is held only around a check and
/// a rename, so a longer wait means its holder was stopped in between.
const LOCK_WAIT: Duration = Duration::from_secs(60);

/// The token as written: the launch (a random id rank 0 of a launch's first epoch draws), the
/// membership epoch, and the worker that wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Token {
    pub launch: String,
    pub epoch: u32,
    pub by: String,
}

#[derive(Clone)]
pub(super) struct Fence {
    path: PathBuf,
    lock: PathBuf,
}

impl Fence {
    pub fn new(run_dir: &Path) -> Self {
        let dir = run_dir.join("checkpoint");
        Self {
            path: dir.join("elastic.fence"),
            lock: dir.join("elastic.lock"),
        }
    }

    /// Runs `f` holding the run directory's lock (an exclusive `flock` on
    /// `checkpoint/elastic.lock`, waited for at most [`LOCK_WAIT`]).
    fn locked<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        let write = |source| HearthError::Write {
            path: self.lock.clone(),
            source,
        };
        if let Some(dir) = self.lock.parent() {
            std::fs::create_dir_all(dir).map_err(write)?;
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&self.lock)
            .map_err(write)?;
        let deadline = Instant::now() + LOCK_WAIT;
        loop {
            // SAFETY: flock on a descriptor this function owns; released when `file` closes.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                break;
            }
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(write(err));
            }
            if Instant::now() >= deadline {
                return Err(HearthError::Training(format!(
                    "{} was held by another process for {} s (a writer stopped between its \
                     check and its write); this worker writes nothing",
                    self.lock.display(),
                    LOCK_WAIT.as_secs()
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let out = f();
        drop(file);
        out
    }

    /// The guard of `token`'s writes: each landing runs under the lock after
    /// [`Fence::check`] passed.
    pub fn gate(&self, token: &Token) -> Gate {
        let (fence, token) = (self.clone(), token.clone());
        Gate::guarded(Arc::new(move |landing| {
            fence.locked(|| {
                fence.check(&token)?;
                landing()
            })
        }))
    }

    /// The token on disk; `None` when there is none. An unreadable or garbled file is an
    /// error naming it.
    pub fn read(&self) -> Result<Option<Token>> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(HearthError::Read {
                    path: self.path.clone(),
                    source,
                });
            }
        };
        let bad = || {
            HearthError::Training(format!(
                "{} is not an elastic fencing token ({:?}); remove it only if no worker of \
                 this run is alive",
                self.path.display(),
                text.chars().take(80).collect::<String>()
            ))
        };
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|_| bad())?;
        Ok(Some(Token {
            launch: v["launch"].as_str().ok_or_else(bad)?.to_string(),
            epoch: v["epoch"]
                .as_u64()
                .and_then(|e| u32::try_from(e).ok())
                .ok_or_else(bad)?,
            by: v["by"].as_str().unwrap_or_default().to_string(),
        }))
    }

    /// Rank 0 of a new epoch takes the run directory, under the lock: the first epoch of a
    /// launch always (a fresh run, or a `--resume` after the old launch ended), a later epoch
    /// only over an older epoch of the same launch, or its own token again.
    pub fn raise(&self, token: &Token, first: bool) -> Result<()> {
        let text = serde_json::json!({
            "launch": token.launch,
            "epoch": token.epoch,
            "by": token.by,
        })
        .to_string();
        self.locked(|| {
            if !first {
                match self.read()? {
                    Some(on_disk) if on_disk == *token => {}
                    Some(on_disk)
                        if on_disk.launch == token.launch && on_disk.epoch < token.epoch => {}
                    on_disk => self.refuse(on_disk, token)?,
                }
            }
            Gate::default().write(&self.path, text.as_bytes())
        })
    }

    /// Before a write by rank 0 of `token`'s epoch: an error unless the token on disk is
    /// exactly its own.
    pub fn check(&self, token: &Token) -> Result<()> {
        match self.read()? {
            Some(on_disk) if on_disk == *token => Ok(()),
            on_disk => self.refuse(on_disk, token),
        }
    }

    /// Why `token`'s worker may not write, the token on disk being `on_disk` (not its own).
    fn refuse(&self, on_disk: Option<Token>, token: &Token) -> Result<()> {
        let why = match on_disk {
            None => format!(
                "{} is gone, so this worker ({}, membership epoch {}) cannot tell whether it \
                 still owns the run directory",
                self.path.display(),
                token.by,
                token.epoch
            ),
            Some(on_disk) if on_disk.launch != token.launch => format!(
                "{} belongs to another launch of this run (written by {}); this worker ({}) is \
                 from an older one",
                self.path.display(),
                on_disk.by,
                token.by
            ),
            Some(on_disk) if on_disk.epoch > token.epoch => format!(
                "the job formed membership epoch {} (rank 0: {}) while this worker ({}) was \
                 still in epoch {}: it was cut off, and the run directory belongs to the newer \
                 epoch ({})",
                on_disk.epoch,
                on_disk.by,
                token.by,
                token.epoch,
                self.path.display()
            ),
            Some(on_disk) if on_disk.epoch == token.epoch => format!(
                "{} names {} as rank 0 of membership epoch {}, which this worker ({}) also \
                 believed it led: two coordinators announced the same epoch and {} raised it \
                 first",
                self.path.display(),
                on_disk.by,
                token.epoch,
                token.by,
                on_disk.by
            ),
            Some(on_disk) => format!(
                "{} names membership epoch {} (by {}), older than this worker's ({}, epoch {}): \
                 the token was put back, so who owns the run directory is unknown",
                self.path.display(),
                on_disk.epoch,
                on_disk.by,
                token.by,
                token.epoch
            ),
        };
        Err(HearthError::CutOff(format!("{why}; it writes nothing")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(launch: &str, epoch: u32, by: &str) -> Token {
        Token {
            launch: launch.into(),
            epoch,
            by: by.into(),
        }
    }

    #[test]
    fn a_writer_from_an_older_epoch_or_launch_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let fence = Fence::new(dir.path());
        let old = token("a", 0, "w0");
        assert!(fence.check(&old).is_err(), "no token: nothing is owned");
        fence.raise(&old, true).unwrap();
        fence.check(&old).unwrap();
        // The others formed epoch 1 without w0.
        let new = token("a", 1, "w1");
        fence.raise(&new, false).unwrap();
        fence.check(&new).unwrap();
        let e = fence.check(&old).unwrap_err().to_string();
        assert!(
            e.contains("cut off") && e.contains("epoch 1") && e.contains("w0"),
            "{e}"
        );
        // Nor may the stale rank 0 raise it back.
        assert!(fence.raise(&old, false).is_err());
        assert_eq!(fence.read().unwrap(), Some(new.clone()));
        // A new launch (a --resume) takes over; a worker of the old launch is refused.
        let resumed = token("b", 0, "w0");
        fence.raise(&resumed, true).unwrap();
        let e = fence.check(&new).unwrap_err().to_string();
        assert!(e.contains("another launch"), "{e}");
        // Garbage is an error naming the file.
        std::fs::write(&fence.path, "{not json").unwrap();
        let e = fence.check(&resumed).unwrap_err().to_string();
        assert!(e.contains("elastic.fence"), "{e}");
    }

    #[test]
    fn two_rank_0s_of_the_same_epoch_cannot_both_write() {
        let dir = tempfile::tempdir().unwrap();
        let fence = Fence::new(dir.path());
        fence.raise(&token("a", 0, "w0"), true).unwrap();
        // w0 died between its verdicts: w1 and w2 each heard themselves lead epoch 1.
        let (w1, w2) = (token("a", 1, "w1"), token("a", 1, "w2"));
        fence.raise(&w1, false).unwrap();
        let e = fence.raise(&w2, false).unwrap_err().to_string();
        assert!(
            e.contains("two coordinators") && e.contains("w1") && e.contains("w2"),
            "{e}"
        );
        assert!(fence.check(&w2).is_err());
        fence.check(&w1).unwrap();
        // Raising one's own token again is no conflict.
        fence.raise(&w1, false).unwrap();
        let gate = fence.gate(&w2);
        assert!(
            gate.write(&dir.path().join("metrics.csv"), b"w2's")
                .is_err()
        );
        assert!(!dir.path().join("metrics.csv").exists());
    }

    #[test]
    fn a_writer_cut_off_between_two_writes_lands_nothing_at_the_second() {
        let dir = tempfile::tempdir().unwrap();
        let fence = Fence::new(dir.path());
        let metrics = dir.path().join("metrics.csv");
        let old = token("a", 0, "w0");
        fence.raise(&old, true).unwrap();
        let stale = fence.gate(&old);
        // One check used to guard several writes: w0 checked, then was stopped.
        stale.write(&metrics, b"epoch 1").unwrap();
        let new = token("a", 1, "w1");
        fence.raise(&new, false).unwrap();
        fence
            .gate(&new)
            .write(&metrics, b"epoch 1\nepoch 2")
            .unwrap();
        // w0 continues with its next write: refused, and metrics.csv is not rolled back.
        let e = stale.write(&metrics, b"epoch 1").unwrap_err().to_string();
        assert!(e.contains("cut off"), "{e}");
        assert!(stale.remove(&metrics).is_err());
        assert_eq!(std::fs::read(&metrics).unwrap(), b"epoch 1\nepoch 2");
        // No temporary file of the refused write is left behind.
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.contains(".tmp")), "{names:?}");
    }

    #[test]
    fn raising_waits_for_a_landing_that_passed_its_check() {
        let dir = tempfile::tempdir().unwrap();
        let fence = Fence::new(dir.path());
        let old = token("a", 0, "w0");
        fence.raise(&old, true).unwrap();
        let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (f, o, t) = (fence.clone(), order.clone(), old.clone());
        let landing = std::thread::spawn(move || {
            f.gate(&t)
                .pass_for_test(&mut || {
                    o.lock().unwrap().push("landing starts");
                    std::thread::sleep(Duration::from_millis(300));
                    o.lock().unwrap().push("landing ends");
                    Ok(())
                })
                .unwrap();
        });
        while order.lock().unwrap().is_empty() {
            std::thread::sleep(Duration::from_millis(5));
        }
        fence.raise(&token("a", 1, "w1"), false).unwrap();
        order.lock().unwrap().push("raised");
        landing.join().unwrap();
        assert_eq!(
            *order.lock().unwrap(),
            ["landing starts", "landing ends", "raised"]
        );
    }
}
