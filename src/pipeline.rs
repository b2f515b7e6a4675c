//! Hearth's models on burn-dist's pipeline: a contiguous range of a model's units
//! ([`hearth_models::stages`]) as a [`PipelineStage`], and splitting a model's units into
//! stages of balanced parameter counts.
//!
//! ResNet, VGG and DenseNet have units; a ResNet split by this module trains through GPipe and
//! 1F1B exactly like the unsplit model (`tests/pipeline.rs`). `hearth train --pipeline-stages`
//! is [`crate::train`]'s pipeline mode (`src/train/pipeline.rs`).

use std::ops::Range;

use burn::module::Module;
use burn_dist::pipeline::{Activation, PipelineStage};
use hearth_models::stages::{Unit, UnitOutput};

use crate::{HearthError, Result};

/// A pipeline stage: consecutive units of one model.
#[derive(Module, Debug)]
pub struct StageModel {
    pub units: Vec<Unit>,
}

impl PipelineStage for StageModel {
    fn forward(&self, x: Activation) -> burn_dist::Result<Activation> {
        let mut x = x.rank4("a model stage's input")?;
        for (i, unit) in self.units.iter().enumerate() {
            match unit.forward(x) {
                UnitOutput::Features(f) => x = f,
                UnitOutput::Logits(l) if i + 1 == self.units.len() => {
                    return Ok(Activation::Rank2(l));
                }
                UnitOutput::Logits(_) => {
                    return Err(burn_dist::DistError::Config(format!(
                        "unit {i} of a stage of {} produces logits: the head must end its stage",
                        self.units.len()
                    )));
                }
            }
        }
        Ok(Activation::Rank4(x))
    }
}

/// Contiguous ranges of `weights` (e.g. each unit's parameter count) for `parts` stages, with
/// the largest stage as small as possible. Every stage gets at least one unit.
pub fn balance(weights: &[usize], parts: usize) -> Result<Vec<Range<usize>>> {
    let n = weights.len();
    if parts == 0 || parts > n {
        return Err(HearthError::InvalidArgument(format!(
            "cannot split {n} units into {parts} stages"
        )));
    }
    let prefix: Vec<usize> = std::iter::once(0)
        .chain(weights.iter().scan(0usize, |s, w| {
            *s += w;
            Some(*s)
        }))
        .collect();
    let sum = |a: usize, b: usize| prefix[b] - prefix[a];
    // best[k][i]: the smallest largest-stage cost of units 0..i in k stages; cut[k][i] where
    // the last of those stages starts.
    let mut best = vec![vec![usize::MAX; n + 1]; parts + 1];
    let mut cut = vec![vec![0usize; n + 1]; parts + 1];
    best[0][0] = 0;
    for k in 1..=parts {
        for i in k..=n {
            for j in (k - 1)..i {
                if best[k - 1][j] == usize::MAX {
                    continue;
                }
                let cost = best[k - 1][j].max(sum(j, i));
                if cost < best[k][i] {
                    best[k][i] = cost;
                    cut[k][i] = j;
                }
            }
        }
    }
    let mut ranges = Vec::with_capacity(parts);
    let mut end = n;
    for k in (1..=parts).rev() {
        let start = cut[k][end];
        ranges.push(start..end);
        end = start;
    }
    ranges.reverse();
    Ok(ranges)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balance_minimises_the_largest_stage() {
        assert_eq!(balance(&[1, 1, 1, 1], 2).unwrap(), vec![0..2, 2..4]);
        assert_eq!(balance(&[5, 1, 1, 1, 1, 1], 2).unwrap(), vec![0..1, 1..6]);
        assert_eq!(
            balance(&[1, 2, 3, 4, 5], 3).unwrap(),
            vec![0..3, 3..4, 4..5]
        );
        let r = balance(&[3, 3, 3], 3).unwrap();
        assert_eq!(r, vec![0..1, 1..2, 2..3]);
        assert!(balance(&[1, 2], 3).is_err());
        assert!(balance(&[1, 2], 0).is_err());
    }
}
