//! ZeRO stage 3's passes outside a training step, a unit's parameters gathered at a time:
//! validation's forward ([`gathered_logits`]) and the checkpoint's tensors
//! ([`gathered_tensors`]); where stage 3 cuts its buckets ([`unit_tensor_counts`]: the
//! units placed where their tensors stand in the model); and what a step's passes share with
//! them and with the threads that gather ahead ([`Gathering`], `Shards`, [`FetchOrder`],
//! [`KeptUnits`]).

use burn::module::Module;
use burn_dist::pipeline::{Activation, PipelineStage};

use super::stage::StageModel;
use crate::{HearthError, Result};

/// ZeRO stage 3's forward without a graph (validation): `x` through `model`'s units (a
/// skeleton), each unit's parameters gathered from the ranks' shards for its pass and let go
/// after it, so that a rank never holds more than one unit's parameters whole (gathering the
/// whole model would need what stage 3 is there to save). The matrices cut into pieces of rows
/// (larger than a bucket: VGG-16's 411 MB first classifier weight) are not even held whole for
/// their unit: their products take them a piece at a time, as the training step's do
/// (`PiecesInOrder`). Computed in `precision`, the logits in f32, on `x`'s device (an inner
/// device: no graph).
///
/// Every rank calls it alike for each round of a validation, `x` `None` on a rank whose
/// share has no batch left while another's has: the gathers are collective, so such a rank
/// gathers each unit and each piece all the same and computes nothing (the result `None`).
pub fn gathered_logits(
    model: &hearth_models::Classifier,
    x: Option<burn::prelude::Tensor<4>>,
    precision: crate::train::Precision,
    gathering: &Gathering<'_>,
) -> Result<Option<burn::prelude::Tensor<2>>> {
    let mut x = x.map(Activation::Rank4);
    each_gathered_unit(
        model,
        precision,
        gathering,
        false,
        &mut |whole, matrices| {
            let mut pieces = PiecesInOrder::new(Shards::of(gathering), matrices);
            if let Some(a) = x.take() {
                let valid = whole.valid();
                x = Some(match matrices.is_empty() {
                    true => valid.forward(a)?,
                    false => {
                        let pieced = matrices
                            .iter()
                            .map(|(id, rows, cols)| {
                                let (rows, cols) = (rows.clone(), *cols);
                                (id.val(), hearth_kernels::keyed::Pieces { rows, cols })
                            })
                            .collect();
                        let (y, _, fetched) =
                            hearth_kernels::keyed::forward_from(pieced, &mut pieces, || {
                                valid.forward(a)
                            });
                        fetched.map_err(|e| {
                            HearthError::Training(format!("validation's forward by pieces: {e}"))
                        })?;
                        y?
                    }
                });
            }
            // What the forward did not ask for (all of it on a rank without a batch).
            pieces.finish().map_err(HearthError::Training)
        },
    )?;
    match x {
        Some(a) => Ok(Some(a.rank2("the model's output")?)),
        None => Ok(None),
    }
}

/// A tensor's bytes, or one piece of them, read at most once (a checkpoint's writer reads them
/// when it reaches them).
pub type ReadBytes<'a> = Box<dyn FnOnce() -> burn::tensor::Bytes + 'a>;

/// ZeRO stage 3's checkpoint: `model`'s (a skeleton's) units gathered one at a time, in the
/// order of their tensors in the model (the file's), and each tensor the skeleton holds empty
/// handed to `each` with its parameter id and a function that reads its bytes (f32, as a
/// checkpoint stores them; read only if `each` calls it). A matrix cut into pieces of rows is
/// gathered a piece at a time and handed to `each` a piece at a time, in order (consecutive
/// calls with its id), so that no rank ever holds it whole: the rank that writes the file
/// writes each piece as it comes, the others let it go at once. Every rank calls it alike
/// (the gathers are collective); one unit's other parameters are held whole at a time.
pub fn gathered_tensors(
    model: &hearth_models::Classifier,
    gathering: &Gathering<'_>,
    each: &mut dyn FnMut(u64, ReadBytes<'_>),
) -> Result<()> {
    use burn::module::{ModuleVisitor, Param};
    struct Each<'a, 'b> {
        params: &'a burn_dist::zero::module::ShardedParams,
        shards: Shards<'a>,
        matrices: &'b [burn_dist::zero::module::PiecedMatrix],
        each: &'b mut dyn FnMut(u64, ReadBytes<'_>),
        failed: Option<String>,
    }
    impl Each<'_, '_> {
        /// Matrix `id`'s pieces gathered and handed over in order; `false` where `id` is not
        /// cut into pieces.
        fn pieces(&mut self, id: burn::module::ParamId) -> bool {
            let Some((_, rows, cols)) = self.matrices.iter().find(|m| m.0 == id) else {
                return false;
            };
            for (k, r) in rows.iter().enumerate() {
                if self.failed.is_some() {
                    break;
                }
                match gather_rows(self.shards, id.val(), k, r.len(), *cols) {
                    Ok(piece) => (self.each)(id.val(), Box::new(move || piece.into_bytes())),
                    Err(e) => self.failed = Some(e),
                }
            }
            true
        }
    }
    impl ModuleVisitor for Each<'_, '_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<burn::prelude::Tensor<D>>) {
            if self.params.shape_of(&param.id).is_none() || self.pieces(param.id) {
                return;
            }
            let t = param.transform_for_save().val();
            // One copy on the CPU (`into_data` of a held tensor makes two).
            let read = move || {
                hearth_kernels::file_bytes(&t).unwrap_or_else(|| t.clone().into_data().into_bytes())
            };
            (self.each)(param.id.val(), Box::new(read));
        }
    }
    let precision = crate::train::Precision::Fp32;
    each_gathered_unit(model, precision, gathering, true, &mut |unit, matrices| {
        let mut visit = Each {
            params: gathering.params,
            shards: Shards::of(gathering),
            matrices,
            each: &mut *each,
            failed: None,
        };
        unit.visit(&mut visit);
        match visit.failed {
            Some(e) => Err(HearthError::Training(format!("the checkpoint's {e}"))),
            None => Ok(()),
        }
    })
}

/// Each of `model`'s (a skeleton's) units, in the forward's order or (`model_order`) in the
/// order of their tensors in the model, as a one-unit stage in `precision` with its parameters
/// gathered but its matrices cut into pieces of rows (held empty), handed to `f` with those
/// matrices' pieces and let go before the next is gathered.
fn each_gathered_unit(
    model: &hearth_models::Classifier,
    precision: crate::train::Precision,
    gathering: &Gathering<'_>,
    model_order: bool,
    f: &mut dyn FnMut(StageModel, &[burn_dist::zero::module::PiecedMatrix]) -> Result<()>,
) -> Result<()> {
    let units = match model_order {
        true => units_in_model_order(model)?
            .into_iter()
            .map(|(u, _)| u)
            .collect(),
        false => model.clone().into_units(),
    };
    let (zero, comm, params) = (gathering.zero, gathering.comm, gathering.params);
    for unit in units {
        let unit = StageModel {
            units: vec![unit],
            precision,
        };
        let matrices = params.pieces_in(zero, &unit)?;
        f(params.gather_but_pieces(zero, comm, &unit)?, &matrices)?;
    }
    Ok(())
}

/// Piece `k` (`rows` rows of `cols` values) of matrix `key` cut into pieces of rows, gathered
/// from the ranks' shards. Every rank alike.
pub(super) fn gather_rows(
    g: Shards<'_>,
    key: u64,
    k: usize,
    rows: usize,
    cols: usize,
) -> std::result::Result<burn::tensor::TensorData, String> {
    let values = g
        .params
        .gather_piece(g.zero, g.comm, &burn::module::ParamId::from(key), k)
        .map_err(|e| format!("gathering piece {k} of weight {key}: {e}"))?;
    Ok(burn::tensor::TensorData::new(values, [rows, cols]))
}

/// A forward without a graph's source of a unit's pieces of rows: gathered in the order the
/// unit lists its matrices, on every rank alike whatever its products ask for (a rank without
/// a batch asks for none). A piece asked for out of that order keeps those gathered before it
/// aside until asked for; [`PiecesInOrder::finish`] gathers what was not asked for and lets it
/// go, so that every rank has made the same gathers.
struct PiecesInOrder<'a> {
    shards: Shards<'a>,
    /// (matrix key, piece, rows, columns) still to gather, in order.
    next: std::vec::IntoIter<(u64, usize, usize, usize)>,
    spare: Vec<(u64, usize, burn::tensor::TensorData)>,
}

impl<'a> PiecesInOrder<'a> {
    fn new(shards: Shards<'a>, matrices: &[burn_dist::zero::module::PiecedMatrix]) -> Self {
        let next: Vec<_> = matrices
            .iter()
            .flat_map(|(id, rows, cols)| {
                let key = id.val();
                rows.iter()
                    .enumerate()
                    .map(move |(k, r)| (key, k, r.len(), *cols))
            })
            .collect();
        Self {
            shards,
            next: next.into_iter(),
            spare: Vec::new(),
        }
    }

    /// Gathers (and lets go) the pieces not asked for.
    fn finish(mut self) -> std::result::Result<(), String> {
        self.spare.clear();
        for (key, k, rows, cols) in self.next {
            gather_rows(self.shards, key, k, rows, cols)?;
        }
        Ok(())
    }
}

impl hearth_kernels::keyed::Source for PiecesInOrder<'_> {
    fn fetch(
        &mut self,
        key: u64,
    ) -> std::result::Result<Vec<(u64, burn::tensor::TensorData)>, String> {
        Err(format!(
            "weight {key} fetched whole in a forward without a graph"
        ))
    }

    fn gradient(
        &mut self,
        key: u64,
        _: burn::tensor::TensorData,
    ) -> std::result::Result<Option<burn::tensor::TensorData>, String> {
        Err(format!(
            "weight {key}'s gradient handed over in a forward without a graph"
        ))
    }

    fn fetch_piece(
        &mut self,
        key: u64,
        k: usize,
    ) -> std::result::Result<burn::tensor::TensorData, String> {
        if let Some(i) = self.spare.iter().position(|p| (p.0, p.1) == (key, k)) {
            return Ok(self.spare.swap_remove(i).2);
        }
        for (got_key, got_k, rows, cols) in self.next.by_ref() {
            let got = gather_rows(self.shards, got_key, got_k, rows, cols)?;
            if (got_key, got_k) == (key, k) {
                return Ok(got);
            }
            self.spare.push((got_key, got_k, got));
        }
        Err(format!(
            "piece {k} of weight {key} is not one of this unit's pieces of rows"
        ))
    }
}

/// `model`'s units ordered by where their trainable tensors stand in the model's own order,
/// each with its number of them. A unit's tensors are consecutive there, but the units need
/// not come in the forward's order: a DenseNet holds all its dense layers before its
/// transitions. An error where a unit's tensors are not consecutive in the model or the units
/// do not cover its tensors once each.
fn units_in_model_order(
    model: &hearth_models::Classifier,
) -> Result<Vec<(hearth_models::stages::Unit, usize)>> {
    use burn_dist::flat::module::trainable_ids;
    let index: std::collections::HashMap<burn::module::ParamId, usize> = trainable_ids(model)
        .into_iter()
        .enumerate()
        .map(|(i, id)| (id, i))
        .collect();
    let bad = |reason: String| {
        HearthError::InvalidArgument(format!("ZeRO stage 3's units of this model: {reason}"))
    };
    let mut placed = Vec::new();
    for (k, unit) in model.clone().into_units().into_iter().enumerate() {
        let at: Vec<Option<usize>> = trainable_ids(&unit)
            .iter()
            .map(|id| index.get(id).copied())
            .collect();
        let first = at.first().copied().flatten().unwrap_or(usize::MAX);
        if at.iter().enumerate().any(|(j, i)| *i != Some(first + j)) {
            return Err(bad(format!(
                "unit {k}'s trainable tensors are not consecutive in the model's order"
            )));
        }
        placed.push((first, at.len(), unit));
    }
    // Units without trainable tensors (pooling alone) sort last: they gather nothing.
    placed.sort_by_key(|(first, _, _)| *first);
    let mut next = 0;
    for (first, len, _) in &placed {
        if *len > 0 && *first != next {
            return Err(bad(format!(
                "tensor {next} of {} belongs to no unit, or to two",
                index.len()
            )));
        }
        next += len;
    }
    if next != index.len() {
        return Err(bad(format!(
            "the units hold {next} of the model's {} trainable tensors",
            index.len()
        )));
    }
    Ok(placed.into_iter().map(|(_, len, u)| (u, len)).collect())
}

/// ZeRO stage 3's source of a unit's parameters: the sharded optimizer holding them, the
/// ranks, and the skeleton's layout ([`burn_dist::zero::module::shard_params`]).
pub struct Gathering<'a> {
    pub zero: &'a burn_dist::zero::ZeroOptimizer,
    pub comm: &'a burn_dist::Communicator,
    pub params: &'a burn_dist::zero::module::ShardedParams,
    /// Where `comm` carries the gathers alone (`--overlap`: the reductions go over a sibling
    /// on a thread of their own), the order each unit's backward fetched its buckets in the
    /// last step, so that a thread gathers them ahead in this one ([`FetchOrder`]); `None`
    /// where the step's thread reduces over `comm` between its gathers (a thread's gathers
    /// would interleave with them differently on each rank).
    pub ahead: Option<&'a std::cell::RefCell<FetchOrder>>,
    /// Where a step's backward says which units it kept gathered from their forward
    /// ([`KeptUnits`]), for the run's log; `None`: not said.
    pub kept: Option<&'a std::cell::Cell<Option<KeptUnits>>>,
}

/// The units a stage 3 step keeps gathered from their forward to their backward instead of
/// letting them go and gathering them again: the last unit, and before it the units that fit
/// with it in two buckets (`pipeline/regather.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeptUnits {
    /// How many (the forward's last ones) of how many units.
    pub units: usize,
    pub of: usize,
    /// Their parameter values, all together.
    pub values: usize,
}

impl KeptUnits {
    /// The run's line on them.
    pub fn describe(&self) -> String {
        let bytes = self.values as f64 * 4.0;
        let size = match bytes < 1e6 {
            true => format!("{:.1} KB", bytes / 1e3),
            false => format!("{:.1} MB", bytes / 1e6),
        };
        let others = match self.of - self.units {
            0 => "none is gathered twice".to_string(),
            n => format!(
                "the other {n} are let go after their forward and gathered again for their \
                 backward"
            ),
        };
        format!(
            "`exchange.zero` 3 keeps the last {} of its {} units ({size} of parameters: the last \
             unit and those that fit with it in two buckets of --bucket-mb) gathered from their \
             forward to their backward; {others}",
            self.units, self.of
        )
    }
}

/// What gathers a bucket ([`Gathering`] less the step-to-step order): shared with the threads
/// that gather ahead.
#[derive(Clone, Copy)]
pub(super) struct Shards<'a> {
    pub(super) zero: &'a burn_dist::zero::ZeroOptimizer,
    pub(super) comm: &'a burn_dist::Communicator,
    pub(super) params: &'a burn_dist::zero::module::ShardedParams,
}

impl<'a> Shards<'a> {
    pub(super) fn of(g: &Gathering<'a>) -> Self {
        Self {
            zero: g.zero,
            comm: g.comm,
            params: g.params,
        }
    }
}

/// What the last step's backward fetched, in order (every rank's the same: the ops run in
/// one order), for the thread that gathers them ahead in the next ([`Gathering::ahead`];
/// `pipeline/regather.rs` writes and reads it).
#[derive(Debug, Default)]
pub struct FetchOrder {
    pub(super) keys: Vec<Fetched>,
    /// Since [`FetchOrder::take_counts`]: buckets (and pieces) the backward fetched, and of
    /// them those the thread had gathered ahead.
    pub(super) fetched: u64,
    pub(super) ahead: u64,
}

/// One fetch of a step's backward: the bucket that holds a weight (by key), or a piece of
/// rows of a matrix cut into pieces (key, piece).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fetched {
    Bucket(u64),
    Piece(u64, usize),
}

impl FetchOrder {
    /// (buckets fetched, of them gathered ahead) since the last call, for an epoch's report.
    pub fn take_counts(&mut self) -> (u64, u64) {
        let counts = (self.fetched, self.ahead);
        (self.fetched, self.ahead) = (0, 0);
        counts
    }
}

/// Each of `model`'s units' number of trainable tensors, the units in the order of their
/// tensors in the model (not always the forward's: a DenseNet holds its dense layers before
/// its transitions): where ZeRO stage 3 cuts its buckets
/// ([`burn_dist::zero::ZeroOptimizer::cut_at_units`]).
pub fn unit_tensor_counts(model: &hearth_models::Classifier) -> Result<Vec<usize>> {
    Ok(units_in_model_order(model)?
        .into_iter()
        .map(|(_, len)| len)
        .collect())
}

/// ZeRO stage 3's tensors of `model` that its products may take a piece of rows at a time,
/// cut where larger than a bucket (index, values per row): the linear layers' weights and the
/// convolutions' of one group, whose products (`hearth_kernels::keyed`) take a piece of
/// output channels at a time. ResNet-50's 3x3 weights of its last stage (9.4 MB each) and
/// VGG-16's of 512 channels were gathered whole before, and with `--overlap` a second one
/// ahead beside them: more than a tenth of a rank's share of 4.
pub fn piece_rows(model: &hearth_models::Classifier) -> Vec<(usize, usize)> {
    let grouped = model.grouped_conv_weights();
    let ids = burn_dist::flat::module::trainable_ids(model);
    burn_dist::zero::module::ShardedParams::by_rows(model, &[2, 4])
        .into_iter()
        .filter(|&(t, _)| ids.get(t).is_some_and(|id| !grouped.contains(id)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::KeptUnits;

    /// The run's line names how many units stay gathered, their size in the unit that reads,
    /// and whether any unit is gathered twice.
    #[test]
    fn the_kept_units_line_says_how_many_and_what_is_gathered_twice() {
        let some = KeptUnits {
            units: 3,
            of: 18,
            values: 10_975_000,
        }
        .describe();
        assert!(
            some.contains("keeps the last 3 of its 18 units (43.9 MB")
                && some.contains("the other 15 are let go after their forward"),
            "{some}"
        );
        let all = KeptUnits {
            units: 4,
            of: 4,
            values: 20_000,
        }
        .describe();
        assert!(
            all.contains("(80.0 KB") && all.contains("none is gathered twice"),
            "{all}"
        );
    }
}
