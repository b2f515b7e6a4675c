//! The sharded optimizer on a Burn module: a step taking the module's gradients bucket by
//! bucket ([`sharded_step`]), ZeRO's settings for the data-parallel strategy ([`Sharding`]),
//! where its state goes between launches ([`StateStore`], [`save_sharded_state`]), and stage
//! 3's skeleton and its parts gathered ([`shard_params`], [`ShardedParams`]).

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use burn::module::{Module, ParamId};
use burn::optim::GradientsParams;

use super::{ReducedGradients, Stage, StateLayout, StateReader, ZeroOptimizer};
use crate::collective::Communicator;
use crate::flat::module::{
    Shapes, release_trainable_range, take_trainable_grads_of, trainable_ids, trainable_names,
    trainable_values_in_released, with_trainable_range,
};
use crate::flat::optim::ShardOptimizer;
use crate::{DistError, Result};

/// Where a sharded optimizer's state is kept between launches: rank 0 writes the whole state
/// of each checkpointed epoch and reads it back on resume (the caller's files; burn-dist
/// writes none).
pub trait StateStore: Send + Sync {
    /// Starts writing the whole state after `epoch` (rank 0, before burn-train's checkpoint of
    /// that epoch): its values follow in `layout`'s order through the writer.
    fn writer(
        &self,
        epoch: usize,
        layout: &StateLayout,
    ) -> std::result::Result<Box<dyn StateWriter>, String>;
    /// The state a launch resuming after `epoch` starts from (rank 0), read as it is handed
    /// out.
    fn load(&self, epoch: usize) -> std::result::Result<Box<dyn StateReader>, String>;
}

/// A state being written, a bucket's values at a time.
pub trait StateWriter {
    fn write(&mut self, values: &[f32]) -> std::result::Result<(), String>;
    /// Every value written: makes the state the epoch's.
    fn finish(self: Box<Self>) -> std::result::Result<(), String>;
}

/// Streams `zero`'s state to `store` as epoch `epoch`'s (every rank calls it; rank 0 writes).
pub fn save_sharded_state(
    zero: &ZeroOptimizer,
    comm: &Communicator,
    store: &dyn StateStore,
    epoch: usize,
) -> Result<()> {
    let mut writer = None;
    let mut failed = None;
    if comm.rank() == 0 {
        match store.writer(epoch, &zero.state_layout()) {
            Ok(w) => writer = Some(w),
            Err(e) => failed = Some(e),
        }
    }
    // Every rank takes part even when rank 0 cannot write: no one is left waiting.
    let streamed = zero.stream_state(comm, 0, &mut |piece| match writer.as_mut() {
        Some(w) => w.write(piece),
        None => Ok(()),
    });
    if let Some(e) = failed {
        return Err(DistError::Config(e));
    }
    streamed?;
    match writer {
        Some(w) => w.finish().map_err(DistError::Config),
        None => Ok(()),
    }
}

/// ZeRO for the data-parallel strategy (`ddp::DdpStrategy::with_sharding`): the stage, the optimizer over the whole trainable vector (its
/// decay ranges and tensor extents), and where its state is kept.
#[derive(Clone)]
pub struct Sharding {
    pub stage: Stage,
    pub optimizer: ShardOptimizer,
    pub store: Arc<dyn StateStore>,
    /// The state resumed from may hold some of the tensors, the others starting from zero
    /// ([`ZeroOptimizer::with_new_tensors_at_zero`]: a fine-tuning phase after a frozen one).
    pub new_tensors_at_zero: bool,
}

/// One sharded step on `model`: `grads` (this rank's mean) taken bucket by bucket into the
/// sharded optimizer ([`ZeroOptimizer::step`]), the shard's update at rate `lr`, the updated
/// values back into the module (`None`: skipped, the module unchanged). `take(finite)` decides
/// with the agreed verdict on the averaged gradients (fp16 loss scaling; `|_| true` steps
/// always, as plain data parallel).
pub fn sharded_step<M: Module>(
    zero: &mut ZeroOptimizer,
    model: &M,
    grads: GradientsParams,
    comm: &Communicator,
    lr: f64,
    take: &mut dyn FnMut(bool) -> bool,
) -> Result<Option<M>> {
    let (m, stepped) = sharded_step_owned(zero, model.clone(), grads, comm, lr, take)?;
    Ok(stepped.then_some(m))
}

/// [`sharded_step`] on a module the caller hands over: each bucket's updated tensors replace
/// the module's as soon as the bucket's all-gather ends, so where the caller held no other
/// copy the old values go bucket by bucket and the step never holds the model twice (the
/// saving ZeRO exists for: one copy of the parameters at the end of a step, not two). The
/// module back (unchanged when skipped), and whether it stepped.
pub fn sharded_step_owned<M: Module>(
    zero: &mut ZeroOptimizer,
    model: M,
    grads: GradientsParams,
    comm: &Communicator,
    lr: f64,
    take: &mut dyn FnMut(bool) -> bool,
) -> Result<(M, bool)> {
    step_owned(zero, model, grads, None, comm, lr, take)
}

/// [`sharded_step_owned`] from gradients reduced to this rank's segments already (during the
/// backward pass: [`crate::overlap::OverlappedStep::finish_sharded`]).
pub fn sharded_step_reduced<M: Module>(
    zero: &mut ZeroOptimizer,
    model: M,
    reduced: ReducedGradients,
    comm: &Communicator,
    lr: f64,
    take: &mut dyn FnMut(bool) -> bool,
) -> Result<(M, bool)> {
    step_owned(
        zero,
        model,
        GradientsParams::new(),
        Some(reduced),
        comm,
        lr,
        take,
    )
}

/// The sharded step on an owned module: its gradients reduced from `grads` here, or
/// `reduced` already.
fn step_owned<M: Module>(
    zero: &mut ZeroOptimizer,
    model: M,
    mut grads: GradientsParams,
    reduced: Option<ReducedGradients>,
    comm: &Communicator,
    lr: f64,
    take: &mut dyn FnMut(bool) -> bool,
) -> Result<(M, bool)> {
    // The step reads values from the module (before any bucket is gathered) and puts the
    // gathered ones in place: both through the cell, never at once.
    let cell = RefCell::new(Some(model));
    // The shapes of the tensors released before their all-gather (the module holds empty
    // ones until their values come).
    let released = RefCell::new(Shapes::new());
    let mut source = ModuleSource {
        model: &cell,
        grads: &mut grads,
        released: &released,
    };
    let mut deliver = |tensors: std::ops::Range<usize>, parts| {
        let m = cell.borrow_mut().take().ok_or_else(lost_module)?;
        let m = with_trainable_range(m, tensors.clone(), parts, &released.borrow())?;
        released.borrow_mut().retain(|i, _| !tensors.contains(i));
        *cell.borrow_mut() = Some(m);
        Ok(())
    };
    let lr = lr as f32;
    let stepped = match reduced {
        Some(r) => zero.step_reduced(comm, r, &mut source, lr, take, &mut deliver)?,
        None => zero.step_with(comm, &mut source, lr, take, &mut deliver)?,
    };
    drop(grads);
    let m = cell.into_inner().ok_or_else(lost_module)?;
    Ok((m, stepped))
}

/// ZeRO stage 3 on a Burn module: this rank's segments of `model`'s trainable values taken
/// into `zero` ([`ZeroOptimizer::hold_params`]) and the module's own let go (empty tensors in
/// their place, the same parameter ids). The module back, a skeleton whose parts
/// [`ShardedParams::gather`] fills for their passes, and what the gathering needs. Every rank
/// alike, from the same values.
pub fn shard_params<M: Module>(zero: &mut ZeroOptimizer, model: M) -> Result<(M, ShardedParams)> {
    shard_params_by(zero, model, &mut |z, source| z.hold_params(source))
}

/// [`shard_params`] from `root`'s values ([`ZeroOptimizer::hold_params_from`]): every rank's
/// segments are `root`'s, handed out a bucket at a time (the other ranks' values are not read),
/// so that the ranks start alike without a broadcast of the whole model first; from `values`
/// where given (a checkpoint read a window at a time), the module's let go unread.
pub fn shard_params_from<M: Module>(
    zero: &mut ZeroOptimizer,
    comm: &Communicator,
    root: usize,
    model: M,
    mut values: Option<&mut dyn crate::zero::StepSource>,
) -> Result<(M, ShardedParams)> {
    shard_params_by(zero, model, &mut |z, own| match values.as_deref_mut() {
        Some(v) => z.hold_params_from(comm, root, v),
        None => z.hold_params_from(comm, root, own),
    })
}

/// `model`'s trainable values taken into `zero` by `hold`, the module's own let go.
fn shard_params_by<M: Module>(
    zero: &mut ZeroOptimizer,
    model: M,
    hold: &mut dyn FnMut(&mut ZeroOptimizer, &mut dyn crate::zero::StepSource) -> Result<()>,
) -> Result<(M, ShardedParams)> {
    let ids = trainable_ids(&model);
    let cell = RefCell::new(Some(model));
    let released = RefCell::new(Shapes::new());
    let mut grads = GradientsParams::new();
    hold(
        zero,
        &mut ModuleSource {
            model: &cell,
            grads: &mut grads,
            released: &released,
        },
    )?;
    let model = cell.into_inner().ok_or_else(lost_module)?;
    // What `hold` released already keeps its shape there (the root lets each tensor go once
    // its values are out).
    let mut shapes = released.into_inner();
    let skeleton = release_trainable_range(model, 0..ids.len(), &mut shapes);
    let index = ids.into_iter().enumerate().map(|(i, id)| (id, i)).collect();
    Ok((skeleton, ShardedParams { shapes, index }))
}

/// A trainable tensor cut into pieces of rows ([`ShardedParams::pieces_in`]): its parameter,
/// each piece's rows, and its columns (the values of a row: a matrix's columns, a convolution
/// weight's `[out, in, kh, kw]` as a matrix of `out` rows).
pub type PiecedMatrix = (ParamId, Vec<std::ops::Range<usize>>, usize);

/// What gathering a stage 3 skeleton's parts needs: its trainable tensors' shapes and each
/// one's index in the trainable order, by parameter id.
#[derive(Debug, Clone)]
pub struct ShardedParams {
    shapes: Shapes,
    index: HashMap<ParamId, usize>,
}

/// A part's parameter values gathered apart from the part ([`ShardedParams::gather_values`]):
/// its tensors in the skeleton's order, and each bucket's tensors and values.
#[derive(Debug)]
pub struct GatheredValues {
    tensors: std::ops::Range<usize>,
    buckets: Vec<(std::ops::Range<usize>, Vec<Vec<f32>>)>,
}

impl ShardedParams {
    /// The shape of the skeleton's trainable tensor `id` (held empty, its values in the
    /// shards); `None` for a tensor the skeleton holds whole (a buffer, a frozen parameter).
    pub fn shape_of(&self, id: &ParamId) -> Option<&burn::tensor::Shape> {
        self.index.get(id).and_then(|i| self.shapes.get(i))
    }

    /// `part` of the skeleton (the whole, or a unit: its trainable tensors consecutive in the
    /// skeleton's order) with its values gathered from every rank's segments, the buckets cut
    /// at the parts ([`ZeroOptimizer::cut_at_units`]). The skeleton stays empty: the values
    /// live as long as the returned module (and a graph that uses it). Every rank alike, in the
    /// same order of parts.
    pub fn gather<U: Module>(
        &self,
        zero: &ZeroOptimizer,
        comm: &Communicator,
        part: &U,
    ) -> Result<U> {
        let first = self.first_of(part)?;
        gather_unit(zero, comm, part, first, &self.shapes, true)
    }

    /// [`Self::gather`] but for the tensors cut into pieces of rows
    /// ([`ZeroOptimizer::cut_rows`]), which stay empty: a product takes them a piece at a
    /// time ([`Self::pieces_in`], [`Self::gather_piece`]).
    pub fn gather_but_pieces<U: Module>(
        &self,
        zero: &ZeroOptimizer,
        comm: &Communicator,
        part: &U,
    ) -> Result<U> {
        let first = self.first_of(part)?;
        gather_unit(zero, comm, part, first, &self.shapes, false)
    }

    /// `part`'s trainable tensors cut into pieces of rows ([`ZeroOptimizer::cut_rows`]), by
    /// parameter id: each piece's rows, and the values of a row (a tensor of more than two
    /// dimensions is a matrix of its first dimension's rows).
    pub fn pieces_in<U: Module>(
        &self,
        zero: &ZeroOptimizer,
        part: &U,
    ) -> Result<Vec<PiecedMatrix>> {
        let first = self.first_of(part)?;
        let ids = trainable_ids(part);
        let mut out = Vec::new();
        for (k, id) in ids.into_iter().enumerate() {
            let Some(pieces) = zero.pieces_of(first + k) else {
                continue;
            };
            let cols = match self.shapes.get(&(first + k)).map(|s| s.to_vec()) {
                Some(dims) if dims.len() >= 2 && dims[1..].iter().all(|&d| d > 0) => {
                    dims[1..].iter().product::<usize>()
                }
                dims => {
                    return Err(DistError::Config(format!(
                        "trainable tensor {} is cut into pieces of rows but has no rows of \
                         values (shape {dims:?})",
                        first + k
                    )));
                }
            };
            let rows = pieces
                .iter()
                .map(|p| p.start / cols..p.end / cols)
                .collect();
            out.push((id, rows, cols));
        }
        Ok(out)
    }

    /// Piece `k` of trainable matrix `id` cut into pieces of rows, gathered whole from every
    /// rank's segments ([`ZeroOptimizer::gather_piece`]). Every rank alike.
    pub fn gather_piece(
        &self,
        zero: &ZeroOptimizer,
        comm: &Communicator,
        id: &ParamId,
        k: usize,
    ) -> Result<Vec<f32>> {
        let Some(&t) = self.index.get(id) else {
            return Err(DistError::Config(format!(
                "parameter {id} is not one of the sharded model's trainable tensors"
            )));
        };
        zero.gather_piece(comm, t, k)
    }

    /// The trainable matrices of `model` (index, values per row), for
    /// [`ZeroOptimizer::cut_rows`]: the linear layers' weights, which a product may take a
    /// piece of rows at a time.
    pub fn matrices<M: Module>(model: &M) -> Vec<(usize, usize)> {
        Self::by_rows(model, &[2])
    }

    /// `model`'s trainable tensors of `ranks` dimensions (index, values per row: the product
    /// of all dimensions but the first), for [`ZeroOptimizer::cut_rows`]: `&[2, 4]` for the
    /// linear layers' and the convolutions' weights, where the caller's products take either
    /// a piece of rows (of output channels) at a time.
    pub fn by_rows<M: Module>(model: &M, ranks: &[usize]) -> Vec<(usize, usize)> {
        crate::flat::module::trainable_shapes(model)
            .into_iter()
            .enumerate()
            .filter(|(_, dims)| dims.len() >= 2 && ranks.contains(&dims.len()))
            .filter_map(|(i, dims)| {
                let cols: usize = dims[1..].iter().product();
                (cols > 0).then_some((i, cols))
            })
            .collect()
    }

    /// Where `part`'s trainable tensors stand in the skeleton's order (consecutive): what
    /// [`Self::gather_values`] takes, so that a thread may gather a part's values without the
    /// part itself.
    pub fn tensors_of<U: Module>(&self, part: &U) -> Result<std::ops::Range<usize>> {
        let first = self.first_of(part)?;
        Ok(first..first + trainable_names(part).len())
    }

    /// How many values the skeleton's trainable tensors `tensors` ([`Self::tensors_of`]) hold
    /// whole, gathered (their shards' sum over the ranks).
    pub fn len_of(&self, tensors: std::ops::Range<usize>) -> usize {
        self.shapes
            .range(tensors)
            .map(|(_, s)| s.num_elements())
            .sum()
    }

    /// The values of the skeleton's trainable tensors `tensors` ([`Self::tensors_of`]),
    /// gathered whole bucket by bucket apart from any module (a thread may gather the next
    /// part's while the current one computes); [`Self::with_values`] puts them into the part.
    /// Every rank alike, for the same tensors.
    pub fn gather_values(
        &self,
        zero: &ZeroOptimizer,
        comm: &Communicator,
        tensors: std::ops::Range<usize>,
    ) -> Result<GatheredValues> {
        gather_values_in(zero, comm, tensors, true)
    }

    /// [`Self::gather_values`] but for the tensors cut into pieces of rows, which
    /// [`Self::with_values`] leaves empty (a product takes them a piece at a time:
    /// [`Self::gather_piece`]).
    pub fn gather_values_but_pieces(
        &self,
        zero: &ZeroOptimizer,
        comm: &Communicator,
        tensors: std::ops::Range<usize>,
    ) -> Result<GatheredValues> {
        gather_values_in(zero, comm, tensors, false)
    }

    /// `part` with `values` in place of its empty trainable tensors: the values gathered for
    /// exactly its tensors by [`Self::gather_values`].
    pub fn with_values<U: Module>(&self, part: &U, values: GatheredValues) -> Result<U> {
        let want = self.tensors_of(part)?;
        if values.tensors != want {
            return Err(DistError::Mismatch {
                op: "stage 3 gather".into(),
                reason: format!(
                    "values gathered for tensors {:?} handed to a part of tensors {want:?}",
                    values.tensors
                ),
            });
        }
        let local = local_shapes(&self.shapes, want.clone());
        let mut m = part.clone();
        for (tensors, parts) in values.buckets {
            let at = tensors.start - want.start..tensors.end - want.start;
            m = with_trainable_range(m, at, parts, &local)?;
        }
        Ok(m)
    }

    /// The values of the bucket that holds the skeleton's trainable tensor `id`, gathered
    /// whole ([`ZeroOptimizer::gather_params_bucket`]): each of its tensors' parameter id, shape and
    /// values. Every rank alike, for the same tensor.
    pub fn gather_bucket_of(
        &self,
        zero: &ZeroOptimizer,
        comm: &Communicator,
        id: &ParamId,
    ) -> Result<Vec<(ParamId, burn::tensor::Shape, Vec<f32>)>> {
        let Some(&t) = self.index.get(id) else {
            return Err(DistError::Config(format!(
                "parameter {id} is not one of the sharded model's trainable tensors"
            )));
        };
        let (tensors, values) = zero.gather_params_bucket(comm, t)?;
        let mut ids: Vec<Option<ParamId>> = vec![None; tensors.len()];
        for (id, &i) in &self.index {
            if tensors.contains(&i) {
                ids[i - tensors.start] = Some(*id);
            }
        }
        tensors
            .zip(ids)
            .zip(values)
            .map(|((i, id), v)| match (id, self.shapes.get(&i)) {
                (Some(id), Some(shape)) if shape.num_elements() == v.len() => {
                    Ok((id, shape.clone(), v))
                }
                _ => Err(DistError::Mismatch {
                    op: "stage 3 gather".into(),
                    reason: format!(
                        "trainable tensor {i} has no parameter or shape of {} values",
                        v.len()
                    ),
                }),
            })
            .collect()
    }

    /// Where `part`'s trainable tensors start in the skeleton's order: an error where they are
    /// not the skeleton's, or not consecutive there.
    fn first_of<U: Module>(&self, part: &U) -> Result<usize> {
        let at: Vec<Option<usize>> = trainable_ids(part)
            .iter()
            .map(|id| self.index.get(id).copied())
            .collect();
        let first = at.first().copied().flatten().unwrap_or(0);
        for (k, i) in at.iter().enumerate() {
            match i {
                Some(i) if *i == first + k => {}
                Some(i) => {
                    return Err(DistError::Config(format!(
                        "a part's trainable tensor {k} is the model's {i}, not {}: a stage 3 \
                         part's tensors must be consecutive in the model's order",
                        first + k
                    )));
                }
                None => {
                    return Err(DistError::Config(format!(
                        "a part's trainable tensor {k} is not one of the sharded model's"
                    )));
                }
            }
        }
        Ok(first)
    }
}

/// `unit` with its trainable tensors (the skeleton's `first..`) gathered whole, those cut into
/// pieces of rows too where `pieces` (else they stay empty).
fn gather_unit<M: Module>(
    zero: &ZeroOptimizer,
    comm: &Communicator,
    unit: &M,
    first: usize,
    shapes: &Shapes,
    pieces: bool,
) -> Result<M> {
    let n = trainable_names(unit).len();
    let local = local_shapes(shapes, first..first + n);
    let mut m = Some(unit.clone());
    let mut deliver = |tensors: std::ops::Range<usize>, parts| {
        let u = m.take().ok_or_else(lost_module)?;
        let at = tensors.start - first..tensors.end - first;
        m = Some(with_trainable_range(u, at, parts, &local)?);
        Ok(())
    };
    match pieces {
        true => zero.gather_params(comm, first..first + n, &mut deliver)?,
        false => zero.gather_params_but_pieces(comm, first..first + n, &mut deliver)?,
    }
    m.ok_or_else(lost_module)
}

/// The values of tensors `tensors` gathered bucket by bucket, with or without those cut into
/// pieces of rows.
fn gather_values_in(
    zero: &ZeroOptimizer,
    comm: &Communicator,
    tensors: std::ops::Range<usize>,
    pieces: bool,
) -> Result<GatheredValues> {
    let mut buckets = Vec::new();
    let mut deliver = |range, parts| {
        buckets.push((range, parts));
        Ok(())
    };
    match pieces {
        true => zero.gather_params(comm, tensors.clone(), &mut deliver)?,
        false => zero.gather_params_but_pieces(comm, tensors.clone(), &mut deliver)?,
    }
    Ok(GatheredValues { tensors, buckets })
}

/// The shapes of the skeleton's tensors `tensors`, indexed from the range's start (a part's
/// own numbering).
fn local_shapes(shapes: &Shapes, tensors: std::ops::Range<usize>) -> Shapes {
    let first = tensors.start;
    shapes
        .range(tensors)
        .map(|(i, s)| (i - first, s.clone()))
        .collect()
}

/// A module lost by an earlier failed replacement (its error came first).
fn lost_module() -> DistError {
    DistError::Mismatch {
        op: "sharded optimizer values".into(),
        reason: "the module was lost in an earlier failed update".into(),
    }
}

/// A module and its gradients as a [`crate::zero::StepSource`]: each bucket's gradients taken
/// out as they are flattened, the values of a range read from the tensors that meet it.
struct ModuleSource<'a, M: Module> {
    model: &'a RefCell<Option<M>>,
    grads: &'a mut GradientsParams,
    released: &'a RefCell<Shapes>,
}

impl<M: Module> crate::zero::StepSource for ModuleSource<'_, M> {
    fn grads(&mut self, tensors: std::ops::Range<usize>) -> Vec<f32> {
        match self.model.borrow().as_ref() {
            Some(m) => take_trainable_grads_of(m, self.grads, tensors),
            None => Vec::new(),
        }
    }
    fn values(&mut self, range: std::ops::Range<usize>) -> Vec<f32> {
        // Tensors released before keep their place (ZeRO stage 3's root lets each go once its
        // segments are out).
        match self.model.borrow().as_ref() {
            Some(m) => trainable_values_in_released(m, range, &self.released.borrow()),
            None => Vec::new(),
        }
    }
    fn release(&mut self, tensors: std::ops::Range<usize>) {
        let m = self.model.borrow_mut().take();
        *self.model.borrow_mut() =
            m.map(|m| release_trainable_range(m, tensors, &mut self.released.borrow_mut()));
    }
    fn value_count(&mut self) -> Option<usize> {
        // Counted from the shapes, a lazy parameter's read without drawing it.
        let (m, released) = (self.model.borrow(), self.released.borrow());
        let names = m
            .as_ref()
            .map_or(Vec::new(), crate::flat::module::trainable_names);
        let size = |(i, (_, len)): (usize, &(String, usize))| {
            released.get(&i).map_or(*len, |s| s.num_elements())
        };
        Some(names.iter().enumerate().map(size).sum())
    }
}
