//! How a rank puts files into the run directory: each file written whole under a temporary
//! name no other writer uses, synced, then renamed over its name and the directory synced, so
//! a crash leaves the old file or the new one, never a part. A [`Gate`] may carry a guard (an
//! elastic run's fence, `elastic/fence.rs`) that every landing passes under its lock just
//! before the rename: a writer that lost the run directory between two writes is refused at
//! the next one, with nothing of it landed.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{HearthError, Result};

/// Runs a landing (a rename or a removal) if and only if the run directory is still the
/// writer's, checked under a lock the landing holds until it is done.
pub type Guard = Arc<dyn Fn(&mut dyn FnMut() -> Result<()>) -> Result<()> + Send + Sync>;

/// Where files land: unguarded (one writer owns the run directory) or under a [`Guard`].
#[derive(Clone, Default)]
pub struct Gate {
    guard: Option<Guard>,
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.guard.is_some() {
            "Gate(guarded)"
        } else {
            "Gate(open)"
        })
    }
}

impl Gate {
    /// Every landing under `guard`.
    pub fn guarded(guard: Guard) -> Self {
        Self { guard: Some(guard) }
    }

    /// A temporary name beside `path` that no other writer (process or thread) uses, keeping
    /// its extension (Burn's and the plots' writers go by it): `.NAME.PID-N.tmp.EXT`.
    pub fn temp_for(path: &Path) -> PathBuf {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let stem = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let ext = path
            .extension()
            .map(|e| format!(".{}", e.to_string_lossy()))
            .unwrap_or_default();
        path.with_file_name(format!(".{stem}.{}-{n}.tmp{ext}", std::process::id()))
    }

    /// Writes `bytes` to `path`: a synced temporary file, then [`Gate::land`].
    pub fn write(&self, path: &Path, bytes: &[u8]) -> Result<()> {
        let tmp = Self::temp_for(path);
        let written = (|| {
            use std::io::Write;
            let mut file = std::fs::File::create(&tmp)?;
            file.write_all(bytes)?;
            file.sync_all()
        })();
        if let Err(source) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(HearthError::Write {
                path: path.to_path_buf(),
                source,
            });
        }
        self.land(&tmp, path)
    }

    /// Renames the finished temporary file `tmp` over `path` (after syncing it) where the guard
    /// allows, then syncs the directory; a refused or failed landing removes `tmp` and leaves
    /// `path` as it was.
    pub fn land(&self, tmp: &Path, path: &Path) -> Result<()> {
        let write = |source| HearthError::Write {
            path: path.to_path_buf(),
            source,
        };
        let landed = std::fs::File::open(tmp)
            .and_then(|f| f.sync_all())
            .map_err(write)
            .and_then(|()| {
                self.pass(&mut || {
                    std::fs::rename(tmp, path).map_err(write)?;
                    sync_dir(path);
                    Ok(())
                })
            });
        if landed.is_err() {
            let _ = std::fs::remove_file(tmp);
        }
        landed
    }

    /// Removes `path` where the guard allows (a missing file is no error).
    pub fn remove(&self, path: &Path) -> Result<()> {
        self.pass(&mut || match std::fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(HearthError::Write {
                path: path.to_path_buf(),
                source: e,
            }),
            _ => {
                sync_dir(path);
                Ok(())
            }
        })
    }

    /// Runs `landing` as the guard runs a rename (tests of the guards).
    #[cfg(test)]
    pub fn pass_for_test(&self, landing: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        self.pass(landing)
    }

    fn pass(&self, landing: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        match &self.guard {
            Some(guard) => guard(landing),
            None => landing(),
        }
    }
}

/// Syncs the directory holding `path`, so a rename in it survives a crash (best effort: some
/// filesystems refuse to sync a directory).
fn sync_dir(path: &Path) {
    if let Some(dir) = path.parent()
        && let Ok(d) = std::fs::File::open(if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        })
    {
        let _ = d.sync_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    #[test]
    fn temporary_names_differ_between_writers_and_keep_the_extension() {
        let p = Path::new("/run/metrics.csv");
        let (a, b) = (Gate::temp_for(p), Gate::temp_for(p));
        assert_ne!(a, b);
        let name = a.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            name.starts_with(".metrics.") && name.ends_with(".tmp.csv"),
            "{name}"
        );
    }

    #[test]
    fn a_refused_landing_leaves_the_old_file_and_no_temporary_one() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("metrics.csv");
        let open = Arc::new(AtomicBool::new(true));
        let o = open.clone();
        let gate = Gate::guarded(Arc::new(move |landing| {
            if o.load(Ordering::SeqCst) {
                landing()
            } else {
                Err(HearthError::CutOff("the fence moved".into()))
            }
        }));
        gate.write(&p, b"epoch 1").unwrap();
        open.store(false, Ordering::SeqCst);
        let e = gate.write(&p, b"epoch 0 again").unwrap_err().to_string();
        assert!(e.contains("fence moved"), "{e}");
        assert!(gate.remove(&p).is_err());
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "epoch 1");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }
}
