//! Pipeline model parallelism: a model split into consecutive stages, one per rank, trained on
//! micro-batches (GPipe, or 1F1B as in PipeDream-flush).
//!
//! burn-dist knows no architectures: a stage is any Burn module implementing
//! [`PipelineStage`], mapping the previous stage's [`Activation`] to the next one's. Activations
//! travel forward and activation gradients backward over the job's [`Transport`] as raw
//! little-endian `f32` with their shapes ([`Kind::Pipeline`], tagged by step, micro-batch and
//! direction); a message whose shape is not what the receiving stage expects is an error naming
//! both stages.
//!
//! One [`Pipeline::step`] runs every micro-batch of a step through this rank's stage and returns
//! the stage's gradients summed over the micro-batches (what gradient accumulation over the same
//! micro-batches gives the unsplit model); each stage then steps its own optimizer. The last
//! stage computes each micro-batch's loss with a closure and reports it.
//!
//! [`Pipeline::forward`] runs micro-batches forward only (validation). For 2D parallelism
//! (P stages x D replicas), [`crate::transport::group::Grid`] places the ranks and each stage's
//! replicas average that stage's gradients over a [`crate::transport::group::Group`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::prelude::*;
use burn::tensor::TensorData;

use crate::transport::Transport;
use crate::wire::{Kind, bytes_to_f32, f32_to_bytes};
use crate::{DistError, Result};

mod segments;
mod step;
pub use segments::{
    Gather, Regather, SegmentDone, recomputed_gradients, recomputed_gradients_each,
    recomputed_gradients_gathered, segmented_gradients, segmented_gradients_gathered,
    segmented_gradients_regathered,
};

/// A tensor between two stages: rank 2 (`[batch, features]`) or rank 4 (`[batch, c, h, w]`).
#[derive(Debug, Clone)]
pub enum Activation {
    Rank2(Tensor<2>),
    Rank4(Tensor<4>),
}

impl Activation {
    pub fn dims(&self) -> Vec<usize> {
        match self {
            Activation::Rank2(t) => t.dims().to_vec(),
            Activation::Rank4(t) => t.dims().to_vec(),
        }
    }

    /// The 2-d tensor; an error naming `what` for another rank.
    pub fn rank2(self, what: &str) -> Result<Tensor<2>> {
        match self {
            Activation::Rank2(t) => Ok(t),
            other => Err(mismatch(
                what,
                format!("expected a 2-d activation, got {:?}", other.dims()),
            )),
        }
    }

    /// The 4-d tensor; an error naming `what` for another rank.
    pub fn rank4(self, what: &str) -> Result<Tensor<4>> {
        match self {
            Activation::Rank4(t) => Ok(t),
            other => Err(mismatch(
                what,
                format!("expected a 4-d activation, got {:?}", other.dims()),
            )),
        }
    }

    /// The same values, cut from the graph that made them.
    fn detach(self) -> Self {
        match self {
            Activation::Rank2(t) => Activation::Rank2(t.detach()),
            Activation::Rank4(t) => Activation::Rank4(t.detach()),
        }
    }

    fn require_grad(self) -> Self {
        match self {
            Activation::Rank2(t) => Activation::Rank2(t.require_grad()),
            Activation::Rank4(t) => Activation::Rank4(t.require_grad()),
        }
    }

    /// Whether backward can start from this activation (it depends on a tracked tensor).
    fn is_tracked(&self) -> bool {
        match self {
            Activation::Rank2(t) => t.is_tracked(),
            Activation::Rank4(t) => t.is_tracked(),
        }
    }

    /// This tensor's gradient in `grads`, as plain values.
    fn grad(&self, grads: &burn::tensor::Gradients) -> Option<TensorData> {
        match self {
            Activation::Rank2(t) => t.grad(grads).map(|g| g.into_data()),
            Activation::Rank4(t) => t.grad(grads).map(|g| g.into_data()),
        }
    }

    /// `sum(self * upstream)`: backward from it gives this activation's producers the gradient
    /// `upstream` (which must have the same shape).
    fn inject(&self, upstream: TensorData, device: &Device) -> Result<Tensor<1>> {
        let shape: Vec<usize> = upstream.shape().to_vec();
        if shape != self.dims() {
            return Err(mismatch(
                "pipeline backward",
                format!(
                    "the gradient received has shape {shape:?}, the activation sent {:?}",
                    self.dims()
                ),
            ));
        }
        Ok(match self {
            Activation::Rank2(t) => (t.clone() * Tensor::<2>::from_data(upstream, device)).sum(),
            Activation::Rank4(t) => (t.clone() * Tensor::<4>::from_data(upstream, device)).sum(),
        })
    }

    /// `sum(self * upstream)` for an upstream gradient already on the device.
    fn inject_activation(&self, upstream: Activation) -> Result<Tensor<1>> {
        if upstream.dims() != self.dims() {
            return Err(mismatch(
                "recomputed backward",
                format!(
                    "the gradient has shape {:?}, the activation {:?}",
                    upstream.dims(),
                    self.dims()
                ),
            ));
        }
        Ok(match (self, upstream) {
            (Activation::Rank2(t), Activation::Rank2(g)) => (t.clone() * g).sum(),
            (Activation::Rank4(t), Activation::Rank4(g)) => (t.clone() * g).sum(),
            _ => unreachable!("same dims, same rank"),
        })
    }

    /// This tensor's gradient in `grads`, on the device (untracked).
    fn grad_activation(&self, grads: &burn::tensor::Gradients) -> Option<Activation> {
        match self {
            Activation::Rank2(t) => t
                .grad(grads)
                .map(|g| Activation::Rank2(Tensor::from_inner(g))),
            Activation::Rank4(t) => t
                .grad(grads)
                .map(|g| Activation::Rank4(Tensor::from_inner(g))),
        }
    }

    fn data(&self) -> TensorData {
        match self {
            Activation::Rank2(t) => t.clone().into_data(),
            Activation::Rank4(t) => t.clone().into_data(),
        }
    }
}

fn mismatch(op: &str, reason: String) -> DistError {
    DistError::Mismatch {
        op: op.to_string(),
        reason,
    }
}

/// `[rank: u32][dims: u64 x rank][f32 values]`, little-endian.
fn encode(data: TensorData) -> Result<Vec<u8>> {
    let shape: Vec<usize> = data.shape().to_vec();
    let values = data
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| mismatch("pipeline send", format!("reading a tensor: {e:?}")))?;
    let mut out = Vec::with_capacity(4 + 8 * shape.len() + 4 * values.len());
    out.extend((shape.len() as u32).to_le_bytes());
    for d in &shape {
        out.extend((*d as u64).to_le_bytes());
    }
    out.extend(f32_to_bytes(&values));
    Ok(out)
}

/// The tensor data in a message; any malformed message is an error, never a panic.
fn decode(bytes: &[u8]) -> Result<TensorData> {
    let bad = |r: String| mismatch("pipeline receive", r);
    let rank = bytes
        .get(..4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
        .ok_or_else(|| bad(format!("a {}-byte message has no header", bytes.len())))?;
    if rank != 2 && rank != 4 {
        return Err(bad(format!(
            "a rank-{rank} tensor (stages exchange rank 2 or 4)"
        )));
    }
    let mut shape = Vec::with_capacity(rank);
    for i in 0..rank {
        let at = 4 + 8 * i;
        let d = bytes
            .get(at..at + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
            .ok_or_else(|| bad("the shape is cut short".into()))?;
        shape.push(usize::try_from(d).map_err(|_| bad(format!("dimension {d}")))?);
    }
    let count = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
    let values = bytes_to_f32(&bytes[4 + 8 * rank..], count)?;
    Ok(TensorData::new(values, shape))
}

fn activation(data: TensorData, device: &Device) -> Activation {
    if data.shape().len() == 2 {
        Activation::Rank2(Tensor::from_data(data, device))
    } else {
        Activation::Rank4(Tensor::from_data(data, device))
    }
}

/// One stage of a pipelined model. An input it cannot take (another rank, another shape) is an
/// error, which the pipeline reports with the stage's number.
pub trait PipelineStage: Module {
    fn forward(&self, x: Activation) -> Result<Activation>;

    /// Whether the stage takes an input of shape `dims`, else what it takes ("16 channels").
    /// The pipeline asks before every forward of a received activation, so a stage handed
    /// the wrong shape fails with an error naming both stages instead of inside a layer.
    fn accepts(&self, dims: &[usize]) -> std::result::Result<(), String> {
        let _ = dims;
        Ok(())
    }

    /// The forward of a recomputation ([`Pipeline::with_recompute`]): the output
    /// [`forward`](Self::forward) gave for `x` in this step, now with its graph, and without
    /// the side effects the first pass already had. A stage whose forward updates running
    /// statistics (batch norm) must not update them again here, or they would move twice per
    /// micro-batch. The default runs `forward`, which is right for stages without any.
    fn forward_again(&self, x: Activation) -> Result<Activation> {
        self.forward(x)
    }
}

/// The order of forwards and backwards over a step's micro-batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Schedule {
    /// Every forward, then every backward: all micro-batches' activations are held at once.
    #[cfg_attr(feature = "clap", value(name = "gpipe"))]
    GPipe,
    /// One forward, one backward in the steady state (PipeDream-flush): stage s holds at most
    /// `stages - s` micro-batches' activations.
    #[default]
    #[cfg_attr(feature = "clap", value(name = "1f1b"))]
    OneFOneB,
}

impl Schedule {
    /// Every schedule, in the order the command line lists them.
    pub const ALL: &'static [Schedule] = &[Schedule::GPipe, Schedule::OneFOneB];

    /// The schedule named `name` (ASCII case ignored), as [`Schedule::name`] spells it.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL
            .iter()
            .copied()
            .find(|s| s.name().eq_ignore_ascii_case(name))
    }

    /// The schedule's name as the command line spells it (`gpipe`, `1f1b`).
    pub fn name(self) -> &'static str {
        match self {
            Self::GPipe => "gpipe",
            Self::OneFOneB => "1f1b",
        }
    }

    /// The operations of stage `stage` of `stages` over `m` micro-batches, in order:
    /// `(true, i)` is the forward of micro-batch i, `(false, i)` its backward.
    pub fn order(self, stage: usize, stages: usize, m: usize) -> Vec<(bool, usize)> {
        match self {
            Schedule::GPipe => (0..m)
                .map(|i| (true, i))
                .chain((0..m).map(|i| (false, i)))
                .collect(),
            Schedule::OneFOneB => {
                let warmup = (stages - 1 - stage).min(m);
                let mut ops: Vec<(bool, usize)> = (0..warmup).map(|i| (true, i)).collect();
                for i in 0..m - warmup {
                    ops.push((true, warmup + i));
                    ops.push((false, i));
                }
                ops.extend((m - warmup..m).map(|i| (false, i)));
                ops
            }
        }
    }

    /// The most micro-batches whose activations stage `stage` of `stages` holds at once over
    /// `m` micro-batches: all of them under GPipe, `stages - stage` under 1F1B.
    pub fn held(self, stage: usize, stages: usize, m: usize) -> usize {
        match self {
            Schedule::GPipe => m,
            Schedule::OneFOneB => (stages - stage).min(m),
        }
    }
}

/// What one step gave this rank's stage.
pub struct StepOutput {
    /// The stage's parameter gradients, summed over the step's micro-batches.
    pub grads: GradientsParams,
    /// The last stage: each micro-batch's loss. Other stages: empty.
    pub losses: Vec<f32>,
    /// The most micro-batches this stage held at once (their whole activations, or with
    /// [`Pipeline::with_recompute`] only their inputs).
    pub peak_in_flight: usize,
    /// The most micro-batches whose autodiff graphs (every activation the backward needs)
    /// this stage held at once: `peak_in_flight` without recomputation, at most 1 with it.
    pub peak_graphs: usize,
}

/// Initialises every parameter a visit reaches.
struct Materialize;

impl burn::module::ModuleVisitor for Materialize {
    fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
        let _ = param.val();
    }
}

/// This rank's place in a pipeline: stage `stage` of the stages held by `ranks` (in order).
pub struct Pipeline {
    transport: Arc<dyn Transport>,
    ranks: Vec<usize>,
    stage: usize,
    schedule: Schedule,
    timeout: Duration,
    step: u64,
    recompute: bool,
    /// Recomputation: the stream the micro-batches' seeds are drawn from.
    seeds: u64,
}

/// The tag of micro-batch `m` of step `step`, forward or backward.
fn tag(step: u64, m: usize, forward: bool) -> u64 {
    (step << 32) | ((m as u64) << 1) | u64::from(!forward)
}

impl Pipeline {
    /// `ranks[s]` holds stage s; this process is `transport.rank()`, which must be one of them.
    pub fn new(
        transport: Arc<dyn Transport>,
        ranks: Vec<usize>,
        schedule: Schedule,
    ) -> Result<Self> {
        let me = transport.rank();
        let stage = ranks.iter().position(|&r| r == me).ok_or_else(|| {
            DistError::Config(format!(
                "rank {me} holds no stage of the pipeline {ranks:?}"
            ))
        })?;
        if let Some(r) = ranks.iter().find(|&&r| r >= transport.world()) {
            return Err(DistError::Config(format!(
                "pipeline rank {r} is outside a world of {}",
                transport.world()
            )));
        }
        Ok(Self {
            transport,
            ranks,
            stage,
            schedule,
            timeout: Duration::from_secs(120),
            step: 0,
            recompute: false,
            seeds: 0,
        })
    }

    /// Activation recomputation: the forward of a micro-batch runs without a graph and the
    /// stage keeps only its input; its backward runs the forward again
    /// ([`PipelineStage::forward_again`]) with the graph, then differentiates it. A stage then
    /// holds its in-flight micro-batches' inputs and one micro-batch's activations, for one
    /// more forward per micro-batch (none on the last stage, which runs each micro-batch's
    /// forward in its backward). The results are those without recomputation, except random
    /// draws (dropout) on the other stages, which come from a seed per micro-batch
    /// ([`Pipeline::seed`]) so that both passes draw the same. The backend's random stream
    /// is the process's: stages that draw (dropout) and recompute need a process each, or
    /// they reseed each other's draws.
    pub fn with_recompute(mut self, on: bool) -> Self {
        self.recompute = on;
        self
    }

    /// Whether this pipeline recomputes activations ([`Pipeline::with_recompute`]).
    pub fn recomputes(&self) -> bool {
        self.recompute
    }

    /// Restarts the stream the recomputation's per-micro-batch seeds come from (a run seeds it
    /// per epoch, so that a resumed run draws what the uninterrupted one drew).
    pub fn seed(&mut self, seed: u64) {
        self.seeds = seed;
    }

    /// How long a stage waits for its neighbour's activation or gradient.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub fn stage(&self) -> usize {
        self.stage
    }

    pub fn stages(&self) -> usize {
        self.ranks.len()
    }

    fn is_first(&self) -> bool {
        self.stage == 0
    }

    fn is_last(&self) -> bool {
        self.stage + 1 == self.ranks.len()
    }

    fn recv(&self, from_stage: usize, tag: u64, what: &str) -> Result<TensorData> {
        let rank = self.ranks[from_stage];
        let bytes =
            self.transport
                .recv(rank, Kind::Pipeline, tag, Instant::now() + self.timeout)?;
        decode(&bytes).map_err(|e| {
            mismatch(
                what,
                format!(
                    "from stage {from_stage} (rank {rank}) to stage {}: {e}",
                    self.stage
                ),
            )
        })
    }

    /// `data`, received from the previous stage for micro-batch `m`, if this stage takes its
    /// shape (`accepts`); else an error naming both stages and both shapes.
    fn check_input(
        &self,
        data: TensorData,
        m: usize,
        accepts: &dyn Fn(&[usize]) -> std::result::Result<(), String>,
    ) -> Result<TensorData> {
        match accepts(data.shape()) {
            Ok(()) => Ok(data),
            Err(takes) => {
                let from = self.stage - 1;
                Err(mismatch(
                    "pipeline forward",
                    format!(
                        "stage {} (rank {}) received an activation of shape {:?} from stage \
                         {from} (rank {}) for micro-batch {m}, and it takes {takes}: do both \
                         ranks build the same model with the same split?",
                        self.stage,
                        self.ranks[self.stage],
                        data.shape().to_vec(),
                        self.ranks[from]
                    ),
                ))
            }
        }
    }

    fn send(&self, to_stage: usize, tag: u64, data: TensorData) -> Result<()> {
        self.transport
            .send(self.ranks[to_stage], Kind::Pipeline, tag, encode(data)?)
    }

    /// Runs `micro_batches` micro-batches forward only (validation, inference: `stage` is
    /// usually `module.valid()` on the plain device). The first stage takes its micro-batches
    /// from `inputs`; the last hands each output to `consume(output, micro_batch)`, in order.
    /// Every stage of the pipeline must call it with the same `micro_batches`.
    pub fn forward<M: PipelineStage>(
        &mut self,
        stage: &M,
        inputs: &mut dyn FnMut(usize) -> Activation,
        consume: &mut dyn FnMut(Activation, usize) -> Result<()>,
        micro_batches: usize,
        device: &Device,
    ) -> Result<()> {
        self.forward_checked(
            &|d| stage.accepts(d),
            &mut |x, _| stage.forward(x),
            inputs,
            consume,
            micro_batches,
            device,
        )
    }

    /// [`Pipeline::forward`] with any function as this rank's stage (`apply(input,
    /// micro_batch)`): profiling passes, stages that are not one module.
    pub fn forward_with(
        &mut self,
        apply: &mut dyn FnMut(Activation, usize) -> Result<Activation>,
        inputs: &mut dyn FnMut(usize) -> Activation,
        consume: &mut dyn FnMut(Activation, usize) -> Result<()>,
        micro_batches: usize,
        device: &Device,
    ) -> Result<()> {
        self.forward_checked(&|_| Ok(()), apply, inputs, consume, micro_batches, device)
    }

    /// [`Pipeline::forward_with`], refusing a received activation `accepts` refuses.
    fn forward_checked(
        &mut self,
        accepts: &dyn Fn(&[usize]) -> std::result::Result<(), String>,
        apply: &mut dyn FnMut(Activation, usize) -> Result<Activation>,
        inputs: &mut dyn FnMut(usize) -> Activation,
        consume: &mut dyn FnMut(Activation, usize) -> Result<()>,
        micro_batches: usize,
        device: &Device,
    ) -> Result<()> {
        let step = self.step;
        self.step += 1;
        for m in 0..micro_batches {
            let x = if self.is_first() {
                inputs(m)
            } else {
                let data = self.recv(self.stage - 1, tag(step, m, true), "pipeline forward")?;
                activation(self.check_input(data, m, accepts)?, device)
            };
            let y = apply(x, m).map_err(|e| {
                mismatch(
                    "pipeline forward",
                    format!("stage {} on micro-batch {m}: {e}", self.stage),
                )
            })?;
            if self.is_last() {
                consume(y, m)?;
            } else {
                self.send(self.stage + 1, tag(step, m, true), y.data())?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
