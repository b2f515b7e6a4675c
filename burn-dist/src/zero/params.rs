//! ZeRO stage 3's parameters: this rank's segment of every bucket held by the optimizer, and a
//! run of buckets gathered whole when a unit needs its values.

use super::step::step_mismatch;
use super::*;

impl ZeroOptimizer {
    /// Cuts the buckets at the units' boundaries: `counts` is each unit's number of trainable
    /// tensors, in order (their sum the optimizer's tensors), so that no bucket holds two
    /// units' tensors and a unit's parameters are gathered by whole buckets of its own. Before
    /// any state or parameter is held (right after [`Self::new`]); every rank alike.
    pub fn cut_at_units(mut self, counts: &[usize]) -> Result<Self> {
        let n: usize = counts.iter().sum();
        if n != self.tensors.len() {
            return Err(DistError::Config(format!(
                "units of {n} trainable tensors in all for a sharded optimizer of {}",
                self.tensors.len()
            )));
        }
        if self.updates > 0 || !self.params.is_empty() || self.state.iter().any(|s| !s.is_empty()) {
            return Err(DistError::Config(
                "the buckets are cut at the units before the optimizer holds any state".into(),
            ));
        }
        let cuts: Vec<usize> = counts
            .iter()
            .scan(0, |at, c| {
                let start = *at;
                *at += c;
                Some(start)
            })
            .collect();
        self.cut(&cuts);
        Ok(self)
    }

    /// Stage 3: takes this rank's segment of every bucket from `source` (the values, the same on
    /// every rank) and holds it from now on; the steps update it in place and gather nothing,
    /// so the caller lets the module's own values go.
    pub fn hold_params(&mut self, source: &mut dyn StepSource) -> Result<()> {
        if self.stage != Stage::Three {
            return Err(DistError::Config(format!(
                "ZeRO stage {} keeps the whole parameters on every rank: only stage 3 holds a \
                 shard of them",
                self.stage.number()
            )));
        }
        if self.replica.is_some() {
            return Err(DistError::Config(
                "ZeRO stage 3 with a replica of the next rank's state is not built".into(),
            ));
        }
        self.params = (0..self.buckets.len())
            .map(|b| source.values(self.segment(b, self.rank)))
            .collect();
        for (b, p) in self.params.iter().enumerate() {
            let want = self.segment(b, self.rank).len();
            if p.len() != want {
                let got = p.len();
                self.params.clear();
                return Err(step_mismatch(format!(
                    "{got} values read for a segment of {want} (bucket {b})"
                )));
            }
        }
        Ok(())
    }

    /// Whether this rank holds its shard of the parameters (stage 3, after
    /// [`Self::hold_params`]): steps then update it and deliver nothing.
    pub fn holds_params(&self) -> bool {
        !self.params.is_empty()
    }

    /// The parameter values this rank holds (stage 3), for logs and memory checks.
    pub fn params_len(&self) -> usize {
        self.params.iter().map(Vec::len).sum()
    }

    /// The buckets that hold exactly tensors `tensors` (a unit's, when the buckets are cut at
    /// the units): an error where a bucket holds tensors inside and outside the range.
    pub fn buckets_of(&self, tensors: Range<usize>) -> Result<Range<usize>> {
        let first = self
            .buckets
            .iter()
            .position(|b| b.tensors.start == tensors.start);
        let last = self
            .buckets
            .iter()
            .position(|b| b.tensors.end == tensors.end);
        match (first, last) {
            (Some(f), Some(l)) if f <= l => Ok(f..l + 1),
            _ if tensors.is_empty() => Ok(0..0),
            _ => Err(DistError::Config(format!(
                "tensors {tensors:?} do not make whole buckets (are the buckets cut at the \
                 units? `ZeroOptimizer::cut_at_units`)"
            ))),
        }
    }

    /// Stage 3: tensors `tensors`' values, whole, from every rank's segments, bucket by bucket
    /// to `deliver` (their indices and values, as [`Self::step_with`] hands them over). Every
    /// rank calls it alike, with the same range (an all-gather per bucket).
    pub fn gather_params(
        &self,
        comm: &Communicator,
        tensors: Range<usize>,
        deliver: &mut dyn FnMut(Range<usize>, Vec<Vec<f32>>) -> Result<()>,
    ) -> Result<()> {
        if !self.holds_params() {
            return Err(DistError::Config(
                "gathering parameters from a sharded optimizer that holds none (stage 3 \
                 `hold_params` first)"
                    .into(),
            ));
        }
        for b in self.buckets_of(tensors)? {
            let gathered = self.all_gather(comm, b, &self.params[b])?;
            deliver(
                self.buckets[b].tensors.clone(),
                self.split_bucket(b, gathered),
            )?;
        }
        Ok(())
    }

    /// Stage 3: the bucket that holds trainable tensor `tensor`, gathered whole from every
    /// rank's segments: its tensors' indices and values. Every rank calls it alike, for the
    /// same tensor (an all-gather of one bucket: the finest gather, as fine as the buckets are
    /// cut).
    pub fn gather_params_bucket(
        &self,
        comm: &Communicator,
        tensor: usize,
    ) -> Result<(Range<usize>, Vec<Vec<f32>>)> {
        if !self.holds_params() {
            return Err(DistError::Config(
                "gathering parameters from a sharded optimizer that holds none (stage 3 \
                 `hold_params` first)"
                    .into(),
            ));
        }
        let b = self
            .buckets
            .partition_point(|bucket| bucket.tensors.end <= tensor);
        if b >= self.buckets.len() {
            return Err(DistError::Config(format!(
                "trainable tensor {tensor} of a sharded optimizer of {} tensors",
                self.tensors.len()
            )));
        }
        let gathered = self.all_gather(comm, b, &self.params[b])?;
        Ok((
            self.buckets[b].tensors.clone(),
            self.split_bucket(b, gathered),
        ))
    }

    /// Bucket `b`'s gathered values as its tensors' (one tensor: moved, not copied).
    pub(super) fn split_bucket(&self, b: usize, gathered: Vec<f32>) -> Vec<Vec<f32>> {
        let bucket = &self.buckets[b];
        if bucket.tensors.len() == 1 {
            return vec![gathered];
        }
        bucket
            .tensors
            .clone()
            .map(|t| {
                let (lo, hi) = (
                    self.offsets[t] - bucket.range.start,
                    self.offsets[t + 1] - bucket.range.start,
                );
                gathered[lo..hi].to_vec()
            })
            .collect()
    }
}
