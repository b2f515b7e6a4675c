//! The gradient exchange overlapped with the backward pass: gradients are handed over as the
//! backward pass produces them (the last layers' first), packed into buckets and each bucket
//! reduced on a thread of its own while the backward pass goes on, as PyTorch DDP and Horovod
//! do. [`crate::collective::cost::StepCost::step_s`] models what that is worth.
//!
//! The buckets are cut by the tensors' sizes alone, never by when tensors arrive: a bucket
//! closes as soon as it holds its size (so its last tensor may take it past; waiting to learn
//! whether the next tensor fits would hold every bucket back for one more segment's backward),
//! and the first bucket is at most [`FIRST_BUCKET_BYTES`], so that the exchange starts as soon
//! as the last segment's backward is over, as PyTorch DDP's first bucket does. Every rank cuts
//! the same buckets and calls the same collectives in the same order, however its backward
//! pass is timed, and the result equals the whole list reduced at once.
//!
//! [`OverlappedStep`] runs one training step's exchange: it is installed on the thread that
//! runs the step, a segmented backward ([`crate::pipeline::segmented_gradients`]) hands each
//! segment's gradients over with [`hand_over`] as soon as they exist, and
//! [`OverlappedStep::finish`] puts the reduced gradients back where the step's optimizer finds
//! them. Burn 0.22's autodiff does fire a hook as each parameter's gradient is ready
//! (`Tensor::grad_distributed`, then the backend's `DistributedOps::submit_gradient_sync`), but
//! only into Burn's own in-process sync server for several devices of one process, which our
//! transports cannot stand in for; so the model runs segment by segment for its gradients to
//! come out in pieces;
//! [`crate::ddp::DdpStrategy::with_overlap`] drives it in burn-train's loop.
//!
//! ```
//! use std::sync::Arc;
//! use burn_dist::collective::{Communicator, ReduceOp};
//! use burn_dist::overlap::OverlappedExchange;
//! use burn_dist::transport::memory::MemoryTransport;
//!
//! let handles: Vec<_> = MemoryTransport::mesh(2)
//!     .into_iter()
//!     .map(|t| std::thread::spawn(move || {
//!         let comm = Arc::new(Communicator::new(Arc::new(t)));
//!         let r = comm.rank() as f32;
//!         let exchange = OverlappedExchange::start(comm, 8, ReduceOp::Mean).unwrap();
//!         // As a backward pass would: the head's gradient first, then the layer before it.
//!         exchange.submit(vec![vec![r; 3]]);
//!         exchange.submit(vec![vec![10.0 + r; 2]]);
//!         exchange.finish().unwrap()
//!     }))
//!     .collect();
//! for h in handles {
//!     assert_eq!(h.join().unwrap(), vec![vec![0.5; 3], vec![10.5; 2]]);
//! }
//! ```
//!
use std::cell::RefCell;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::TensorData;

use crate::Compression;
use crate::collective::{Communicator, ReduceOp};
use crate::zero::overlap::ShardedExchange;
use crate::{DistError, Result};

/// An exchange under way: [`submit`](Self::submit) gradients as they exist, then
/// [`finish`](Self::finish) for all of them reduced. While it runs, nothing else may call a
/// collective on its communicator (the exchange's collectives are numbered in call order).
pub struct OverlappedExchange {
    tx: Option<Sender<Vec<Vec<f32>>>>,
    worker: Option<JoinHandle<Result<Vec<Vec<f32>>>>>,
}

impl OverlappedExchange {
    /// Starts the exchange thread: buckets of up to `bucket_bytes` (of `f32`), each reduced
    /// with `op` over `comm`.
    pub fn start(comm: Arc<Communicator>, bucket_bytes: usize, op: ReduceOp) -> Result<Self> {
        let compression = comm.compression();
        Self::start_with(comm, bucket_bytes, op, compression)
    }

    /// [`Self::start`] with the buckets in the wire format `compression` (the communicator's
    /// own stays what its other collectives use).
    pub fn start_with(
        comm: Arc<Communicator>,
        bucket_bytes: usize,
        op: ReduceOp,
        compression: Compression,
    ) -> Result<Self> {
        let (tx, rx) = channel();
        let worker = std::thread::Builder::new()
            .name("burn-dist-exchange".into())
            .spawn(move || exchange(&comm, bucket_bytes, op, compression, rx))
            .map_err(|e| DistError::Config(format!("starting the exchange thread: {e}")))?;
        Ok(Self {
            tx: Some(tx),
            worker: Some(worker),
        })
    }

    /// Hands over `tensors`, in the order every rank hands them over; their buckets start to
    /// move as soon as they are full. If the exchange has failed, the tensors are dropped and
    /// [`finish`](Self::finish) returns the failure.
    pub fn submit(&self, tensors: Vec<Vec<f32>>) {
        if let Some(tx) = &self.tx {
            // A closed channel means the thread has stopped on an error: finish reports it.
            let _ = tx.send(tensors);
        }
    }

    /// Reduces what is left and returns every submitted tensor reduced, in submission order.
    pub fn finish(mut self) -> Result<Vec<Vec<f32>>> {
        self.tx.take();
        let worker = self
            .worker
            .take()
            .ok_or_else(|| DistError::Config("the gradient exchange was finished twice".into()))?;
        worker.join().unwrap_or_else(|_| {
            Err(DistError::Config(
                "the gradient exchange thread panicked".into(),
            ))
        })
    }
}

impl Drop for OverlappedExchange {
    fn drop(&mut self) {
        // Dropped without finish (the step failed): let the thread end, reduce what it has
        // and stop; its result is not wanted. This waits at most for the bucket under way,
        // which its collective's timeout bounds.
        self.tx.take();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// The first bucket's size at most, in bytes (PyTorch DDP's is 1 MB too): the exchange starts
/// after the first few gradients instead of a whole bucket's worth.
pub const FIRST_BUCKET_BYTES: usize = 1 << 20;

/// Where the buckets end, from the tensors' sizes alone: a bucket closes with the tensor that
/// brings it to its size (the first's size at most [`FIRST_BUCKET_BYTES`]).
#[derive(Debug, Clone)]
pub struct BucketCutter {
    cap: usize,
    first_cap: usize,
    fill: usize,
    closed: usize,
}

impl BucketCutter {
    /// Buckets of `bucket_bytes` (of `f32`).
    pub fn new(bucket_bytes: usize) -> Self {
        let cap = (bucket_bytes / 4).max(1);
        Self {
            cap,
            first_cap: cap.min(FIRST_BUCKET_BYTES / 4),
            fill: 0,
            closed: 0,
        }
    }

    /// Adds a tensor of `len` values to the open bucket; whether the bucket closes with it.
    pub fn add(&mut self, len: usize) -> bool {
        self.fill += len;
        let cap = if self.closed == 0 {
            self.first_cap
        } else {
            self.cap
        };
        if self.fill >= cap {
            self.fill = 0;
            self.closed += 1;
            true
        } else {
            false
        }
    }
}

/// The exchange thread: packs the tensors as they come into buckets ([`BucketCutter`]) and
/// reduces each bucket as soon as it closes, the last when the sender is done.
fn exchange(
    comm: &Communicator,
    bucket_bytes: usize,
    op: ReduceOp,
    compression: Compression,
    rx: Receiver<Vec<Vec<f32>>>,
) -> Result<Vec<Vec<f32>>> {
    let reduce =
        |bucket: &mut [Vec<f32>], flat: &mut Vec<f32>| reduce(comm, op, compression, bucket, flat);
    let mut all: Vec<Vec<f32>> = Vec::new();
    let mut cutter = BucketCutter::new(bucket_bytes);
    let mut start = 0usize;
    let mut flat = Vec::new();
    for tensors in rx {
        for t in tensors {
            let closes = cutter.add(t.len());
            all.push(t);
            if closes {
                reduce(&mut all[start..], &mut flat)?;
                start = all.len();
            }
        }
    }
    if start < all.len() {
        reduce(&mut all[start..], &mut flat)?;
    }
    Ok(all)
}

/// One bucket: the tensors concatenated, reduced, and copied back.
fn reduce(
    comm: &Communicator,
    op: ReduceOp,
    compression: Compression,
    bucket: &mut [Vec<f32>],
    flat: &mut Vec<f32>,
) -> Result<()> {
    flat.clear();
    for t in bucket.iter() {
        flat.extend_from_slice(t);
    }
    comm.allreduce_with(flat, op, compression)?;
    let mut at = 0;
    for t in bucket.iter_mut() {
        let n = t.len();
        t.copy_from_slice(&flat[at..at + n]);
        at += n;
    }
    Ok(())
}

/// Where a step's handed-over gradients go.
enum Sink {
    /// Allreduced whole, in buckets cut as they come.
    Allreduce(OverlappedExchange),
    /// ZeRO: reduced to this rank's segments in the sharded optimizer's buckets; each
    /// parameter's index in the trainable order.
    Sharded {
        exchange: ShardedExchange,
        index: HashMap<ParamId, usize>,
    },
}

/// The step under way on this thread: its exchange and what was handed over to it.
struct Handing {
    sink: Sink,
    /// Each tensor handed over, in order: its parameter and shape.
    taken: Vec<(ParamId, Vec<usize>)>,
    /// The device the gradients live on (the reduced ones go back there).
    device: Option<Device>,
    /// Every value is multiplied by it before it leaves (a rank's weight in a weighted mean).
    weight: f32,
    /// The handed-over values are also multiplied by it (fp16's unscaling: what the step
    /// leaves is unscaled already).
    unscale: f32,
    /// A gradient that could not be read (reported at finish).
    failed: Option<String>,
    /// How many tensors came one by one through [`hand_over_one`].
    alone: usize,
}

thread_local! {
    static STEP: RefCell<Option<Handing>> = const { RefCell::new(None) };
}

/// One training step's gradient exchange, overlapped with its backward pass: installed on the
/// thread that runs the step ([`Self::begin`]), fed by [`hand_over`] as the backward produces
/// each segment's gradients, and ended by [`Self::finish`] once the backward is over. Dropped
/// without `finish` (the step failed), it is removed from the thread and its exchange stopped.
///
/// Every rank must hand over the same tensors in the same order (the same model, segmented
/// the same way), as every rank of a data-parallel job does.
pub struct OverlappedStep {
    comm: Arc<Communicator>,
    bucket_bytes: usize,
    op: ReduceOp,
    compression: Compression,
    /// Tied to the thread it was installed on.
    _thread: PhantomData<*const ()>,
}

impl OverlappedStep {
    /// Installs a step's exchange on this thread: buckets of up to `bucket_bytes`, each
    /// reduced with `op` in the wire format `compression`, each value first multiplied by
    /// `weight`. An error if one is already installed here (steps do not nest).
    pub fn begin(
        comm: Arc<Communicator>,
        bucket_bytes: usize,
        op: ReduceOp,
        compression: Compression,
        weight: f32,
    ) -> Result<Self> {
        refuse_nesting()?;
        let exchange = OverlappedExchange::start_with(comm.clone(), bucket_bytes, op, compression)?;
        install(Sink::Allreduce(exchange), weight);
        Ok(Self {
            comm,
            bucket_bytes,
            op,
            compression,
            _thread: PhantomData,
        })
    }

    /// Ends the step: waits for the last buckets and registers every handed-over gradient,
    /// reduced, in `grads` (which holds what the step left: gradients of `module`'s parameters
    /// that were not handed over, reduced here after the others, in module order). Returns
    /// how many tensors were handed over (0: the step ran whole, and everything was reduced
    /// here after its backward).
    pub fn finish<M: Module>(self, module: &M, grads: &mut GradientsParams) -> Result<usize> {
        let Handing {
            sink,
            taken,
            device,
            weight,
            failed,
            ..
        } = take_step()?;
        let Sink::Allreduce(exchange) = sink else {
            return Err(DistError::Config(
                "an overlapped ZeRO step was finished as an allreduce step".into(),
            ));
        };
        let reduced = exchange.finish()?;
        if let Some(e) = failed {
            return Err(DistError::Mismatch {
                op: "overlapped gradient exchange".into(),
                reason: e,
            });
        }
        // What was not handed over (a model run whole, parameters outside every segment).
        crate::grads::reduce_grads(
            module,
            grads,
            &self.comm,
            self.bucket_bytes,
            (weight != 1.0).then_some(weight),
            self.op,
            self.compression,
        )?;
        let handed = taken.len();
        if handed == 0 {
            return Ok(0);
        }
        if reduced.len() != handed {
            return Err(DistError::Mismatch {
                op: "overlapped gradient exchange".into(),
                reason: format!(
                    "{} tensors came back for {handed} handed over",
                    reduced.len()
                ),
            });
        }
        let device = device.ok_or_else(|| {
            DistError::Config("gradients were handed over without a device".into())
        })?;
        let mut put = PutReduced {
            grads,
            values: taken
                .into_iter()
                .zip(reduced)
                .map(|((id, dims), v)| (id, (dims, v)))
                .collect(),
            device,
        };
        module.visit(&mut put);
        if let Some(id) = put.values.keys().next() {
            return Err(DistError::Mismatch {
                op: "overlapped gradient exchange".into(),
                reason: format!("parameter {id} was handed over but is not the module's"),
            });
        }
        Ok(handed)
    }
}

impl Drop for OverlappedStep {
    fn drop(&mut self) {
        // Finished: already taken. Abandoned: the exchange stops (its own Drop).
        STEP.with(|s| s.borrow_mut().take());
    }
}

/// The step under way, taken off this thread.
fn take_step() -> Result<Handing> {
    STEP.with(|s| s.borrow_mut().take())
        .ok_or_else(|| DistError::Config("the overlapped step was removed early".into()))
}

/// An error if a step is under way on this thread already (steps do not nest).
fn refuse_nesting() -> Result<()> {
    if handing_over() {
        return Err(DistError::Config(
            "an overlapped step began while another was under way on the same thread".into(),
        ));
    }
    Ok(())
}

/// Installs a step's hand-over on this thread.
fn install(sink: Sink, weight: f32) {
    STEP.with(|s| {
        *s.borrow_mut() = Some(Handing {
            sink,
            taken: Vec::new(),
            device: None,
            weight,
            unscale: 1.0,
            failed: None,
            alone: 0,
        })
    });
}

impl OverlappedStep {
    /// How many tensors this step has had handed over one by one so far ([`hand_over_one`]:
    /// each as soon as it was whole), of all it was handed.
    pub fn handed_alone(&self) -> usize {
        STEP.with(|s| s.borrow().as_ref().map_or(0, |h| h.alone))
    }
}

/// Whether an [`OverlappedStep`] is installed on this thread: a step should then run its
/// backward segment by segment and [`hand_over`] each segment's gradients.
pub fn handing_over() -> bool {
    STEP.with(|s| s.borrow().is_some())
}

/// Multiplies every value handed over from now on by `1 / scale` (fp16: the loss was scaled
/// by `scale`); nothing without an [`OverlappedStep`] on this thread.
pub fn unscale_by(scale: f32) {
    STEP.with(|s| {
        if let Some(h) = s.borrow_mut().as_mut() {
            h.unscale = 1.0 / scale;
        }
    });
}

/// Hands `segment`'s gradients in `grads` to this thread's [`OverlappedStep`] (in the
/// segment's parameter order) and returns what is left of `grads`; without a step, returns
/// `grads` as they are.
pub fn hand_over<M: Module>(segment: &M, grads: GradientsParams) -> GradientsParams {
    STEP.with(|s| {
        let mut s = s.borrow_mut();
        let Some(h) = s.as_mut() else {
            return grads;
        };
        let mut take = Take {
            grads,
            tensors: Vec::new(),
            handing: h,
        };
        segment.visit(&mut take);
        let Take { grads, tensors, .. } = take;
        if tensors.is_empty() {
            return grads;
        }
        match &h.sink {
            Sink::Allreduce(x) => x.submit(tensors),
            Sink::Sharded { exchange, index } => {
                let ids = &h.taken[h.taken.len() - tensors.len()..];
                let mut indexed = Vec::with_capacity(tensors.len());
                for ((id, _), values) in ids.iter().zip(tensors) {
                    match index.get(id) {
                        Some(&i) => indexed.push((i, values)),
                        None => {
                            h.failed.get_or_insert(format!(
                                "parameter {id} was handed over but is not trainable in the model"
                            ));
                        }
                    }
                }
                exchange.submit(indexed);
            }
        }
        grads
    })
}

/// Takes a segment's gradients out, as host values (scaled) with their parameters and shapes.
struct Take<'a> {
    grads: GradientsParams,
    tensors: Vec<Vec<f32>>,
    handing: &'a mut Handing,
}

impl ModuleVisitor for Take<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let Some(g) = self.grads.remove::<D>(param.id) else {
            return;
        };
        self.handing.device.get_or_insert_with(|| g.device());
        let dims = g.dims().to_vec();
        let scale = self.handing.weight * self.handing.unscale;
        let values = host_values(g, scale).unwrap_or_else(|e| {
            self.handing
                .failed
                .get_or_insert(format!("parameter {}'s gradient: {e}", param.id));
            vec![0.0; dims.iter().product()]
        });
        self.handing.taken.push((param.id, dims));
        self.tensors.push(values);
    }
}

/// A gradient read to the host, times `scale`.
fn host_values<const D: usize>(g: Tensor<D>, scale: f32) -> std::result::Result<Vec<f32>, String> {
    let mut values = g
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| format!("{e:?}"))?;
    if scale != 1.0 {
        values.iter_mut().for_each(|v| *v *= scale);
    }
    Ok(values)
}

/// Registers the reduced gradients for the module's parameters.
struct PutReduced<'a> {
    grads: &'a mut GradientsParams,
    values: HashMap<ParamId, (Vec<usize>, Vec<f32>)>,
    device: Device,
}

impl ModuleVisitor for PutReduced<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some((dims, v)) = self.values.remove(&param.id) {
            let g = Tensor::<D>::from_data(TensorData::new(v, dims), &self.device);
            self.grads.register::<D>(param.id, g);
        }
    }
}

mod sharded;
pub use sharded::{hand_over_one, hand_over_piece};
#[cfg(test)]
mod tests;
