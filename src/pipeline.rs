//! Hearth's models on burn-dist's pipeline: a contiguous range of a model's units
//! ([`hearth_models::stages`]) as a [`burn_dist::pipeline::PipelineStage`], and splitting a
//! model's units into stages of balanced parameter counts.
//!
//! ResNet, VGG and DenseNet have units; a ResNet split by this module trains through GPipe and
//! 1F1B exactly like the unsplit model (`cli/tests/pipeline.rs`). `hearth train --pipeline-stages`
//! is [`crate::train`]'s pipeline mode (`src/train/pipeline.rs`).

use std::ops::Range;

use burn::module::Module;
use burn_dist::pipeline::Activation;
use hearth_models::stages::{Unit, UnitOutput};

use crate::{HearthError, Result};

mod forward_ahead;
mod gathered;
mod regather;
mod stage;

pub use gathered::{
    FetchOrder, Gathering, KeptUnits, ReadBytes, gathered_logits, gathered_tensors, piece_rows,
    unit_tensor_counts,
};
pub use stage::StageModel;

/// The gradients of `loss(model(x))` for `owner`'s parameters (`owner` holds `model`, e.g.
/// the Learner's task), with `model` run unit by unit in `precision`:
///
/// - `recompute` (`--recompute`): keeping only each unit's input between the forward and the
///   backward ([`burn_dist::pipeline::recomputed_gradients_each`]);
/// - else with every unit's graph, the backward cut at the units
///   ([`burn_dist::pipeline::segmented_gradients`]).
///
/// With `gathering` (ZeRO stage 3) `model` is a skeleton: each unit's parameters are gathered
/// from the ranks' shards before each of its passes, and go when the pass is over (with
/// `recompute`: one unit's at a time; without, each unit's graph keeps its convolutions' and
/// linear layers' weights by key, so they go after its forward and are gathered again for its
/// backward: `pipeline/regather.rs`).
///
/// Either way each unit's gradients go, as soon as its backward is over, to the overlapped
/// exchange of this thread's step if one is installed ([`burn_dist::overlap::hand_over`]:
/// `--overlap`), and the rest come back. `loss` gets the logits (f32, with their graph) and
/// may keep them for metrics.
pub fn unit_gradients<M: Module>(
    owner: &M,
    model: &hearth_models::Classifier,
    x: burn::prelude::Tensor<4>,
    precision: crate::train::Precision,
    recompute: bool,
    gathering: Option<&Gathering<'_>>,
    loss: &mut dyn FnMut(burn::prelude::Tensor<2>) -> Result<burn::prelude::Tensor<1>>,
) -> Result<burn::optim::GradientsParams> {
    let device = x.device();
    let segments: Vec<StageModel> = model
        .clone()
        .into_units()
        .into_iter()
        .map(|u| StageModel {
            units: vec![u],
            precision,
        })
        .collect();
    let mut failed = None;
    let mut on_output = |out: Activation| {
        let logits = out.rank2("the model's output")?;
        loss(logits).map_err(|e| {
            let text = e.to_string();
            failed = Some(e);
            burn_dist::DistError::Config(text)
        })
    };
    let mut done = |_: usize, unit: &StageModel, g| Ok(burn_dist::overlap::hand_over(unit, g));
    let x = Activation::Rank4(x);
    let mut gather = |_: usize, s: &StageModel| match gathering {
        Some(g) => g.params.gather(g.zero, g.comm, s),
        None => Ok(s.clone()),
    };
    let grads = if recompute {
        burn_dist::pipeline::recomputed_gradients_gathered(
            &segments,
            &mut gather,
            x,
            &mut on_output,
            &device,
            &mut done,
        )
    } else if let Some(shards) = gathering {
        // With `--overlap` (`shards.ahead`: the gathers' communicator is theirs alone), threads
        // of this scope gather ahead: one the forward's units, up to a bucket's bytes ahead of
        // it, and from the first unit's backward on (the forward's thread done) one the
        // backward's buckets (`Regathered`), one ahead. Each ends as the step's pass drops its
        // channel. Their frames go out before the reductions' (`Kind::urgent`).
        std::thread::scope(|scope| {
            let ahead: Option<forward_ahead::SharedForward<'_>> = match shards.ahead {
                Some(_) => Some(std::rc::Rc::new(std::cell::RefCell::new(Some(
                    forward_ahead::forward_ahead(scope, shards, &segments)?,
                )))),
                None => None,
            };
            // The matrices cut into pieces of rows stay empty: the keyed forward takes them a
            // piece at a time (`Regathered::forward`), from the thread if there is one.
            let gather_unit = |k: usize, s: &StageModel| match ahead.as_ref() {
                Some(thread) => match thread.borrow_mut().as_mut() {
                    Some(a) => a.take(k, s),
                    None => Err(burn_dist::DistError::Config(format!(
                        "unit {k}'s parameters asked for after the forward's thread ended"
                    ))),
                },
                None => shards.params.gather_but_pieces(shards.zero, shards.comm, s),
            };
            let mut gather = |k: usize, s: &StageModel| {
                crate::alloc::phase::mark(crate::alloc::phase::Phase::Forward(k));
                gather_unit(k, s)
            };
            burn_dist::pipeline::segmented_gradients_regathered(
                &segments,
                &mut gather,
                &mut regather::Regathered::new(shards, Some(scope), &segments, ahead.clone())?,
                x,
                &mut on_output,
                &mut done,
            )
        })
    } else {
        burn_dist::pipeline::segmented_gradients_gathered(
            &segments,
            &mut gather,
            x,
            &mut on_output,
            &mut done,
        )
    };
    crate::alloc::phase::mark(crate::alloc::phase::Phase::Update);
    let grads = match (grads, failed) {
        (_, Some(e)) => return Err(e),
        (Ok(g), None) => g,
        (Err(e), None) => return Err(HearthError::from(e)),
    };
    let mut all = burn::optim::GradientsAccumulator::<M>::new();
    for g in grads {
        all.accumulate(owner, g);
    }
    Ok(all.grads())
}

/// Activation recomputation (`--recompute`) in one process: [`unit_gradients`] keeping only
/// each unit's input between the forward and the backward.
pub fn recomputed_gradients<M: Module>(
    owner: &M,
    model: &hearth_models::Classifier,
    x: burn::prelude::Tensor<4>,
    precision: crate::train::Precision,
    loss: &mut dyn FnMut(burn::prelude::Tensor<2>) -> Result<burn::prelude::Tensor<1>>,
) -> Result<burn::optim::GradientsParams> {
    unit_gradients(owner, model, x, precision, true, None, loss)
}

/// What one training pass of a unit costs on one micro-batch.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct UnitCost {
    /// Forward and backward, seconds.
    pub seconds: f64,
    /// Memory the forward holds until the backward (the activations it keeps and its output),
    /// bytes: the growth of the live heap across the forward ([`crate::alloc`]), else of the
    /// resident set (blurred by the allocator's reuse of freed memory); 0 where neither can be
    /// read.
    pub retained_bytes: f64,
    /// The unit's input (in f32), bytes: what a stage starting at this unit holds per
    /// micro-batch in flight when it recomputes activations.
    pub input_bytes: f64,
}

/// Bytes in use by this process: live heap bytes when the program counts them, else the
/// resident set (Linux `/proc/self/statm`), if readable.
fn memory_in_use() -> Option<f64> {
    if let Some(live) = crate::alloc::live_bytes() {
        return Some(live as f64);
    }
    let text = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: f64 = text.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096.0)
}

/// Profiles each unit of `units` on `x`: forward (the memory it holds while its graph lives), then backward from the sum of its output, on `device` (an autodiff device), waiting
/// for the device after each. Returns each unit's cost and the stage's output (detached), for
/// the next stage.
pub fn profile_units(
    units: &[Unit],
    x: Activation,
    device: &burn::prelude::Device,
) -> burn_dist::Result<(Vec<UnitCost>, Activation)> {
    let fail = |e: String| burn_dist::DistError::Config(format!("profiling a unit: {e}"));
    let sync = || device.sync().map_err(|e| fail(format!("{e:?}")));
    let mut x = x.rank4("a model stage's input")?;
    let mut costs = Vec::with_capacity(units.len());
    for (i, unit) in units.iter().enumerate() {
        let input_bytes = 4.0 * x.dims().iter().product::<usize>() as f64;
        let input = x.clone().detach().require_grad();
        sync()?;
        let before = memory_in_use();
        let started = std::time::Instant::now();
        let out = unit.forward(input);
        sync()?;
        let held = match (before, memory_in_use()) {
            (Some(a), Some(b)) => (b - a).max(0.0),
            _ => 0.0,
        };
        let grads = match &out {
            UnitOutput::Features(f) => f.clone().sum().backward(),
            UnitOutput::Logits(l) => l.clone().sum().backward(),
        };
        drop(grads);
        sync()?;
        costs.push(UnitCost {
            seconds: started.elapsed().as_secs_f64(),
            retained_bytes: held,
            input_bytes,
        });
        match out {
            UnitOutput::Features(f) => x = f.detach(),
            UnitOutput::Logits(l) if i + 1 == units.len() => {
                return Ok((costs, Activation::Rank2(l.detach())));
            }
            UnitOutput::Logits(_) => return Err(fail(format!("unit {i} ends the model early"))),
        }
    }
    Ok((costs, Activation::Rank4(x)))
}

/// The cost of one training pass of each of a model's `units` units, for a split balanced by
/// time or memory: every rank of the pipeline `pipe` profiles the units of its `stage` (which
/// starts at unit `first`) on the activations of `input` (used by the first stage), over 3
/// passes after a warm-up pass (time averaged, memory the largest seen); `comm` (the whole job)
/// shares the figures, replicas of a stage averaged. Every rank of the job must call it.
pub fn measure_units(
    stage: &StageModel,
    first: usize,
    units: usize,
    pipe: &mut burn_dist::pipeline::Pipeline,
    comm: &burn_dist::Communicator,
    input: Activation,
    device: &burn::prelude::Device,
) -> Result<Vec<UnitCost>> {
    const PASSES: usize = 3;
    // [seconds of every unit..., bytes held by every unit..., bytes of every unit's input...]
    let mut mine = vec![0f32; 3 * units];
    for pass in 0..=PASSES {
        pipe.forward_with(
            &mut |a, _| {
                let (costs, out) = profile_units(&stage.units, a, device)?;
                if pass > 0 {
                    for (i, c) in costs.into_iter().enumerate() {
                        let u = first + i;
                        if u < units {
                            mine[u] += (c.seconds / PASSES as f64) as f32;
                            mine[units + u] = mine[units + u].max(c.retained_bytes as f32);
                            mine[2 * units + u] = c.input_bytes as f32;
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
    let all = comm.all_gather(&mine)?;
    let column = |k: usize| -> f64 {
        let seen: Vec<f64> = all
            .chunks(3 * units)
            .map(|r| f64::from(r[k]))
            .filter(|&v| v > 0.0)
            .collect();
        seen.iter().sum::<f64>() / seen.len().max(1) as f64
    };
    Ok((0..units)
        .map(|u| UnitCost {
            seconds: column(u),
            retained_bytes: column(units + u),
            input_bytes: column(2 * units + u),
        })
        .collect())
}

/// Contiguous ranges of `weights` (e.g. each unit's parameter count) for `parts` stages, with
/// the largest stage as small as possible. Every stage gets at least one unit.
pub fn balance(weights: &[usize], parts: usize) -> Result<Vec<Range<usize>>> {
    let prefix: Vec<f64> = std::iter::once(0.0)
        .chain(weights.iter().scan(0.0, |s, &w| {
            *s += w as f64;
            Some(*s)
        }))
        .collect();
    balance_by(weights.len(), parts, |_, r| prefix[r.end] - prefix[r.start])
}

/// Contiguous ranges of `n` units for `parts` stages minimising the largest
/// `cost(stage, units)`, a cost that may depend on the stage (a stage early in a 1F1B
/// pipeline holds more micro-batches of activations than a late one). Every stage gets at
/// least one unit.
pub fn balance_by(
    n: usize,
    parts: usize,
    cost: impl Fn(usize, Range<usize>) -> f64,
) -> Result<Vec<Range<usize>>> {
    if parts == 0 || parts > n {
        return Err(HearthError::InvalidArgument(format!(
            "cannot split {n} units into {parts} stages"
        )));
    }
    // best[k][i]: the smallest largest-stage cost of units 0..i in k stages; cut[k][i] where
    // the last of those stages starts.
    let mut best = vec![vec![f64::INFINITY; n + 1]; parts + 1];
    let mut cut = vec![vec![0usize; n + 1]; parts + 1];
    best[0][0] = 0.0;
    for k in 1..=parts {
        for i in k..=n {
            for j in (k - 1)..i {
                if best[k - 1][j].is_infinite() {
                    continue;
                }
                let c = best[k - 1][j].max(cost(k - 1, j..i));
                if c < best[k][i] {
                    best[k][i] = c;
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

/// A stage's memory while training: each parameter's `state_bytes` (weights, gradients, their
/// accumulation over micro-batches, optimizer state) plus the activations of the micro-batches
/// it holds at once (`in_flight`); with `recompute`, the in-flight micro-batches' inputs and
/// one micro-batch's activations.
pub fn stage_memory(
    params: &[usize],
    costs: &[UnitCost],
    units: Range<usize>,
    state_bytes: f64,
    in_flight: usize,
    recompute: bool,
) -> f64 {
    let state: f64 = params[units.clone()].iter().map(|&p| p as f64).sum::<f64>() * state_bytes;
    let input = costs.get(units.start).map_or(0.0, |c| c.input_bytes);
    let acts: f64 = costs[units].iter().map(|c| c.retained_bytes).sum();
    if recompute {
        state + acts + in_flight as f64 * input
    } else {
        state + in_flight as f64 * acts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recomputing_stage_holds_its_inputs_and_one_micro_batch_of_activations() {
        let unit = |held: f64, input: f64| UnitCost {
            seconds: 0.0,
            retained_bytes: held,
            input_bytes: input,
        };
        let costs = [unit(100.0, 10.0), unit(50.0, 5.0), unit(20.0, 2.0)];
        let params = [1, 2, 3];
        // Without: 3 micro-batches of both units' activations, plus 8 bytes per parameter.
        assert_eq!(
            stage_memory(&params, &costs, 0..2, 8.0, 3, false),
            24.0 + 450.0
        );
        // With: one micro-batch's activations, and 3 inputs of the stage's first unit.
        assert_eq!(
            stage_memory(&params, &costs, 0..2, 8.0, 3, true),
            24.0 + 150.0 + 30.0
        );
        assert_eq!(
            stage_memory(&params, &costs, 1..3, 8.0, 2, true),
            40.0 + 70.0 + 10.0
        );
    }

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
        // A cost that grows for early stages (more micro-batches in flight) moves units later.
        let w = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0];
        let flat = balance_by(6, 2, |_, r| w[r].iter().sum()).unwrap();
        assert_eq!(flat, vec![0..3, 3..6]);
        let early_heavy =
            balance_by(6, 2, |s, r| w[r].iter().sum::<f64>() * (2 - s) as f64).unwrap();
        assert_eq!(early_heavy, vec![0..2, 2..6]);
        assert!(balance(&[1, 2], 3).is_err());
        assert!(balance(&[1, 2], 0).is_err());
    }
}
