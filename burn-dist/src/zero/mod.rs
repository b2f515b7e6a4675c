//! The sharded optimizer of data parallel (ZeRO stages 1 and 2, Rajbhandari et al., "ZeRO:
//! Memory Optimizations Toward Training Trillion Parameter Models", SC 2020).
//!
//! Every rank holds the whole model, as in plain data parallel, but only `1/N` of the
//! optimizer's state: the trainable values form one flat vector ([`crate::flat`]), cut into
//! buckets of consecutive tensors (data parallel's fusion buckets, 25 MB by default) and each
//! bucket into `N` near-equal segments (the cut of [`Communicator::reduce_scatter`]); rank `r`
//! owns segment `r` of every bucket, `1/N` of the values balanced by bytes. A step:
//!
//! 1. bucket by bucket, the gradients averaged over the ranks: stage 1 allreduces the bucket
//!    and keeps its segment; stage 2 reduce-scatters it, so each rank receives only its
//!    segment's sum;
//! 2. one verdict on whether they are finite (fp16 loss scaling), the same on every rank;
//! 3. each rank updates its segments with the whole optimizer ([`ShardOptimizer`]: SGD with
//!    momentum, Adam, AdamW, LARS, whose per-tensor norms are summed over the ranks first, so
//!    a tensor cut between ranks gets its whole norm);
//! 4. bucket by bucket, an all-gather of the updated segments: every rank ends with the same
//!    values.
//!
//! Working bucket by bucket keeps a rank's memory at the model, its shard and one bucket in
//! flight: a whole-vector buffer would cost what sharding saves (measured: `cargo bench --bench
//! memory`).
//!
//! The arithmetic is burn-optim's operation for operation, so a run equals plain data parallel
//! up to the order of the gradient sums (1e-5).
//!
//! Stage 3 shards the parameters too ([`Stage::Three`], `params.rs`): each rank keeps only its
//! segments' values ([`ZeroOptimizer::hold_params`]; the module's tensors are let go), updates
//! them in place with no all-gather at the end of the step, and gathers a unit's buckets
//! whole before that unit's forward and again before its backward
//! ([`ZeroOptimizer::gather_params`]; [`module::ShardedParams::gather`]), the buckets cut at the units'
//! boundaries ([`ZeroOptimizer::cut_at_units`]) so that a unit gathers only its own.
//!
//! The state leaves and enters as whole named vectors ([`ZeroOptimizer::gather_state`],
//! [`ZeroOptimizer::scatter_state`]): one vector per slot (`velocity`, or `moment_1` and
//! `moment_2`) over all the trainable values, gathered on one rank. A checkpoint written by `N`
//! ranks is therefore read by any number of ranks, each taking the shard its own world gives it.

use std::ops::Range;

pub mod module;
pub mod overlap;
mod params;
mod reduce;
mod state;
mod step;

pub use reduce::{BucketReducer, ReducedGradients};
pub use state::{StateLayout, StateReader, WholeState};

use crate::bucket::BucketPlan;
use crate::collective::{Communicator, ReduceOp};
use crate::flat::optim::ShardOptimizer;
use crate::split::segment;
use crate::{DistError, Result};

/// How much of the training state is sharded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Optimizer state: the whole gradient is allreduced, each rank keeps its shard of it.
    One,
    /// Optimizer state and gradients: the gradient is reduce-scattered.
    Two,
    /// Optimizer state, gradients and parameters: each rank holds its segments' values alone,
    /// updates them without gathering, and a unit's are gathered whole for its forward and its
    /// backward.
    Three,
}

impl Stage {
    /// `1` or `2`; anything else is an error naming the stages.
    pub fn from_number(n: u8) -> Result<Self> {
        match n {
            1 => Ok(Stage::One),
            2 => Ok(Stage::Two),
            3 => Ok(Stage::Three),
            _ => Err(DistError::Config(format!(
                "ZeRO stage {n}: the stages are 1 (optimizer state), 2 (and gradients) and 3 \
                 (and parameters)"
            ))),
        }
    }

    pub fn number(self) -> u8 {
        match self {
            Stage::One => 1,
            Stage::Two => 2,
            Stage::Three => 3,
        }
    }
}

/// What a step did.
#[derive(Debug, Clone, PartialEq)]
pub enum Stepped {
    /// Every trainable tensor's updated values, in order (the same on every rank).
    Updated(Vec<Vec<f32>>),
    /// The averaged gradients were not all finite, or the guard refused: nothing moved.
    Skipped,
}

/// Where a step reads what it needs: the gradients of a bucket's tensors (taken, so their
/// memory can go as they are flattened) and the current values of a range of the vector.
pub trait StepSource {
    /// Tensors `tensors` (indices in the trainable order) gradients, concatenated.
    fn grads(&mut self, tensors: Range<usize>) -> Vec<f32>;
    /// Values `range` of the whole vector (the same on every rank).
    fn values(&mut self, range: Range<usize>) -> Vec<f32>;
    /// Tensors `tensors`' old values are needed no more (their segments are read, their new
    /// values are about to be gathered): a source that holds them lets them go now, so the
    /// old and new values of a bucket are never held at once. Nothing by default.
    fn release(&mut self, tensors: Range<usize>) {
        let _ = tensors;
    }
    /// How many values the source holds, where it knows without reading any (a module whose
    /// parameters are drawn as they are first read must not be read out of order): `None` by
    /// default, and then the last value is read to tell.
    fn value_count(&mut self) -> Option<usize> {
        None
    }
}

/// A [`StepSource`] over flat vectors (tests, and callers that hold the vector themselves).
pub struct FlatSource<'a> {
    pub grad: &'a [f32],
    pub values: &'a [f32],
    /// Each tensor's start in the vector, and the end (`tensors + 1` values).
    pub offsets: Vec<usize>,
}

impl StepSource for FlatSource<'_> {
    fn grads(&mut self, tensors: Range<usize>) -> Vec<f32> {
        self.grad[self.offsets[tensors.start]..self.offsets[tensors.end]].to_vec()
    }
    fn values(&mut self, range: Range<usize>) -> Vec<f32> {
        // What of `range` the vector has (a range past its end reads short, as a module's).
        let end = range.end.min(self.values.len());
        self.values[range.start.min(end)..end].to_vec()
    }
    fn value_count(&mut self) -> Option<usize> {
        Some(self.values.len())
    }
}

/// A run of consecutive tensors exchanged together (DDP's fusion buckets), cut among the ranks.
#[derive(Debug, Clone)]
struct Bucket {
    /// Its values in the whole vector.
    range: Range<usize>,
    /// Its tensors (indices); for a piece of a tensor cut by rows ([`ZeroOptimizer::cut_rows`])
    /// that tensor alone, `range` then covering part of it.
    tensors: Range<usize>,
}

/// This rank's shard of the optimizer.
///
/// The vector is cut twice: into buckets of about `bucket_bytes` (consecutive tensors, as
/// data parallel fuses gradients), and each bucket into `N` near-equal segments, rank `r`
/// owning segment `r` of every bucket: `1/N` of the values, balanced by bytes. A step works
/// bucket by bucket, so besides the model a rank holds its shard and one bucket in flight,
/// never a second copy of the whole vector.
#[derive(Clone)]
pub struct ZeroOptimizer {
    stage: Stage,
    rank: usize,
    world: usize,
    tensors: Vec<(String, usize)>,
    /// Each tensor's start in the vector, and the end.
    offsets: Vec<usize>,
    buckets: Vec<Bucket>,
    /// The buckets' size, bytes (a tensor larger than that has a bucket of its own).
    bucket_bytes: usize,
    /// Where buckets close besides their size ([`Self::cut_at_units`]), and the tensors that
    /// may be cut into pieces of whole rows, with their values per row ([`Self::cut_rows`]).
    cuts: Vec<usize>,
    rows: Vec<(usize, usize)>,
    whole: ShardOptimizer,
    /// Per bucket: the optimizer on this rank's segment, and its state there.
    mine: Vec<ShardOptimizer>,
    state: Vec<Vec<f32>>,
    updates: u64,
    /// A saved state of a subset of the tensors is taken, the others starting from zero.
    new_at_zero: bool,
    /// How the ranks' gradients combine: their mean (data parallel: every rank's is the mean
    /// over its own samples) or their sum (elastic: each already weighted by its share).
    reduce: ReduceOp,
    /// The next rank's segments held too, updated alike ([`ZeroOptimizer::with_replica`]).
    replica: Option<Replica>,
    /// Updates applied to this rank's segments: one more than `updates` while a step is
    /// between its local update and the end of its all-gather (see [`Self::applied`]).
    applied: u64,
    /// Stage 3: per bucket, this rank's segment of the parameters ([`Self::hold_params`];
    /// empty before, and in stages 1 and 2).
    params: Vec<Vec<f32>>,
    /// Clipping of each step's averaged gradient to this global L2 norm
    /// ([`ZeroOptimizer::with_clip_norm`]).
    clip_norm: Option<f64>,
    /// Where the squares are summed when the gradient reaches beyond this optimizer's ranks
    /// (a pipeline's stages: [`ZeroOptimizer::with_norm_over`]); `None`: the step's ranks.
    norm_over: Option<std::sync::Arc<Communicator>>,
}

/// A copy of the next rank's segments of the state, kept up to date by computing its update
/// too: should that rank fail, its state survives here.
#[derive(Clone)]
struct Replica {
    /// The rank whose segments these are.
    of: usize,
    mine: Vec<ShardOptimizer>,
    state: Vec<Vec<f32>>,
}

impl std::fmt::Debug for ZeroOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZeroOptimizer")
            .field("stage", &self.stage)
            .field("shard", &self.describe())
            .field("updates", &self.updates)
            .finish()
    }
}

impl ZeroOptimizer {
    /// Rank `comm.rank()`'s shard of `optimizer` (set for the whole vector of `tensors`: its
    /// decay ranges and, for LARS, its extents) over `comm.world()` ranks, in buckets of
    /// `bucket_bytes`.
    pub fn new(
        stage: Stage,
        tensors: &[(String, usize)],
        optimizer: ShardOptimizer,
        comm: &Communicator,
        bucket_bytes: usize,
    ) -> Result<Self> {
        let sizes: Vec<usize> = tensors.iter().map(|t| t.1).collect();
        let total: usize = sizes.iter().sum();
        let world = comm.world();
        if total == 0 {
            return Err(DistError::Config(
                "sharded optimizer: the model has no trainable values".into(),
            ));
        }
        let mut offsets = Vec::with_capacity(sizes.len() + 1);
        let mut at = 0;
        for s in &sizes {
            offsets.push(at);
            at += s;
        }
        offsets.push(at);
        let rank = comm.rank();
        let mut z = Self {
            stage,
            rank,
            world,
            tensors: tensors.to_vec(),
            offsets,
            whole: optimizer,
            mine: Vec::new(),
            state: Vec::new(),
            buckets: Vec::new(),
            bucket_bytes,
            cuts: Vec::new(),
            rows: Vec::new(),
            updates: 0,
            new_at_zero: false,
            reduce: ReduceOp::Mean,
            replica: None,
            applied: 0,
            params: Vec::new(),
            clip_norm: None,
            norm_over: None,
        };
        z.cut();
        Ok(z)
    }

    /// Cuts the vector into buckets of about `bucket_bytes`, a bucket also closing before
    /// each tensor of `self.cuts`, and each bucket among the ranks: this rank's optimizers, and
    /// an empty state. A tensor of `self.rows` larger than a bucket gets several buckets of its
    /// own, each a piece of whole rows of about a bucket's size (at least one row).
    fn cut(&mut self) {
        let sizes: Vec<usize> = self.tensors.iter().map(|t| t.1).collect();
        let offsets = &self.offsets;
        let cap = (self.bucket_bytes / std::mem::size_of::<f32>()).max(1);
        let mut buckets = Vec::new();
        for t in BucketPlan::with_cuts(&sizes, self.bucket_bytes, &self.cuts).buckets {
            let range = offsets[t.start]..offsets[t.end];
            let row = match t.len() {
                1 => self.rows.iter().find(|r| r.0 == t.start).map(|r| r.1),
                _ => None,
            };
            match row {
                Some(row) if row > 0 && range.len() > cap => {
                    let step = (cap / row).max(1) * row;
                    let mut at = range.start;
                    while at < range.end {
                        let end = (at + step).min(range.end);
                        buckets.push(Bucket {
                            range: at..end,
                            tensors: t.clone(),
                        });
                        at = end;
                    }
                }
                _ => buckets.push(Bucket { range, tensors: t }),
            }
        }
        self.buckets = buckets;
        self.state = vec![Vec::new(); self.buckets.len()];
        self.mine = (0..self.buckets.len())
            .map(|b| self.whole.restrict(self.segment(b, self.rank)))
            .collect();
    }

    /// Whether bucket `b` is a piece of a tensor cut by rows (not all of its tensor).
    fn is_piece(&self, b: usize) -> bool {
        let bucket = &self.buckets[b];
        bucket.range != (self.offsets[bucket.tensors.start]..self.offsets[bucket.tensors.end])
    }

    pub fn stage(&self) -> Stage {
        self.stage
    }

    /// Lets [`ZeroOptimizer::scatter_from_reader`] take a state saved for some of this
    /// optimizer's tensors (by name and length), the others starting from a zero state: the
    /// fine-tuning phase after a frozen one, whose state held the head alone. Zero is every
    /// rule's state before its first step; Adam and AdamW count the new tensors' steps from
    /// there ([`ShardOptimizer::born`]), as burn's optimizers count each tensor's own.
    pub fn with_new_tensors_at_zero(mut self, on: bool) -> Self {
        self.new_at_zero = on;
        self
    }

    /// Clips each step's averaged gradient to at most `max_norm` in global L2 norm, PyTorch's
    /// `clip_grad_norm_` rule (`max / (norm + 1e-6)` where that is below 1), the norm summed
    /// over every rank's segments (each value counted once, replicas aside). `None`: off.
    pub fn with_clip_norm(mut self, max_norm: Option<f64>) -> Self {
        self.clip_norm = max_norm;
        self
    }

    /// Clipping by a norm over more than this optimizer's ranks: each rank's squares of its own
    /// segments are summed over `job` instead of the step's ranks, every rank of `job` adding
    /// its own part of the whole gradient alike (a pipeline: each stage's replicas shard that
    /// stage's gradient, and the stages together make the model's). Every rank of `job` must
    /// add its part at the same step, in the same order as its other collectives on `job`.
    pub fn with_norm_over(mut self, job: std::sync::Arc<Communicator>) -> Self {
        self.norm_over = Some(job);
        self
    }

    /// Sums the ranks' gradients instead of averaging them: each rank's gradient is already
    /// weighted by its share of the global batch (elastic training's uneven shares).
    pub fn with_summed_gradients(mut self) -> Self {
        self.reduce = ReduceOp::Sum;
        self
    }

    /// Also holds and updates the next rank's segments of the state (rank `r` holds `r + 1`'s,
    /// the last rank holds rank 0's): twice the state of a plain shard, and the update of two
    /// segments a step, so that the state of any one rank, or of several no two of them
    /// neighbours, outlives it ([`Self::reshard_from`]). Stage 2 then sends each rank's
    /// averaged gradient segment to the rank before it too. No effect on a world of one.
    pub fn with_replica(mut self) -> Self {
        if self.world >= 2 {
            let of = (self.rank + 1) % self.world;
            self.replica = Some(Replica {
                of,
                mine: (0..self.buckets.len())
                    .map(|b| self.whole.restrict(self.segment(b, of)))
                    .collect(),
                state: vec![Vec::new(); self.buckets.len()],
            });
        }
        self
    }

    /// Per tensor: the update count when it joined ([`ShardOptimizer::born`]; empty: all 0).
    pub fn born(&self) -> Vec<u64> {
        if self.whole.born.iter().all(|&b| b == 0) {
            Vec::new()
        } else {
            self.whole.born.clone()
        }
    }

    /// Sets [`Self::born`] on the optimizer of every segment this rank updates.
    fn set_born(&mut self, born: Vec<u64>) {
        let born = if born.iter().all(|&b| b == 0) {
            Vec::new()
        } else {
            born
        };
        for o in self.mine.iter_mut().chain(
            self.replica
                .as_mut()
                .map_or(&mut [][..], |r| &mut r.mine[..]),
        ) {
            o.born = born.clone();
        }
        self.whole.born = born;
    }

    /// Whether this rank holds a replica of the next rank's segments.
    pub fn has_replica(&self) -> bool {
        self.replica.is_some()
    }

    /// Updates applied to this rank's segments: [`Self::updates`], or one more when a step
    /// failed after its local update, in its all-gather (a copy taken before the step then
    /// holds the state after it, which the ranks that finished the step hold too).
    pub fn applied(&self) -> u64 {
        self.applied
    }

    /// Counts the local update of a step that failed in its all-gather as taken: the state a
    /// rank adopts when another rank finished that step.
    pub fn confirm_applied(&mut self) {
        self.updates = self.applied;
    }

    /// The world this shard was cut for, and its rank there.
    pub fn world(&self) -> (usize, usize) {
        (self.world, self.rank)
    }

    /// Rank `r`'s segment of bucket `b`, in the whole vector.
    fn segment(&self, b: usize, r: usize) -> Range<usize> {
        self.segment_in(b, r, self.world)
    }

    /// Rank `r`'s segment of bucket `b` in a world of `world`.
    fn segment_in(&self, b: usize, r: usize, world: usize) -> Range<usize> {
        let range = &self.buckets[b].range;
        let (lo, hi) = segment(range.len(), world, r);
        range.start + lo..range.start + hi
    }

    /// Bucket `b`'s cut among the ranks, relative to its start (`world + 1` bounds).
    fn bounds(&self, b: usize) -> Vec<usize> {
        let len = self.buckets[b].range.len();
        // segment(len, n, n).0 is len: the last bound.
        (0..=self.world)
            .map(|r| segment(len, self.world, r).0)
            .collect()
    }

    /// Values in the whole vector.
    pub fn total(&self) -> usize {
        self.offsets[self.offsets.len() - 1]
    }

    /// The values this rank updates (its segment of every bucket).
    pub fn shard_len(&self) -> usize {
        (0..self.buckets.len())
            .map(|b| self.segment(b, self.rank).len())
            .sum()
    }

    /// Updates taken (skipped steps not counted).
    pub fn updates(&self) -> u64 {
        self.updates
    }

    /// The optimizer state this rank holds, in values (what sharding saves: a rank of plain
    /// data parallel holds the whole vector's).
    pub fn state_len(&self) -> usize {
        self.state.iter().map(Vec::len).sum::<usize>()
            + self
                .replica
                .as_ref()
                .map_or(0, |r| r.state.iter().map(Vec::len).sum())
    }

    /// The size the vector's buckets were cut to, bytes (a tensor larger than that has a
    /// bucket of its own).
    pub fn bucket_bytes(&self) -> usize {
        self.bucket_bytes
    }

    /// A description of this rank's shard, for logs.
    pub fn describe(&self) -> String {
        format!(
            "{} of {} values (segment {} of {} in each of {} buckets){}",
            self.shard_len(),
            self.total(),
            self.rank,
            self.world,
            self.buckets.len(),
            match &self.replica {
                Some(r) => format!(", and a replica of segment {}", r.of),
                None => String::new(),
            }
        )
    }

    /// Bucket `b` whole on every rank from each rank's segment: the segments differ by at most
    /// one value, so each is padded to the longest for the ring and the padding squeezed out in
    /// place.
    fn all_gather(&self, comm: &Communicator, b: usize, mine: &[f32]) -> Result<Vec<f32>> {
        let bounds = self.bounds(b);
        let longest = bounds.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
        let mut padded = mine.to_vec();
        padded.resize(longest, 0.0);
        let mut whole = comm.all_gather(&padded)?;
        drop(padded);
        let mut at = 0;
        for r in 0..self.world {
            let len = bounds[r + 1] - bounds[r];
            whole.copy_within(r * longest..r * longest + len, at);
            at += len;
        }
        whole.truncate(at);
        Ok(whole)
    }
}

#[cfg(test)]
mod tests;
