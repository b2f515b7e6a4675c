//! ZeRO stage 3 without recomputation: each unit's gathered parameters let go after its
//! forward and gathered again for its backward, each weight let go again as soon as its
//! backward is done ([`burn_dist::pipeline::Regather`] over
//! [`hearth_kernels::keyed`]). The convolutions' and linear layers' graphs keep their weights'
//! parameter ids instead of the weights; what other ops keep (batch norm's scale and shift,
//! the biases' shapes) stays with the unit between its passes.
//!
//! The last unit keeps its parameters for its backward, which follows its forward at once, and
//! so do the units before it that fit with it in two buckets ([`kept_from`]): their backward
//! comes soon after their forward, two buckets are what a backward holds gathered at a time
//! anyway (one in use, one gathered ahead), and each kept unit is a gather less a step
//! (ResNet-50 with 25 MiB buckets: its fully connected head and its last two blocks, 44 of
//! its 102 MB; between two hosts at 1 Gbit/s the step's backward waits on those gathers
//! while it has little to compute).
//!
//! The backward gathers a bucket at a time: the bucket of a weight when its first op's
//! backward needs it (`Fetch`), and each weight's gradient goes to the step's exchange as soon
//! as its ops are done, where its bucket is reduce-scattered once whole
//! ([`burn_dist::overlap::hand_over_one`]). With buckets of one weight each (`--bucket-mb`
//! below the smallest weight worth it), a unit's backward holds a weight or two and their
//! gradients instead of the unit's; with 25 MiB buckets, a unit's buckets are its whole.
//!
//! With `--overlap` the gathers have a communicator of their own, which threads of the step
//! use in turn: one gathers the forward's units ahead ([`super::forward_ahead`]), and from
//! the first unit's backward one gathers the backward's buckets one ahead of its ops, in the
//! order the last step fetched them ([`FetchOrder`](super::gathered::FetchOrder): every step
//! fetches in one order), so that a gather runs while the compute before it does instead of
//! between them. A matrix cut into pieces of rows (larger than a bucket) is taken a piece at a
//! time by both passes, and those threads gather its pieces in turn, like buckets: after its
//! unit's other parameters in the forward, in the last step's order in the backward
//! (`ahead.rs`).

mod ahead;

use std::collections::HashMap;
use std::sync::mpsc::sync_channel;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::prelude::Tensor;
use burn::tensor::TensorData;
use burn_dist::pipeline::{Activation, Regather};
use hearth_kernels::keyed::{Pieced, Pieces};

use self::ahead::{Ahead, gather_ahead, gather_bucket, gather_piece};
use super::forward_ahead::SharedForward;
use super::gathered::{Fetched, Gathering, Shards};
use super::stage::StageModel;

/// The keys each unit's graph kept, from its forward to its backward, the gradients of the
/// keyed weights from a backward to their hand-over, and the shards the backward fetches the
/// keyed weights from: with `--overlap`, through a thread that gathers them ahead.
pub(super) struct Regathered<'a, 's, 'e> {
    keys: HashMap<usize, hearth_kernels::keyed::Uses>,
    /// Each unit's matrices cut into pieces of rows, by key: taken a piece at a time by its
    /// forward and its backward, never gathered whole.
    pieced: HashMap<usize, Pieced>,
    grads: HashMap<u64, TensorData>,
    shards: &'a Gathering<'a>,
    /// Where the gather-ahead thread runs (the step's backward; `None`: no thread).
    scope: Option<&'s std::thread::Scope<'s, 'e>>,
    /// The thread's buckets and pieces, once the first unit's backward has started it.
    ahead: Option<Ahead>,
    /// The forward's thread (`--overlap`), shared with the step's gathers of units: the
    /// forward takes the pieces of rows from it too, and the first unit's backward waits for
    /// it to end before its own thread starts on the same communicator.
    forward: Option<SharedForward<'a>>,
    /// What was fetched this step, in order (the next step's
    /// [`FetchOrder`](super::gathered::FetchOrder)), and how much of it the thread had
    /// gathered.
    fetched: Vec<Fetched>,
    from_ahead: u64,
    /// The first unit that keeps its parameters from its forward to its backward.
    keep_from: usize,
}

impl<'a: 's, 's, 'e> Regathered<'a, 's, 'e> {
    /// Over `shards`, for a step through `segments` (the units, skeletons); with `scope` (the
    /// step's backward runs inside it) and [`Gathering::ahead`], the backward's buckets are
    /// gathered by a thread of `scope`, one ahead of the ops, in the last step's order; with
    /// `forward`, the forward's thread, the forward's pieces of rows come from it.
    pub(super) fn new(
        shards: &'a Gathering<'a>,
        scope: Option<&'s std::thread::Scope<'s, 'e>>,
        segments: &[StageModel],
        forward: Option<SharedForward<'a>>,
    ) -> burn_dist::Result<Self> {
        let (keep_from, kept) = kept_from(shards, segments)?;
        if let Some(cell) = shards.kept {
            cell.set(Some(kept));
        }
        Ok(Self {
            keys: HashMap::new(),
            pieced: HashMap::new(),
            grads: HashMap::new(),
            shards,
            scope: scope.filter(|_| shards.ahead.is_some()),
            ahead: None,
            forward,
            fetched: Vec::new(),
            from_ahead: 0,
            keep_from,
        })
    }

    /// The gather-ahead thread, at the first unit's backward (the forward's gathers share its
    /// communicator, so it cannot start before): it hands over each bucket only as the
    /// backward takes it (a rendezvous channel), so it holds one bucket gathered ahead at most,
    /// and stops when this drops its end, before the scope joins it. Every rank's backward takes
    /// the same buckets, so every rank's thread gathers the same ones.
    ///
    /// A thread that cannot start is an error, not a fallback: this rank would then gather in
    /// the backward's order while the other ranks' threads gather in the last step's.
    fn start_ahead(&mut self) -> burn_dist::Result<()> {
        if let Some(forward) = self.forward.take() {
            // Its gathers done (every rank's thread gathers the same), whatever the forward
            // did not take dropped.
            let left = forward.borrow_mut().take();
            if let Some(f) = left {
                f.finish();
            }
        }
        let Some(scope) = self.scope.take() else {
            return Ok(());
        };
        let order = self
            .shards
            .ahead
            .map(|o| std::mem::take(&mut o.borrow_mut().keys))
            .unwrap_or_default();
        if order.is_empty() {
            return Ok(());
        }
        let shards = Shards::of(self.shards);
        let pieced: Pieced = self
            .pieced
            .values()
            .flat_map(|p| p.iter().map(|(k, v)| (*k, v.clone())))
            .collect();
        let (tx, rx) = sync_channel(0);
        std::thread::Builder::new()
            .name("hearth-zero3-gather-ahead".into())
            .spawn_scoped(scope, move || gather_ahead(shards, pieced, order, tx))
            .map_err(|e| {
                burn_dist::DistError::Config(format!(
                    "starting stage 3's backward gather thread: {e}"
                ))
            })?;
        self.ahead = Some(Ahead::new(rx));
        Ok(())
    }
}

impl Drop for Regathered<'_, '_, '_> {
    /// The step's order and counts for the next step (the thread, if any, stops as its
    /// channel goes with `self`).
    fn drop(&mut self) {
        if let Some(order) = self.shards.ahead {
            let mut order = order.borrow_mut();
            order.fetched += self.fetched.len() as u64;
            order.ahead += self.from_ahead;
            order.keys = std::mem::take(&mut self.fetched);
        }
    }
}

impl<'a: 's, 's, 'e> Regather<StageModel> for Regathered<'a, 's, 'e> {
    fn forward(
        &mut self,
        k: usize,
        gathered: StageModel,
        release: bool,
        forward: &mut dyn FnMut(&StageModel) -> burn_dist::Result<Activation>,
    ) -> burn_dist::Result<(Activation, StageModel)> {
        let pieced = pieced_in(Shards::of(self.shards), &gathered)?;
        let (y, keys) = match pieced.is_empty() {
            true => hearth_kernels::keyed::forward(|| forward(&gathered)),
            false => {
                let mut fetch = PieceSource {
                    shards: Shards::of(self.shards),
                    pieced: &pieced,
                    forward: self.forward.as_ref(),
                };
                let (y, keys, fetched) =
                    hearth_kernels::keyed::forward_from(pieced.clone(), &mut fetch, || {
                        forward(&gathered)
                    });
                fetched.map_err(|e| {
                    burn_dist::DistError::Config(format!("unit {k}'s forward by pieces: {e}"))
                })?;
                (y, keys)
            }
        };
        let y = y?;
        self.pieced.insert(k, pieced);
        let kept = match release {
            true => gathered.map(&mut Release { keys: &keys }),
            false => gathered,
        };
        self.keys.insert(k, keys);
        Ok((y, kept))
    }

    fn backward(
        &mut self,
        k: usize,
        values: Option<StageModel>,
        backward: &mut dyn FnMut() -> burn_dist::Result<burn::tensor::Gradients>,
    ) -> burn_dist::Result<(burn::tensor::Gradients, Option<StageModel>)> {
        crate::alloc::phase::mark(crate::alloc::phase::Phase::Backward(k));
        self.start_ahead()?;
        let keys = self.keys.remove(&k).unwrap_or_default();
        let mut take = Take {
            keys: &keys,
            values: HashMap::with_capacity(keys.len()),
        };
        // The keyed values handed in (the last unit's own) move out of the module into the
        // backward's; the others are fetched bucket by bucket as the ops need them.
        let rest = values.map(|v| v.map(&mut take));
        let pieced = self.pieced.remove(&k).unwrap_or_default();
        let mut fetch = Fetch {
            shards: Shards::of(self.shards),
            keys: &keys,
            pieced: &pieced,
            ahead: self.ahead.as_mut(),
            fetched: &mut self.fetched,
            from_ahead: &mut self.from_ahead,
        };
        let (g, grads) =
            hearth_kernels::keyed::backward_from(take.values, &keys, &mut fetch, backward);
        let grads = grads.map_err(|e| {
            burn_dist::DistError::Config(format!("unit {k}'s backward by key: {e}"))
        })?;
        self.grads.extend(grads);
        Ok((g?, rest))
    }

    fn fetches(&self) -> bool {
        true
    }

    fn keeps(&self, k: usize, _: usize) -> bool {
        k >= self.keep_from
    }

    fn add_keyed(
        &mut self,
        k: usize,
        segment: &StageModel,
        grads: &mut GradientsParams,
    ) -> burn_dist::Result<()> {
        let mut add = Add {
            grads: &mut self.grads,
            into: grads,
            error: None,
        };
        segment.visit(&mut add);
        if let Some(e) = add.error {
            return Err(burn_dist::DistError::Config(format!("unit {k}: {e}")));
        }
        match self.grads.keys().next() {
            Some(id) => Err(burn_dist::DistError::Config(format!(
                "unit {k}: a gradient for parameter {id}, which is not the unit's"
            ))),
            None => Ok(()),
        }
    }
}

/// The first of `segments` (a step's units, in the forward's order) that keeps its gathered
/// parameters from its forward to its backward, and what they hold: the last unit, whatever
/// its size, and before it each unit that fits with the units after it in two of the step's
/// buckets (f32 values: what a gather delivers), as much as the backward holds gathered at
/// a time with its thread one bucket ahead. Every rank computes the same from the same
/// layout, so every rank gathers the same units again. Small buckets keep few: with
/// `--bucket-mb 1` ResNet-50 and VGG-16 keep their last unit alone, so the memory between the
/// passes stays as low as the buckets make it.
fn kept_from(
    shards: &Gathering<'_>,
    segments: &[StageModel],
) -> burn_dist::Result<(usize, super::gathered::KeptUnits)> {
    let budget = 2 * shards.zero.bucket_bytes();
    let mut values = 0;
    let mut from = segments.len();
    for (k, s) in segments.iter().enumerate().rev() {
        // The matrices cut into pieces are never held whole: not counted.
        let pieces: usize = pieced_in(Shards::of(shards), s)?
            .values()
            .map(|p| p.total_rows() * p.cols)
            .sum();
        let v = shards.params.len_of(shards.params.tensors_of(s)?) - pieces;
        let last = k + 1 == segments.len();
        if !last && (values + v) * std::mem::size_of::<f32>() > budget {
            break;
        }
        values += v;
        from = k;
    }
    let kept = super::gathered::KeptUnits {
        units: segments.len() - from,
        of: segments.len(),
        values,
    };
    Ok((from, kept))
}

/// `unit`'s matrices cut into pieces of rows, by key.
fn pieced_in(g: Shards<'_>, unit: &StageModel) -> burn_dist::Result<Pieced> {
    Ok(g.params
        .pieces_in(g.zero, unit)?
        .into_iter()
        .map(|(id, rows, cols)| (id.val(), Pieces { rows, cols }))
        .collect())
}

/// A unit's forward's source: the pieces of its matrices cut into pieces of rows, gathered
/// as its products need them (every rank's forward runs its ops in one order), or taken from
/// the forward's thread, which gathers them after the unit's other parameters.
struct PieceSource<'a, 'f> {
    shards: Shards<'a>,
    pieced: &'a Pieced,
    forward: Option<&'a SharedForward<'f>>,
}

impl hearth_kernels::keyed::Source for PieceSource<'_, '_> {
    fn fetch(&mut self, key: u64) -> Result<Vec<(u64, TensorData)>, String> {
        Err(format!("weight {key} fetched whole in a forward"))
    }

    fn gradient(&mut self, key: u64, _: TensorData) -> Result<Option<TensorData>, String> {
        Err(format!("weight {key}'s gradient handed over in a forward"))
    }

    fn fetch_piece(&mut self, key: u64, piece: usize) -> Result<TensorData, String> {
        match self
            .forward
            .and_then(|f| f.borrow_mut().as_mut().map(|f| f.piece(key, piece)))
        {
            Some(got) => got,
            None => gather_piece(self.shards, self.pieced, key, piece),
        }
    }
}

/// A unit's keyed weights from the ranks' shards, a bucket at a time as the backward's ops
/// first need them (every rank's backward runs its ops in one order, so every rank gathers the
/// same buckets in the same order), and their gradients handed to the step's exchange as soon
/// as each is whole.
struct Fetch<'a, 'b> {
    shards: Shards<'a>,
    keys: &'b hearth_kernels::keyed::Uses,
    /// The unit's matrices cut into pieces of rows: each piece fetched as its product needs
    /// it, its gradient handed over alone.
    pieced: &'b Pieced,
    /// The buckets and pieces gathered ahead by a thread (`--overlap`, from the second step).
    ahead: Option<&'b mut Ahead>,
    /// What was fetched, in order: the next step's [`FetchOrder`](super::gathered::FetchOrder).
    fetched: &'b mut Vec<Fetched>,
    /// How many of them the thread had gathered.
    from_ahead: &'b mut u64,
}

impl hearth_kernels::keyed::Source for Fetch<'_, '_> {
    fn fetch(&mut self, key: u64) -> Result<Vec<(u64, TensorData)>, String> {
        self.fetched.push(Fetched::Bucket(key));
        let bucket = match self.ahead.as_mut().and_then(|a| a.bucket(key)) {
            Some(bucket) => {
                *self.from_ahead += 1;
                bucket
            }
            // Not gathered ahead (the first step, or an order the last step did not have):
            // the thread, if any, has ended, so the gather keeps one order of collectives.
            None => gather_bucket(self.shards, key),
        }?;
        // The bucket's other tensors that the graph did not key (batch norm's, the biases)
        // are the unit's own between its passes: dropped here.
        Ok(bucket
            .into_iter()
            .filter(|(k, _)| self.keys.contains_key(k))
            .collect())
    }

    fn gradient(&mut self, key: u64, grad: TensorData) -> Result<Option<TensorData>, String> {
        let dims = grad.shape().to_vec();
        let values = grad
            .try_into_vec::<f32>()
            .map_err(|e| format!("weight {key}'s gradient is not f32: {e:?}"))?;
        Ok(
            burn_dist::overlap::hand_over_one(ParamId::from(key), dims.clone(), values)
                .map(|v| TensorData::new(v, dims)),
        )
    }

    fn fetch_piece(&mut self, key: u64, piece: usize) -> Result<TensorData, String> {
        self.fetched.push(Fetched::Piece(key, piece));
        match self.ahead.as_mut().and_then(|a| a.piece(key, piece)) {
            Some(got) => {
                *self.from_ahead += 1;
                got
            }
            // As for a bucket: the thread, if any, has ended.
            None => gather_piece(self.shards, self.pieced, key, piece),
        }
    }

    fn piece_gradient(&mut self, key: u64, piece: usize, grad: TensorData) -> Result<(), String> {
        let p = self
            .pieced
            .get(&key)
            .ok_or_else(|| format!("weight {key} is not cut into pieces in this unit"))?;
        let rows = p
            .rows
            .get(piece)
            .ok_or_else(|| format!("piece {piece} of weight {key}, of {}", p.rows.len()))?;
        let values = grad
            .try_into_vec::<f32>()
            .map_err(|e| format!("weight {key}'s gradient is not f32: {e:?}"))?;
        let dims = vec![p.total_rows(), p.cols];
        let at = rows.start * p.cols;
        match burn_dist::overlap::hand_over_piece(ParamId::from(key), dims, at, values) {
            None => Ok(()),
            Some(_) => Err(format!(
                "piece {piece} of weight {key}'s gradient has no ZeRO step to take it"
            )),
        }
    }
}

/// Empties the parameters the graph keeps by key (their values go with the module).
struct Release<'a> {
    keys: &'a hearth_kernels::keyed::Uses,
}

impl ModuleMapper for Release<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if !self.keys.contains_key(&param.id.val()) {
            return param;
        }
        param.map(|t| {
            let device = t.device();
            drop(t);
            Tensor::<D>::empty([0; D], &device).set_require_grad(true)
        })
    }
}

/// Moves the keyed parameters' values out of a unit (gathered again, or the last unit's own).
struct Take<'a> {
    keys: &'a hearth_kernels::keyed::Uses,
    values: HashMap<u64, TensorData>,
}

impl ModuleMapper for Take<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let id = param.id.val();
        if !self.keys.contains_key(&id) {
            return param;
        }
        let values = &mut self.values;
        param.map(|t| {
            let device = t.device();
            values.insert(id, t.into_data());
            Tensor::<D>::empty([0; D], &device)
        })
    }
}

/// Registers the keyed gradients under their parameters' ids, each as a tensor of its rank.
struct Add<'a> {
    grads: &'a mut HashMap<u64, TensorData>,
    into: &'a mut GradientsParams,
    error: Option<String>,
}

impl ModuleVisitor for Add<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let Some(data) = self.grads.remove(&param.id.val()) else {
            return;
        };
        if data.shape().len() != D {
            self.error.get_or_insert(format!(
                "parameter {}'s gradient has shape {:?}, not rank {D}",
                param.id,
                data.shape()
            ));
            return;
        }
        let device = param.val().device().without_autodiff();
        self.into
            .register(param.id, Tensor::<D>::from_data(data, &device));
    }
}
