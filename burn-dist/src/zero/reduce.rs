//! A step's gradients averaged bucket by bucket into each rank's segments: the first half of
//! [`ZeroOptimizer::step_with`], apart so that it can run while the backward pass goes on
//! ([`super::overlap::ShardedExchange`]: each bucket as soon as its gradients exist).

use super::*;

/// How a step's gradient buckets are reduced to this rank's segments: the buckets, the cut
/// among the ranks, the stage and the operation. A copy of the optimizer's plan that another
/// thread can own ([`ZeroOptimizer::reducer`]).
#[derive(Debug, Clone)]
pub struct BucketReducer {
    stage: Stage,
    rank: usize,
    world: usize,
    reduce: ReduceOp,
    /// Per bucket: its tensors (indices) and its values in the whole vector.
    buckets: Vec<(Range<usize>, Range<usize>)>,
    /// Each tensor's start in the vector, and the end.
    offsets: Vec<usize>,
    /// The rank whose segments this rank holds a replica of.
    replica_of: Option<usize>,
}

/// A step's averaged gradients: this rank's segment of each bucket, its replica's segments,
/// and whether all of them are finite. Made by [`ZeroOptimizer::reduce_gradients`] or, during
/// the backward pass, by [`super::overlap::ShardedExchange`]; spent by
/// [`ZeroOptimizer::step_reduced`].
#[derive(Debug)]
pub struct ReducedGradients {
    pub(super) grads: Vec<Vec<f32>>,
    pub(super) theirs: Vec<Vec<f32>>,
    pub(super) finite: bool,
}

impl BucketReducer {
    /// The number of buckets.
    pub fn buckets(&self) -> usize {
        self.buckets.len()
    }

    /// Bucket `b`'s tensors (indices in the trainable order).
    pub fn tensors(&self, b: usize) -> Range<usize> {
        self.buckets[b].0.clone()
    }

    /// Bucket `b`'s values within its tensor where it is a piece of one (a tensor cut by rows:
    /// [`ZeroOptimizer::cut_rows`]); `None` for a bucket of whole tensors.
    pub fn piece(&self, b: usize) -> Option<Range<usize>> {
        let (tensors, range) = &self.buckets[b];
        let start = self.offsets[tensors.start];
        let whole = start..self.offsets[tensors.end];
        (*range != whole).then(|| range.start - start..range.end - start)
    }

    /// Bucket `b`'s number of values.
    pub fn bucket_len(&self, b: usize) -> usize {
        self.buckets[b].1.len()
    }

    /// Tensor `t`'s number of values.
    pub fn tensor_len(&self, t: usize) -> usize {
        self.offsets[t + 1] - self.offsets[t]
    }

    /// The number of trainable tensors.
    pub fn tensor_count(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Rank `r`'s segment of bucket `b`, relative to the bucket's start.
    fn relative(&self, b: usize, r: usize) -> Range<usize> {
        let (lo, hi) = segment(self.buckets[b].1.len(), self.world, r);
        lo..hi
    }

    /// Bucket `b`'s gradient `g` (this rank's, the bucket's values concatenated) averaged (or
    /// summed) over the ranks: this rank's segment, and its replica's when it holds one. Every
    /// rank calls it for the same buckets in the same order.
    pub fn reduce(
        &self,
        comm: &Communicator,
        b: usize,
        mut g: Vec<f32>,
    ) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
        let (tensors, range) = &self.buckets[b];
        if g.len() != range.len() {
            return Err(DistError::Mismatch {
                op: "sharded optimizer step".into(),
                reason: format!(
                    "{} gradient values for bucket {b} of {} ({} tensors from index {})",
                    g.len(),
                    range.len(),
                    tensors.len(),
                    tensors.start
                ),
            });
        }
        Ok(match self.stage {
            Stage::One => {
                comm.allreduce(&mut g, self.reduce)?;
                let theirs = self.replica_of.map(|of| g[self.relative(b, of)].to_vec());
                g.truncate(self.relative(b, self.rank).end);
                g.drain(..self.relative(b, self.rank).start);
                (g, theirs)
            }
            Stage::Two | Stage::Three => {
                let mine = comm.reduce_scatter(g, self.reduce)?;
                let theirs = match self.replica_of {
                    Some(of) => Some(comm.shift_down(&mine, self.relative(b, of).len())?),
                    None => None,
                };
                (mine, theirs)
            }
        })
    }
}

impl ReducedGradients {
    /// Room for `buckets` buckets' segments, all finite so far.
    pub(super) fn with_capacity(buckets: usize) -> Self {
        Self {
            grads: Vec::with_capacity(buckets),
            theirs: Vec::new(),
            finite: true,
        }
    }

    /// The next bucket's segments, in bucket order.
    pub(super) fn push(&mut self, mine: Vec<f32>, theirs: Option<Vec<f32>>) {
        self.finite &= mine.iter().all(|x| x.is_finite());
        self.grads.push(mine);
        self.theirs.extend(theirs);
    }

    /// Buckets held.
    pub fn buckets(&self) -> usize {
        self.grads.len()
    }
}

impl ZeroOptimizer {
    /// This optimizer's plan for reducing a step's gradients, for another thread to run
    /// ([`super::overlap::ShardedExchange`]).
    pub fn reducer(&self) -> BucketReducer {
        BucketReducer {
            stage: self.stage,
            rank: self.rank,
            world: self.world,
            reduce: self.reduce,
            buckets: self
                .buckets
                .iter()
                .map(|b| (b.tensors.clone(), b.range.clone()))
                .collect(),
            offsets: self.offsets.clone(),
            replica_of: self.replica.as_ref().map(|r| r.of),
        }
    }

    /// Each bucket's gradient from `source`, averaged over the ranks: this rank's segment of
    /// it (and its replica's), and whether every value of those is finite.
    pub fn reduce_gradients(
        &self,
        comm: &Communicator,
        source: &mut dyn StepSource,
    ) -> Result<ReducedGradients> {
        let reducer = self.reducer();
        let mut reduced = ReducedGradients::with_capacity(self.buckets.len());
        // A tensor cut into pieces: its gradient taken once, each piece copied out of it.
        let mut whole: Option<(usize, Vec<f32>)> = None;
        for (b, bucket) in self.buckets.iter().enumerate() {
            let g = match reducer.piece(b) {
                None => source.grads(bucket.tensors.clone()),
                Some(piece) => {
                    let t = bucket.tensors.start;
                    if whole.as_ref().is_none_or(|w| w.0 != t) {
                        whole = Some((t, source.grads(bucket.tensors.clone())));
                    }
                    let g = whole.as_ref().map_or(&[][..], |w| &w.1[..]);
                    let g = g.get(piece).map(<[f32]>::to_vec).unwrap_or_default();
                    if bucket.range.end == self.offsets[t + 1] {
                        whole = None;
                    }
                    g
                }
            };
            let (mine, theirs) = reducer.reduce(comm, b, g)?;
            reduced.push(mine, theirs);
        }
        Ok(reduced)
    }
}
