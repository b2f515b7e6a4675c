//! The overlapped step into ZeRO's buckets: the hand-over of [`super::hand_over`] feeding
//! [`ShardedExchange`], each parameter found by its index in the trainable order.

use std::collections::HashSet;

use super::*;
use crate::flat::module::{take_trainable_grads_each, trainable_ids};
use crate::zero::{ReducedGradients, ZeroOptimizer};

impl OverlappedStep {
    /// Installs a ZeRO step's exchange on this thread: the handed-over gradients of `model`'s
    /// trainable tensors reduced to this rank's segments in `zero`'s buckets as each bucket
    /// completes (stage 2: reduce-scattered, the whole gradient dropped at once), each value
    /// first multiplied by `weight`. End it with [`Self::finish_sharded`].
    ///
    /// Where `zero` holds the parameters (stage 3) the buckets are reduced on this thread as
    /// each hand-over completes them ([`ShardedExchange::inline`]), not on a thread of their
    /// own: the step's gathers of parameters run on this thread over the same communicator,
    /// and every rank must call the two kinds of collective in one order.
    pub fn begin_sharded<M: Module>(
        comm: Arc<Communicator>,
        zero: &ZeroOptimizer,
        model: &M,
        weight: f32,
    ) -> Result<Self> {
        let inline = zero.holds_params();
        Self::begin_sharded_with(comm, zero, model, weight, inline)
    }

    /// ZeRO stage 3 overlapped: as [`Self::begin_sharded`], but the buckets are reduced on a
    /// thread of their own over `reduce` while the backward goes on, the step's thread
    /// gathering parameters over `gathers`. The two must be communicators of different kinds
    /// on one transport ([`Communicator::sibling`]), so that neither sees the other's messages
    /// and each keeps one order of collectives on every rank; the same kind is refused.
    ///
    /// Give the reductions the step's own communicator and the gathers the sibling
    /// ([`Kind::Gather`](crate::wire::Kind::Gather)): an all-gather is exact on any path, but a
    /// reduction rounds to the wire format (`--compression`) where its path does (only
    /// [`Kind::Collective`](crate::wire::Kind::Collective) uses one host's shared segment,
    /// whose slots serve one collective at a time; other kinds keep to the ring), so the
    /// reductions keep the arithmetic of the step without overlap.
    pub fn begin_sharded_beside<M: Module>(
        reduce: Arc<Communicator>,
        gathers: &Communicator,
        zero: &ZeroOptimizer,
        model: &M,
        weight: f32,
    ) -> Result<Self> {
        if reduce.kind() == gathers.kind() {
            return Err(DistError::Config(format!(
                "an overlapped ZeRO stage 3 step reduces beside its gathers: both communicators are \
                 of kind {:?}, so their collectives would share one sequence of tags",
                reduce.kind()
            )));
        }
        Self::begin_sharded_with(reduce, zero, model, weight, false)
    }

    fn begin_sharded_with<M: Module>(
        comm: Arc<Communicator>,
        zero: &ZeroOptimizer,
        model: &M,
        weight: f32,
        inline: bool,
    ) -> Result<Self> {
        refuse_nesting()?;
        let reducer = zero.reducer();
        let ids = trainable_ids(model);
        if ids.len() != reducer.tensor_count() {
            return Err(DistError::Mismatch {
                op: "overlapped ZeRO exchange".into(),
                reason: format!(
                    "the model has {} trainable tensors, the sharded optimizer {}",
                    ids.len(),
                    reducer.tensor_count()
                ),
            });
        }
        let index = ids.into_iter().enumerate().map(|(i, id)| (id, i)).collect();
        let exchange = if inline {
            ShardedExchange::inline(comm.clone(), reducer)
        } else {
            ShardedExchange::start(comm.clone(), reducer)?
        };
        install(Sink::Sharded { exchange, index }, weight);
        Ok(Self {
            comm,
            bucket_bytes: 0,
            op: ReduceOp::Mean,
            compression: Compression::None,
            _thread: PhantomData,
        })
    }

    /// Ends a step begun by [`Self::begin_sharded`]: the gradients of `module` that were not
    /// handed over (in `grads`, taken out; zero where a parameter has none) join the last
    /// buckets, and every bucket's segments come back for [`ZeroOptimizer::step_reduced`].
    /// Also how many tensors were handed over during the backward.
    pub fn finish_sharded<M: Module>(
        self,
        module: &M,
        grads: &mut GradientsParams,
    ) -> Result<(ReducedGradients, usize)> {
        let Handing {
            sink,
            taken,
            weight,
            failed,
            ..
        } = take_step()?;
        let Sink::Sharded { exchange, .. } = sink else {
            return Err(DistError::Config(
                "an overlapped allreduce step was finished as a ZeRO step".into(),
            ));
        };
        // What was not handed over (parameters outside every unit), by index, then the last
        // buckets; a tensor without a gradient is left to the exchange, which counts it as
        // zero (its module may hold it released: ZeRO stage 3).
        let handed: HashSet<ParamId> = taken.iter().map(|(id, _)| *id).collect();
        let mut rest = Vec::new();
        take_trainable_grads_each(
            module,
            grads,
            &|_, id| !handed.contains(&id),
            false,
            &mut |i, mut values| {
                if weight != 1.0 {
                    values.iter_mut().for_each(|v| *v *= weight);
                }
                rest.push((i, values));
            },
        );
        exchange.submit(rest);
        let reduced = exchange.finish()?;
        if let Some(e) = failed {
            return Err(DistError::Mismatch {
                op: "overlapped ZeRO exchange".into(),
                reason: e,
            });
        }
        Ok((reduced, taken.len()))
    }
}

/// Hands one parameter's whole gradient (host values of shape `dims`) to this thread's ZeRO
/// step ([`OverlappedStep::begin_sharded`]) as soon as it exists, outside a segment's
/// [`hand_over`]: ZeRO stage 3's weights kept by key, whose gradients a backward computes one
/// at a time (each bucket is then reduced as soon as its last tensor comes). Returns the values
/// back where no ZeRO step is installed (the caller hands them over with its segment's).
pub fn hand_over_one(id: ParamId, dims: Vec<usize>, values: Vec<f32>) -> Option<Vec<f32>> {
    hand_to_sharded(id, dims, values, &mut |exchange, i, values| {
        exchange.submit(vec![(i, values)])
    })
}

/// Hands one piece of a parameter's gradient to this thread's ZeRO step, as
/// [`hand_over_one`] does a whole one: the values from `at` on of parameter `id` (of shape
/// `dims`), exactly one of the pieces its tensor is cut into
/// ([`crate::zero::ZeroOptimizer::cut_rows`]: a linear layer's weight whose product is taken
/// a block of rows at a time). The piece's bucket is reduced at once. Returns the values back
/// where no ZeRO step is installed.
pub fn hand_over_piece(
    id: ParamId,
    dims: Vec<usize>,
    at: usize,
    values: Vec<f32>,
) -> Option<Vec<f32>> {
    hand_to_sharded(id, dims, values, &mut |exchange, i, values| {
        exchange.submit_piece(i, at, values)
    })
}

/// Parameter `id`'s gradient values (or a piece of them), scaled, to this thread's ZeRO step
/// through `submit` (with the parameter's index), the parameter counted once as handed over
/// (the step's end takes what was not); the values back where no ZeRO step is installed.
fn hand_to_sharded(
    id: ParamId,
    dims: Vec<usize>,
    mut values: Vec<f32>,
    submit: &mut dyn FnMut(&ShardedExchange, usize, Vec<f32>),
) -> Option<Vec<f32>> {
    STEP.with(|s| {
        let mut s = s.borrow_mut();
        let Some(h) = s.as_mut() else {
            return Some(values);
        };
        let Sink::Sharded { exchange, index } = &h.sink else {
            return Some(values);
        };
        let Some(&i) = index.get(&id) else {
            h.failed.get_or_insert(format!(
                "parameter {id} was handed over but is not trainable in the model"
            ));
            return None;
        };
        let scale = h.weight * h.unscale;
        if scale != 1.0 {
            values.iter_mut().for_each(|v| *v *= scale);
        }
        if !h.taken.iter().any(|(t, _)| *t == id) {
            h.taken.push((id, dims));
            h.alone += 1;
        }
        submit(exchange, i, values);
        None
    })
}
