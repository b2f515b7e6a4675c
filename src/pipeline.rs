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

/// Times each unit of `units` on `x`: forward, then backward from the sum of its output (so
/// the figure is one training pass of that unit), on `device` (an autodiff device), waiting
/// for the device after each. Returns the seconds of each unit and the stage's output
/// (detached), for the next stage.
pub fn time_units(
    units: &[Unit],
    x: Activation,
    device: &burn::prelude::Device,
) -> burn_dist::Result<(Vec<f64>, Activation)> {
    let fail = |e: String| burn_dist::DistError::Config(format!("timing a unit: {e}"));
    let mut x = x.rank4("a model stage's input")?;
    let mut times = Vec::with_capacity(units.len());
    for (i, unit) in units.iter().enumerate() {
        let input = x.clone().detach().require_grad();
        let started = std::time::Instant::now();
        let out = unit.forward(input);
        let grads = match &out {
            UnitOutput::Features(f) => f.clone().sum().backward(),
            UnitOutput::Logits(l) => l.clone().sum().backward(),
        };
        drop(grads);
        device.sync().map_err(|e| fail(format!("{e:?}")))?;
        times.push(started.elapsed().as_secs_f64());
        match out {
            UnitOutput::Features(f) => x = f.detach(),
            UnitOutput::Logits(l) if i + 1 == units.len() => {
                return Ok((times, Activation::Rank2(l.detach())));
            }
            UnitOutput::Logits(_) => return Err(fail(format!("unit {i} ends the model early"))),
        }
    }
    Ok((times, Activation::Rank4(x)))
}

/// Seconds of one training pass (forward and backward) of each of a model's `units` units, for
/// a split balanced by time: every rank of the pipeline `pipe` times the units of its `stage`
/// (which starts at unit `first`) on the activations of `input` (used by the first stage),
/// over 3 passes after a warm-up pass; `comm` (the whole job) shares the figures, and the
/// replicas of a stage are averaged. Every rank of the job must call it.
pub fn measure_unit_times(
    stage: &StageModel,
    first: usize,
    units: usize,
    pipe: &mut burn_dist::pipeline::Pipeline,
    comm: &burn_dist::Communicator,
    input: Activation,
    device: &burn::prelude::Device,
) -> Result<Vec<f64>> {
    const PASSES: usize = 3;
    let mut totals = vec![0f32; units];
    for pass in 0..=PASSES {
        pipe.forward_with(
            &mut |a, _| {
                let (t, out) = time_units(&stage.units, a, device)?;
                if pass > 0 {
                    for (i, v) in t.into_iter().enumerate() {
                        if let Some(total) = totals.get_mut(first + i) {
                            *total += (v / PASSES as f64) as f32;
                        }
                    }
                }
                Ok(out)
            },
            &mut |_| input.clone(),
            &mut |_, _| Ok(()),
            1,
            device,
        )?;
    }
    let all = comm.all_gather(&totals)?;
    Ok((0..units)
        .map(|u| {
            let seen: Vec<f64> = all
                .chunks(units)
                .map(|r| f64::from(r[u]))
                .filter(|&t| t > 0.0)
                .collect();
            seen.iter().sum::<f64>() / seen.len().max(1) as f64
        })
        .collect())
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
