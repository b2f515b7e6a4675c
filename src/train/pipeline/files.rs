//! A pipeline run's files and the split they record: where each stage keeps its checkpoints
//! and loss scale, which epochs every stage can resume from, and the stages' unit ranges
//! (`--pipeline-split`, or balanced by parameter count) as `pipeline_split.txt` writes them.
//! Below the run's methods in `split.rs` and `store.rs` and the setup in `mod.rs`.

use std::collections::BTreeSet;
use std::ops::Range;
use std::path::{Path, PathBuf};

use burn::prelude::*;
use hearth_models::ModelConfig;

use crate::pipeline::balance;
use crate::settings::PipelineOptions;
use crate::train::{TrainConfig, run_dir};
use crate::{HearthError, Result};

/// The run's recorded split (`pipeline_split.txt`), which a resumed run keeps.
pub(super) fn split_file(run_dir: &Path) -> PathBuf {
    run_dir.join("pipeline_split.txt")
}

pub(super) fn format_split(ranges: &[Range<usize>]) -> String {
    ranges
        .iter()
        .map(|r| format!("{}:{}", r.start, r.end))
        .collect::<Vec<_>>()
        .join(",")
}

/// The stages' unit ranges: `--pipeline-split`, or balanced by parameter count.
pub(super) fn split(
    cfg: &TrainConfig,
    opts: &PipelineOptions,
    config: &ModelConfig,
    device: &Device,
) -> Result<Vec<Range<usize>>> {
    let n = config.units();
    let ranges = match &opts.split {
        Some(r) => r.clone(),
        None => balance(&config.unit_params(device)?, opts.stages)?,
    };
    if ranges.last().map(|r| r.end) != Some(n) {
        return Err(HearthError::InvalidArgument(format!(
            "`PipelineOptions.split` must cover units 0..{n} of {} (it ends at {})",
            cfg.model.name,
            ranges.last().map_or(0, |r| r.end)
        )));
    }
    Ok(ranges)
}

/// `run_dir/checkpoint/stage-<s>`.
pub(super) fn stage_dir(run_dir: &Path, stage: usize) -> PathBuf {
    run_dir.join("checkpoint").join(format!("stage-{stage}"))
}

pub(super) fn model_file(run_dir: &Path, stage: usize, epoch: usize) -> PathBuf {
    stage_dir(run_dir, stage).join(format!("model-{epoch}.bpk"))
}

/// `optim.model_ema`: the stage's weight average after `epoch`.
pub(super) fn ema_file(run_dir: &Path, stage: usize, epoch: usize) -> PathBuf {
    stage_dir(run_dir, stage).join(format!("ema-{epoch}.bpk"))
}

pub(super) fn optim_file(run_dir: &Path, stage: usize, epoch: usize) -> PathBuf {
    stage_dir(run_dir, stage).join(format!("optim-{epoch}.bpk"))
}

/// fp16's loss scale after `epoch` (the same on every stage; each stage keeps a copy, so a
/// rank resumes from its own disk).
pub(super) fn loss_scale_file(run_dir: &Path, stage: usize, epoch: usize) -> PathBuf {
    stage_dir(run_dir, stage).join(format!("loss-scale-{epoch}.json"))
}

/// Epochs whose model and optimizer files exist for every one of `stages` stages (on a shared
/// disk; on separate machines each rank checks what it can see, and the ranks agree on the
/// minimum).
pub(super) fn complete_pipeline_checkpoints(run_dir: &Path, stages: usize) -> BTreeSet<usize> {
    (0..stages)
        .map(|s| stage_epochs(run_dir, s))
        .reduce(|a, b| a.intersection(&b).copied().collect())
        .unwrap_or_default()
}

/// Epochs for which stage `stage` has both its model and optimizer files.
pub(super) fn stage_epochs(run_dir: &Path, stage: usize) -> BTreeSet<usize> {
    run_dir::checkpoints_in(&stage_dir(run_dir, stage), &["model", "optim"])
}
