//! Data parallelism for Burn modules.
//!
//! - [`broadcast_module`]: every float tensor of a module (parameters and batch-norm running
//!   statistics) from rank 0 to all ranks.
//! - [`allreduce_grads`]: gradients averaged across ranks, packed into fusion buckets in the
//!   module's own (fixed) parameter order.
//! - [`DdpStrategy`]: burn-train's training loop, data parallel: a `SupervisedLearningStrategy`
//!   for `TrainingStrategy::Custom`, so the Learner API (metrics, early stopping, checkpoints)
//!   works unchanged. Gradients are averaged on every optimizer step (with gradient accumulation
//!   of k micro-steps, only on the k-th); buffers are re-broadcast from rank 0 after every
//!   training epoch, so validation sees the same model on every rank; only rank 0 writes
//!   checkpoints.
//!
//! Batch norm: statistics are computed per rank on its own batches, as in PyTorch DDP, and rank
//! 0's running statistics are the ones kept (broadcast after every epoch, like DDP's
//! `broadcast_buffers`). Synchronised batch norm is not offered.

mod fit;

use std::sync::Arc;
use std::time::Instant;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::TensorData;
use burn::train::{Learner, LearnerModel};

use crate::bucket::DEFAULT_BUCKET_BYTES;
use crate::collective::{Communicator, ReduceOp};
use crate::flat::module::trainable_names;
use crate::overlap::OverlappedStep;
use crate::zero::ZeroOptimizer;
use crate::zero::module::Sharding;
use crate::{DistError, Result};

trait FlatF32 {
    fn into_flat_f32(self) -> Vec<f32>;
}

impl<const D: usize> FlatF32 for Tensor<D> {
    fn into_flat_f32(self) -> Vec<f32> {
        // A read that fails leaves an empty vector, which the size checks downstream report.
        self.into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .unwrap_or_default()
    }
}

struct Collect {
    values: Vec<Vec<f32>>,
}

impl ModuleVisitor for Collect {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.values.push(param.val().into_flat_f32());
    }
}

struct Replace {
    values: std::vec::IntoIter<Vec<f32>>,
    error: Option<String>,
}

impl ModuleMapper for Replace {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(v) = self.values.next() else {
            self.error
                .get_or_insert("fewer tensors than the module has".into());
            return param;
        };
        let error = &mut self.error;
        param.map(|t| {
            let shape = t.shape();
            if shape.num_elements() != v.len() {
                error.get_or_insert(format!(
                    "a tensor of {} values for shape {shape:?}",
                    v.len()
                ));
                return t;
            }
            let rg = t.is_require_grad();
            Tensor::<D>::from_data(TensorData::new(v, shape), &t.device()).set_require_grad(rg)
        })
    }
}

/// Rank 0's line at an epoch's end: the time in training steps and, of it, in the gradient
/// exchange (with `overlapped`, only the wait after the backward pass). Data parallel and
/// elastic training print it alike; `benches/overlap.rs` reads it.
pub fn exchange_report(
    epoch: usize,
    overlapped: bool,
    exchanging: std::time::Duration,
    stepping: std::time::Duration,
) -> String {
    format!(
        "epoch {epoch}: gradient exchange {}{:.2} s of {:.2} s in training steps ({:.1}%, rank 0)",
        if overlapped {
            "(overlapped with the backward) waited "
        } else {
            ""
        },
        exchanging.as_secs_f64(),
        stepping.as_secs_f64(),
        100.0 * exchanging.as_secs_f64() / stepping.as_secs_f64()
    )
}

/// Every float tensor of `module` (parameters and buffers such as batch-norm statistics), in
/// visiting order, with the buffers' latest updates.
pub fn module_values<M: Module>(module: &M) -> Vec<Vec<f32>> {
    sync_running_stats(module);
    let mut c = Collect { values: Vec::new() };
    module.visit(&mut c);
    c.values
}

/// Folds the pending updates of `module`'s running statistics (batch norm's mean and variance)
/// into the values a visitor or a record reads. Burn keeps each thread's latest update apart
/// until a sync, so a visit after a training step reads the statistics one update behind; the
/// sync happens in `valid()`, which shares the statistics' storage with `module`.
pub fn sync_running_stats<M: Module>(module: &M) {
    let _ = module.valid();
}

/// `module` with its float tensors replaced by `values` (as from [`module_values`]).
pub fn with_module_values<M: Module>(module: M, values: Vec<Vec<f32>>) -> Result<M> {
    let mut r = Replace {
        values: values.into_iter(),
        error: None,
    };
    let m = module.map(&mut r);
    match r.error {
        Some(e) => Err(DistError::Mismatch {
            op: "module broadcast".into(),
            reason: e,
        }),
        None => Ok(m),
    }
}

/// Rank 0's parameters and buffers on every rank, a tensor at a time: each is read,
/// broadcast and put back before the next, so besides the module a rank holds one tensor's
/// values twice at most (a copy of the whole module's values cost three models at once:
/// the start's peak of every data-parallel run).
pub fn broadcast_module<M: Module>(module: M, comm: &Communicator) -> Result<M> {
    if comm.world() == 1 {
        return Ok(module);
    }
    sync_running_stats(&module);
    let mut b = Broadcast { comm, error: None };
    let m = module.map(&mut b);
    match b.error {
        Some(e) => Err(e),
        None => Ok(m),
    }
}

/// Broadcasts each float tensor from rank 0 as the module is mapped.
struct Broadcast<'a> {
    comm: &'a Communicator,
    error: Option<DistError>,
}

impl ModuleMapper for Broadcast<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if self.error.is_some() {
            return param;
        }
        let (comm, error) = (self.comm, &mut self.error);
        param.map(|t| {
            let shape = t.shape();
            let rg = t.is_require_grad();
            let device = t.device();
            let mut v = t.into_flat_f32();
            if v.len() != shape.num_elements() {
                error.get_or_insert(DistError::Mismatch {
                    op: "module broadcast".into(),
                    reason: format!("a tensor of shape {shape:?} read as {} values", v.len()),
                });
                v.resize(shape.num_elements(), 0.0);
            }
            if let Err(e) = comm.broadcast(&mut v, 0) {
                error.get_or_insert(e);
            }
            Tensor::<D>::from_data(TensorData::new(v, shape), &device).set_require_grad(rg)
        })
    }
}

/// Averages `grads` across ranks in place: flattened in the module's parameter order, packed
/// into buckets of `bucket_bytes`, one allreduce per bucket.
pub fn allreduce_grads<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    comm: &Communicator,
    bucket_bytes: usize,
) -> Result<()> {
    crate::grads::reduce_grads(
        module,
        grads,
        comm,
        bucket_bytes,
        None,
        ReduceOp::Mean,
        comm.compression(),
    )
}

/// Averages `grads` across ranks weighted by each rank's sample count: every rank's `grads` is
/// the mean over its own `samples`, and the result is the mean over all the ranks' samples, as
/// one process on the whole global batch would compute it (ranks with uneven shares of the
/// batch: elastic training, slow and fast workers). A rank with no samples contributes nothing.
pub fn allreduce_grads_weighted<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    comm: &Communicator,
    bucket_bytes: usize,
    samples: usize,
) -> Result<()> {
    if comm.world() == 1 {
        return Ok(());
    }
    let mut total = [samples as f32];
    comm.allreduce(&mut total, ReduceOp::Sum)?;
    if total[0] <= 0.0 {
        return Err(DistError::Mismatch {
            op: "weighted gradient average".into(),
            reason: "no rank has a sample".into(),
        });
    }
    let weight = samples as f32 / total[0];
    crate::grads::reduce_grads(
        module,
        grads,
        comm,
        bucket_bytes,
        Some(weight),
        ReduceOp::Sum,
        comm.compression(),
    )
}

/// Sums `grads` across ranks after scaling this rank's by `scale` (elastic training: a rank's
/// samples over the step's total, known from a collective the caller already ran, so the
/// result is the mean over the global batch without another allreduce), in the wire format
/// `compression` (the communicator's own stays exact for the counts and sums beside).
pub fn allreduce_grads_scaled<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    comm: &Communicator,
    bucket_bytes: usize,
    scale: f32,
    compression: crate::Compression,
) -> Result<()> {
    crate::grads::reduce_grads(
        module,
        grads,
        comm,
        bucket_bytes,
        Some(scale),
        ReduceOp::Sum,
        compression,
    )
}

/// Decides whether an optimizer step is taken once the gradients are averaged (fp16 loss
/// scaling: a step whose averaged gradients are not finite is skipped, on every rank alike,
/// since every rank holds the same average).
pub trait StepGuard: Send + Sync {
    /// `finite`: whether every averaged gradient value is finite. Returns whether to step.
    fn take_step(&self, finite: bool) -> bool;
}

/// Whether every gradient `grads` holds for `module` is finite (one value read back).
pub fn grads_finite<M: Module>(module: &M, grads: &GradientsParams) -> bool {
    struct Sum<'a> {
        grads: &'a GradientsParams,
        total: Option<Tensor<1>>,
    }
    impl ModuleVisitor for Sum<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.get::<D>(param.id) {
                let s = g.abs().sum();
                self.total = Some(match self.total.take() {
                    Some(t) => t + s,
                    None => s,
                });
            }
        }
    }
    let mut v = Sum { grads, total: None };
    module.visit(&mut v);
    v.total
        .map(|t| t.into_scalar::<f32>().is_finite())
        .unwrap_or(true)
}

/// burn-train's supervised loop, data parallel over a [`Communicator`].
pub struct DdpStrategy {
    comm: Arc<Communicator>,
    bucket_bytes: usize,
    guard: Option<Arc<dyn StepGuard>>,
    sharding: Option<Sharding>,
    overlap: bool,
}

impl DdpStrategy {
    pub fn new(comm: Arc<Communicator>) -> Self {
        Self {
            comm,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            guard: None,
            sharding: None,
            overlap: false,
        }
    }

    /// Overlaps the gradient exchange with the backward pass ([`crate::overlap`]): every
    /// training step runs with an [`OverlappedStep`] installed, and a model whose step runs
    /// its backward segment by segment and hands each segment's gradients over
    /// ([`crate::overlap::hand_over`]) has them reduced, bucket by bucket, while the segments
    /// before run; what the step does not hand over is reduced after it, as without overlap.
    /// Not with ZeRO or gradient accumulation (the fit fails naming them).
    pub fn with_overlap(mut self, overlap: bool) -> Self {
        self.overlap = overlap;
        self
    }

    /// ZeRO stage 1 or 2 ([`crate::zero`]): each rank keeps `1/N` of the optimizer state and
    /// updates that shard; the Learner's own optimizer never steps (its checkpoint file stays
    /// empty) and the state goes to `sharding.store` at every checkpoint.
    pub fn with_sharding(mut self, sharding: Sharding) -> Self {
        self.sharding = Some(sharding);
        self
    }

    /// The sharded optimizer of this launch, its state taken from the store when resuming.
    fn start_sharding<M: Module>(
        &self,
        model: &M,
        starting_epoch: usize,
    ) -> Result<Option<ZeroOptimizer>> {
        let Some(s) = &self.sharding else {
            return Ok(None);
        };
        let names = trainable_names(model);
        let mut z = ZeroOptimizer::new(
            s.stage,
            &names,
            s.optimizer.clone(),
            &self.comm,
            self.bucket_bytes,
        )?
        .with_new_tensors_at_zero(s.new_tensors_at_zero);
        if starting_epoch > 1 {
            let mut loaded = (self.comm.rank() == 0).then(|| s.store.load(starting_epoch - 1));
            let root = loaded.as_mut().map(|r| {
                r.as_mut()
                    .map(|b| b.as_mut() as &mut dyn crate::zero::StateReader)
                    .map_err(|e| e.clone())
            });
            z.scatter_from_reader(&self.comm, 0, root)?;
        }
        if self.comm.rank() == 0 {
            eprintln!(
                "ZeRO stage {}: rank 0 keeps the optimizer state of {}",
                s.stage.number(),
                z.describe()
            );
        }
        Ok(Some(z))
    }

    /// Asks `guard` before every optimizer step, with whether the averaged gradients are all
    /// finite; a step it refuses is skipped (the learning-rate schedule still advances, as
    /// PyTorch's `GradScaler` leaves it).
    pub fn with_step_guard(mut self, guard: Arc<dyn StepGuard>) -> Self {
        self.guard = Some(guard);
        self
    }

    /// Fusion bucket size in bytes (default 25 MB).
    pub fn with_bucket_bytes(mut self, bytes: usize) -> Self {
        self.bucket_bytes = bytes.max(4);
        self
    }

    /// Plain data parallel's step: the gradients averaged (what `overlapped` has not reduced
    /// yet, with it), then the Learner's optimizer. Returns the time of the exchange alone
    /// (overlapped: the wait for what the backward pass did not hide).
    fn plain_step<M: LearnerModel>(
        &self,
        learner: &mut Learner<M>,
        mut grads: GradientsParams,
        overlapped: Option<OverlappedStep>,
    ) -> Result<std::time::Duration> {
        let start = Instant::now();
        match overlapped {
            Some(step) => {
                if step.finish(&learner.model(), &mut grads)? == 0 {
                    self.warn_not_segmented();
                }
            }
            None => allreduce_grads(&learner.model(), &mut grads, &self.comm, self.bucket_bytes)?,
        }
        let took = start.elapsed();
        learner.lr_step();
        let take = match &self.guard {
            Some(g) => g.take_step(grads_finite(&learner.model(), &grads)),
            None => true,
        };
        if take {
            learner.optimizer_step(grads);
        }
        Ok(took)
    }

    /// Said once (rank 0): overlap asked for, but the model's step ran its backward whole.
    fn warn_not_segmented(&self) {
        static SAID: std::sync::Once = std::sync::Once::new();
        if self.comm.rank() == 0 {
            SAID.call_once(|| {
                eprintln!(
                    "overlap: the model's step ran its backward whole (it handed no gradients \
                     over), so its exchange ran after it"
                )
            });
        }
    }

    /// What [`Self::with_overlap`] cannot run with, by name.
    fn check_overlap(&self, grad_accumulation: Option<usize>) -> Result<()> {
        if !self.overlap {
            return Ok(());
        }
        let why = if self.sharding.is_some() {
            Some("ZeRO (its exchange is a reduce-scatter in its own buckets)")
        } else if grad_accumulation.is_some_and(|k| k > 1) {
            Some(
                "gradient accumulation (a step's gradients are exchanged on its k-th backward only)",
            )
        } else {
            None
        };
        match why {
            Some(why) => Err(DistError::Config(format!(
                "overlapping the gradient exchange does not work with {why}"
            ))),
            None => Ok(()),
        }
    }

    pub(super) fn fail(interrupter: &burn::train::Interrupter, e: DistError) {
        interrupter.fail(burn::data::dataset::DatasetError::new(e));
    }
}
