//! A member's shard of the optimizer under `--zero` and where the elastic sharded state files
//! go: below the run that holds it and the steps that re-shard it.

use std::path::PathBuf;

use burn_dist::zero::ZeroOptimizer;

use crate::train::TrainConfig;
use crate::{HearthError, Result};

/// A member's shard of the optimizer and the versions a change may need.
pub(super) struct Sharded {
    /// The shard of the committed step, the same since step `since`.
    pub current: ZeroOptimizer,
    pub since: u64,
    /// The shard before the last step (valid since its step), until that step is confirmed.
    pub previous: Option<(u64, ZeroOptimizer)>,
    /// After a step that failed in its all-gather: the shard with that step applied.
    pub pending: Option<ZeroOptimizer>,
}

/// The folder of the elastic sharded state files.
pub(super) fn state_dir(cfg: &TrainConfig) -> PathBuf {
    cfg.run_dir.join("checkpoint").join("elastic-zero")
}

impl Sharded {
    /// The version to re-shard from when the new world's rank 0 committed `step` and this
    /// member `mine`.
    pub(super) fn version(self, mine: u64, step: u64) -> Result<ZeroOptimizer> {
        if step == mine + 1
            && let Some(mut p) = self.pending
        {
            p.confirm_applied();
            return Ok(p);
        }
        // A step after this member's without a pending update was skipped (fp16): the same.
        if (self.since..=mine + 1).contains(&step) {
            return Ok(self.current);
        }
        match self.previous {
            Some((since, p)) if (since..self.since).contains(&step) => Ok(p),
            _ => Err(HearthError::Training(format!(
                "the new world goes on from step {step}, and this worker holds the optimizer \
                 shard of step {mine} (since step {})",
                self.since
            ))),
        }
    }
}
