//! The run directory: preparing it, atomic writes, and what `--resume` reads back (the last
//! complete checkpoint, the hyperparameters, the earlier rows of `metrics.csv`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use hearth_models::ModelConfig;

use super::EpochTable;
use crate::{HearthError, Result};

/// What a run writes in its directory (the synthetic data set it may generate there, `data/`,
/// is not part of it and stays).
const RUN_FILES: [&str; 10] = [
    "metrics.csv",
    "metrics.png",
    "model.bpk",
    "hparams.json",
    "model_config.json",
    "auroc.csv",
    "world.csv",
    "world.png",
    "pipeline_split.txt",
    "checkpoint",
];

/// The files of an earlier run in `dir`.
fn run_files(dir: &Path) -> Vec<&'static str> {
    RUN_FILES
        .into_iter()
        .filter(|f| dir.join(f).exists())
        .collect()
}

/// Refuses a new run (no `--resume`) into a directory that holds one, unless `--overwrite`;
/// and a `--resume` of a directory that holds no run (a mistyped path), before anything is
/// created there.
pub fn check_fresh(cfg: &super::TrainConfig) -> Result<()> {
    if cfg.checkpoint.resume {
        if run_files(&cfg.run_dir).is_empty() {
            return Err(HearthError::InvalidArgument(format!(
                "cannot resume {}: no run there (no metrics.csv, checkpoint/ or hparams.json); \
                 `run_dir` starts a new one",
                cfg.run_dir.display()
            )));
        }
        return Ok(());
    }
    if cfg.checkpoint.overwrite {
        return Ok(());
    }
    let found = run_files(&cfg.run_dir);
    if found.is_empty() {
        return Ok(());
    }
    Err(HearthError::InvalidArgument(format!(
        "{} already holds a run ({}): `checkpoint.resume` {} continues it, `checkpoint.overwrite` replaces it, or \
         choose another `run_dir`",
        cfg.run_dir.display(),
        found.join(", "),
        cfg.run_dir.display()
    )))
}

/// Rank 0 at a run's start: [`check_fresh`], the earlier run's files removed with
/// `--overwrite` (said in `log`), then [`prepare`].
pub fn start(cfg: &super::TrainConfig, log: &mut dyn FnMut(&str)) -> Result<()> {
    check_fresh(cfg)?;
    if cfg.checkpoint.overwrite && !cfg.checkpoint.resume {
        let found = run_files(&cfg.run_dir);
        for f in &found {
            let path = cfg.run_dir.join(f);
            let removed = if path.is_dir() {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
            removed.map_err(|source| HearthError::Write {
                path: path.clone(),
                source,
            })?;
        }
        if !found.is_empty() {
            log(&format!(
                "`checkpoint.overwrite`: removed the earlier run's {} from {}",
                found.join(", "),
                cfg.run_dir.display()
            ));
        }
    }
    prepare(&cfg.run_dir)
}

/// Creates the run directory and proves it is writable.
pub fn prepare(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|source| HearthError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    let probe = dir.join(".hearth-write-test");
    std::fs::write(&probe, b"ok").map_err(|source| HearthError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    let _ = std::fs::remove_file(probe);
    Ok(())
}

/// Writes `bytes` (text or binary) to `path` atomically (`train/gate.rs`'s `Gate`, unguarded): a
/// synced temporary file of a name no other writer uses, then a rename, so a crash leaves either
/// the old file or the new one, never a part.
pub fn write_atomic(path: &Path, bytes: impl AsRef<[u8]>) -> Result<()> {
    super::gate::Gate::default().write(path, bytes.as_ref())
}

/// Epochs `e` for which `dir` holds `<part>-<e>.bpk` for every one of `parts` (the first part
/// names the candidates).
pub fn checkpoints_in(dir: &Path, parts: &[&str]) -> BTreeSet<usize> {
    let Some(first) = parts.first() else {
        return BTreeSet::new();
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return BTreeSet::new();
    };
    let prefix = format!("{first}-");
    entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.strip_prefix(&prefix)?
                .strip_suffix(".bpk")?
                .parse::<usize>()
                .ok()
        })
        .filter(|e| {
            parts
                .iter()
                .all(|part| dir.join(format!("{part}-{e}.bpk")).is_file())
        })
        .collect()
}

pub fn hparams_json(h: &super::Recorded) -> String {
    serde_json::to_string_pretty(h).unwrap_or_default()
}

/// Writes `model_config.json` (`model_json`: a `ModelConfig`'s JSON, or a user's module's
/// type and classes) and `hparams.json`, which `--resume` checks against.
pub fn record(run_dir: &Path, model_json: &str, h: &super::Recorded) -> Result<()> {
    write_atomic(&run_dir.join("model_config.json"), model_json)?;
    write_atomic(&run_dir.join("hparams.json"), hparams_json(h))
}

/// A resumed run must have the same model (`model_json`, as [`record`] wrote it) and
/// hyperparameters as the original.
pub fn check_resume_compatible(
    run_dir: &Path,
    model_json: &str,
    hparams: &super::Recorded,
) -> Result<()> {
    let path = run_dir.join("model_config.json");
    let saved = std::fs::read_to_string(&path).map_err(|source| HearthError::Read {
        path: path.clone(),
        source,
    })?;
    let same = match (
        ModelConfig::from_json(&saved),
        ModelConfig::from_json(model_json),
    ) {
        (Ok(a), Ok(b)) => a.to_json() == b.to_json(),
        _ => saved.trim() == model_json.trim(),
    };
    if !same {
        let classes = |json: &str| {
            ModelConfig::from_json(json)
                .map(|c| c.num_classes().to_string())
                .unwrap_or("?".into())
        };
        return Err(HearthError::InvalidArgument(format!(
            "cannot resume {}: it was trained with a different model or class count \
             ({} classes there, {} now)",
            run_dir.display(),
            classes(&saved),
            classes(model_json)
        )));
    }
    // Runs from before hparams.json existed resume on the model check alone.
    let path = run_dir.join("hparams.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(());
    };
    let saved: BTreeMap<String, serde_json::Value> = serde_json::from_str(&text)
        .map_err(|e| HearthError::InvalidArgument(format!("{}: {e}", path.display())))?;
    // Files written before the values were typed hold every value as text (Rust debug text,
    // not comparable with the typed values): those runs resume on the model check alone, as
    // runs from before hparams.json did.
    if saved.values().all(serde_json::Value::is_string) {
        return Ok(());
    }
    // The number of parameter servers may change: their state is cut anew for the new number.
    let comparable = |k: &str, v: &serde_json::Value| {
        let mut v = v.clone();
        if k == "ps"
            && let Some(o) = v.as_object_mut()
        {
            o.remove("servers");
        }
        v
    };
    let differing: Vec<String> = hparams
        .iter()
        .filter(|(k, _)| !super::config::MAY_CHANGE_ON_RESUME.contains(&k.as_str()))
        .filter_map(|(k, now)| {
            let then = saved.get(k.as_str())?;
            (comparable(k, then) != comparable(k, now))
                .then(|| format!("{k}: {then} then, {now} now"))
        })
        .collect();
    if !differing.is_empty() {
        return Err(HearthError::InvalidArgument(format!(
            "cannot resume {} exactly: hyperparameters differ ({}); pass the original ones",
            run_dir.display(),
            differing.join("; ")
        )));
    }
    Ok(())
}

/// Rows of an earlier `metrics.csv` up to `epoch`, so a resumed run's table is whole.
pub fn reload_table(csv: &Path, table: &EpochTable, epoch: usize) -> Result<()> {
    let text = match std::fs::read_to_string(csv) {
        Ok(t) => t,
        Err(source) => {
            return Err(HearthError::Read {
                path: csv.to_path_buf(),
                source,
            });
        }
    };
    let mut lines = text.lines();
    let Some(header) = lines.next() else {
        return Ok(());
    };
    let columns: Vec<&str> = header.split(',').collect();
    let Ok(mut t) = table.lock() else {
        return Ok(());
    };
    for line in lines {
        let cells: Vec<&str> = line.split(',').collect();
        let Some(Ok(e)) = cells.first().map(|c| c.parse::<usize>()) else {
            continue;
        };
        if e > epoch {
            continue;
        }
        let row = t.entry(e).or_default();
        for (c, v) in columns.iter().zip(&cells).skip(1) {
            if let Ok(v) = v.parse::<f64>() {
                row.insert(c.to_string(), v);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_epochs_with_every_part_are_complete() {
        let dir = tempfile::tempdir().unwrap();
        let ck = dir.path().join("checkpoint");
        std::fs::create_dir_all(&ck).unwrap();
        for name in ["model-1.bpk", "optim-1.bpk", "model-2.bpk", "optim-x.bpk"] {
            std::fs::write(ck.join(name), b"x").unwrap();
        }
        let parts = ["model", "optim"];
        assert_eq!(checkpoints_in(&ck, &parts), BTreeSet::from([1]));
        std::fs::remove_file(ck.join("optim-1.bpk")).unwrap();
        assert!(checkpoints_in(&ck, &parts).is_empty());
        assert!(checkpoints_in(&dir.path().join("none"), &parts).is_empty());
    }

    #[test]
    fn atomic_writes_leave_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("hparams.json");
        write_atomic(&p, "{}").unwrap();
        write_atomic(&p, "{\"a\": 1}").unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "{\"a\": 1}");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().collect();
        assert_eq!(names.len(), 1);
    }
}
