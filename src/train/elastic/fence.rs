//! The run directory's fencing token (`checkpoint/elastic.fence`): which launch of the job and
//! which membership epoch of it may write there. Rank 0 of every new epoch raises it as the
//! epoch forms; every file a rank 0 writes afterwards (metrics, checkpoints, the elastic state,
//! the exported model) is preceded by a check that the token still names its epoch, so a
//! writer from an older epoch, one cut off while the others formed a newer one, is refused
//! with an error instead of overwriting the job's files.
//!
//! The quorum rule ([`burn_dist::elastic::membership::quorum`]) already keeps a cut-off worker
//! from forming a world of its own; the fence covers the rank 0 that was cut off while still
//! in an old epoch and had not noticed yet. A check and the write after it are not one atomic
//! step: a stale rank 0 that checked just before the new epoch raised the token can still
//! write once, and the new rank 0's next write replaces that file.

use std::path::{Path, PathBuf};

use crate::{HearthError, Result};

/// The token as written: the launch (a random id rank 0 of a launch's first epoch draws), the
/// membership epoch, and the worker that wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Token {
    pub launch: String,
    pub epoch: u32,
    pub by: String,
}

pub(super) struct Fence {
    path: PathBuf,
}

impl Fence {
    pub fn new(run_dir: &Path) -> Self {
        Self {
            path: run_dir.join("checkpoint").join("elastic.fence"),
        }
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

    /// Rank 0 of a new epoch takes the run directory: the first epoch of a launch always
    /// (a fresh run, or a `--resume` after the old launch ended), a later epoch only over an
    /// older epoch of the same launch.
    pub fn raise(&self, token: &Token, first: bool) -> Result<()> {
        if !first {
            self.refuse_newer(self.read()?, token)?;
        }
        let text = serde_json::json!({
            "launch": token.launch,
            "epoch": token.epoch,
            "by": token.by,
        })
        .to_string();
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir).map_err(|source| HearthError::Write {
                path: dir.to_path_buf(),
                source,
            })?;
        }
        super::run_dir::write_atomic(&self.path, &text)
    }

    /// Before a write by rank 0 of `token`'s epoch: an error unless the token on disk is still
    /// its own (or an older epoch of the same launch).
    pub fn check(&self, token: &Token) -> Result<()> {
        let on_disk = self.read()?;
        match on_disk {
            None => Err(HearthError::CutOff(format!(
                "{} is gone, so this worker ({}, membership epoch {}) cannot tell whether it \
                 still owns the run directory; it writes nothing",
                self.path.display(),
                token.by,
                token.epoch
            ))),
            Some(on_disk) => self.refuse_newer(Some(on_disk), token),
        }
    }

    /// An error when `on_disk` belongs to another launch or a newer epoch than `token`'s.
    fn refuse_newer(&self, on_disk: Option<Token>, token: &Token) -> Result<()> {
        match on_disk {
            Some(on_disk) if on_disk.launch != token.launch => Err(HearthError::CutOff(format!(
                "{} belongs to another launch of this run (written by {}); this worker ({}) is \
                 from an older one and writes nothing",
                self.path.display(),
                on_disk.by,
                token.by
            ))),
            Some(on_disk) if on_disk.epoch > token.epoch => Err(HearthError::CutOff(format!(
                "the job formed membership epoch {} (rank 0: {}) while this worker ({}) was \
                 still in epoch {}: it was cut off, and the run directory belongs to the newer \
                 epoch ({}); it writes nothing",
                on_disk.epoch,
                on_disk.by,
                token.by,
                token.epoch,
                self.path.display()
            ))),
            _ => Ok(()),
        }
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
}
