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
        self.cuts = cuts;
        self.cut();
        Ok(self)
    }

    /// Stage 3: lets each tensor of `rows` (its index, and its values per row: a matrix of
    /// whole rows, a convolution's weight one of output channels) that is larger than a bucket be cut into pieces of whole rows, a bucket each,
    /// of about a bucket's size: such a tensor is then gathered, and its gradient reduced, a
    /// piece at a time ([`Self::pieces_of`], [`Self::gather_piece`]; a linear layer's product
    /// or a convolution taken a block of rows at a time), so that no step holds it whole. The vector, and so the
    /// state as it is saved, is the same. Before any state or parameter is held, after
    /// [`Self::cut_at_units`]; every rank alike.
    pub fn cut_rows(mut self, rows: &[(usize, usize)]) -> Result<Self> {
        if self.stage != Stage::Three {
            return Err(DistError::Config(format!(
                "tensors cut into pieces of rows are stage 3's (ZeRO stage {} keeps the whole \
                 parameters)",
                self.stage.number()
            )));
        }
        if self.updates > 0 || !self.params.is_empty() || self.state.iter().any(|s| !s.is_empty()) {
            return Err(DistError::Config(
                "tensors are cut into pieces before the optimizer holds any state".into(),
            ));
        }
        for &(t, row) in rows {
            let Some((name, len)) = self.tensors.get(t) else {
                return Err(DistError::Config(format!(
                    "tensor {t} cut into rows, of {} trainable tensors",
                    self.tensors.len()
                )));
            };
            if row == 0 || len % row != 0 {
                return Err(DistError::Config(format!(
                    "tensor {t} ({name}, {len} values) cut into rows of {row} values"
                )));
            }
        }
        self.rows = rows.to_vec();
        self.cut();
        Ok(self)
    }

    /// How many of `rows`' tensors ([`Self::cut_rows`]'s list) are larger than a bucket: those
    /// it would cut.
    pub fn large_tensors(&self, rows: &[(usize, usize)]) -> usize {
        let cap = (self.bucket_bytes / std::mem::size_of::<f32>()).max(1);
        rows.iter()
            .filter(|(t, _)| self.tensors.get(*t).is_some_and(|(_, len)| *len > cap))
            .count()
    }

    /// The pieces trainable tensor `tensor` is cut into ([`Self::cut_rows`]): each one's values
    /// within the tensor, in order; `None` for a tensor held in one bucket.
    pub fn pieces_of(&self, tensor: usize) -> Option<Vec<Range<usize>>> {
        let start = *self.offsets.get(tensor)?;
        let pieces: Vec<Range<usize>> = self
            .buckets
            .iter()
            .enumerate()
            .filter(|(b, bucket)| bucket.tensors.start == tensor && self.is_piece(*b))
            .map(|(_, bucket)| bucket.range.start - start..bucket.range.end - start)
            .collect();
        (!pieces.is_empty()).then_some(pieces)
    }

    /// Stage 3: piece `k` of trainable tensor `tensor` ([`Self::pieces_of`]), gathered whole
    /// from every rank's segments. Every rank calls it alike (an all-gather of the piece's
    /// bucket).
    pub fn gather_piece(&self, comm: &Communicator, tensor: usize, k: usize) -> Result<Vec<f32>> {
        self.check_holds()?;
        let b = self
            .buckets
            .iter()
            .enumerate()
            .filter(|(b, bucket)| bucket.tensors.start == tensor && self.is_piece(*b))
            .nth(k)
            .map(|(b, _)| b)
            .ok_or_else(|| {
                DistError::Config(format!(
                    "piece {k} of trainable tensor {tensor}, which has {} pieces",
                    self.pieces_of(tensor).map_or(0, |p| p.len())
                ))
            })?;
        self.all_gather(comm, b, &self.params[b])
    }

    /// An error where this rank holds no parameters to gather.
    fn check_holds(&self) -> Result<()> {
        match self.holds_params() {
            true => Ok(()),
            false => Err(DistError::Config(
                "gathering parameters from a sharded optimizer that holds none (stage 3 \
                 `hold_params` first)"
                    .into(),
            )),
        }
    }

    /// Stage 3: takes this rank's segment of every bucket from `source` (the values, the same on
    /// every rank) and holds it from now on; the steps update it in place and gather nothing,
    /// so the caller lets the module's own values go.
    pub fn hold_params(&mut self, source: &mut dyn StepSource) -> Result<()> {
        self.check_can_hold()?;
        self.params = (0..self.buckets.len())
            .map(|b| source.values(self.segment(b, self.rank)))
            .collect();
        self.check_held()
    }

    /// [`Self::hold_params`] from `root`'s values: `root` reads one bucket at a time from its
    /// `source`, in the vector's order, hands each rank its segment
    /// ([`Communicator::scatter_from`]) and releases each tensor once its last bucket is out
    /// ([`StepSource::release`]); the other ranks' sources are not read. So every rank starts
    /// from one rank's parameters, as data parallel starts from rank 0's broadcast, without
    /// any rank holding more than a bucket of them beside its source (a broadcast of the whole
    /// model first held its largest tensor twice: VGG-16's 411 MB first classifier weight), and
    /// a root whose source makes each tensor's values as they are first read (Burn's lazy
    /// parameters) holds one tensor of them at a time. Every rank alike; a `root` whose source
    /// does not hold this optimizer's number of values fails every rank, naming it.
    pub fn hold_params_from(
        &mut self,
        comm: &Communicator,
        root: usize,
        source: &mut dyn StepSource,
    ) -> Result<()> {
        self.check_can_hold()?;
        let total = self.total();
        // The root's verdict first, so that every rank fails alike: its source's length.
        let mut verdict = [0f32];
        if comm.rank() == root {
            let fits = match source.value_count() {
                Some(len) => len == total,
                None => {
                    let last = source.values(total.saturating_sub(1)..total).len();
                    let beyond = source.values(total..total + 1).len();
                    (last, beyond) == (total.min(1), 0)
                }
            };
            if !fits {
                verdict[0] = 1.0;
            }
        }
        comm.broadcast(&mut verdict, root)?;
        if verdict[0] != 0.0 {
            return Err(step_mismatch(format!(
                "rank {root}'s parameters are not the {total} values this optimizer shards"
            )));
        }
        let mut held = Vec::with_capacity(self.buckets.len());
        for b in 0..self.buckets.len() {
            let whole = (comm.rank() == root).then(|| source.values(self.buckets[b].range.clone()));
            held.push(comm.scatter_from(root, whole.as_deref(), &self.bounds(b))?);
            if comm.rank() == root {
                // The bucket's tensors but one the next bucket goes on with (a tensor cut
                // into pieces of rows spans several).
                let tensors = self.buckets[b].tensors.clone();
                let end = match self.buckets.get(b + 1) {
                    Some(next) => next.tensors.start.clamp(tensors.start, tensors.end),
                    None => tensors.end,
                };
                source.release(tensors.start..end);
            }
        }
        self.params = held;
        self.check_held()
    }

    /// An error unless this optimizer may hold parameters (stage 3, no replica).
    fn check_can_hold(&self) -> Result<()> {
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
        Ok(())
    }

    /// An error (and nothing held) where a held segment is not its bucket's segment's length.
    fn check_held(&mut self) -> Result<()> {
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
            .rposition(|b| b.tensors.end == tensors.end);
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
    /// to `deliver` (their indices and values, as [`Self::step_with`] hands them over; a tensor
    /// cut into pieces once its last piece is gathered). Every rank calls it alike, with the
    /// same range (an all-gather per bucket).
    pub fn gather_params(
        &self,
        comm: &Communicator,
        tensors: Range<usize>,
        deliver: &mut dyn FnMut(Range<usize>, Vec<Vec<f32>>) -> Result<()>,
    ) -> Result<()> {
        self.gather_params_in(comm, tensors, true, deliver)
    }

    /// [`Self::gather_params`] without the tensors cut into pieces: those are gathered a
    /// piece at a time as a product needs them ([`Self::gather_piece`]), never whole.
    pub fn gather_params_but_pieces(
        &self,
        comm: &Communicator,
        tensors: Range<usize>,
        deliver: &mut dyn FnMut(Range<usize>, Vec<Vec<f32>>) -> Result<()>,
    ) -> Result<()> {
        self.gather_params_in(comm, tensors, false, deliver)
    }

    fn gather_params_in(
        &self,
        comm: &Communicator,
        tensors: Range<usize>,
        pieces: bool,
        deliver: &mut dyn FnMut(Range<usize>, Vec<Vec<f32>>) -> Result<()>,
    ) -> Result<()> {
        self.check_holds()?;
        let mut pieced: Vec<f32> = Vec::new();
        for b in self.buckets_of(tensors)? {
            if !pieces && self.is_piece(b) {
                continue;
            }
            let gathered = self.all_gather(comm, b, &self.params[b])?;
            let bucket = &self.buckets[b];
            if self.is_piece(b) {
                if pieced.is_empty() {
                    let t = bucket.tensors.start;
                    pieced.reserve_exact(self.offsets[t + 1] - self.offsets[t]);
                }
                pieced.extend_from_slice(&gathered);
                if bucket.range.end != self.offsets[bucket.tensors.end] {
                    continue;
                }
                deliver(bucket.tensors.clone(), vec![std::mem::take(&mut pieced)])?;
                continue;
            }
            deliver(bucket.tensors.clone(), self.split_bucket(b, gathered))?;
        }
        Ok(())
    }

    /// Stage 3: the bucket that holds trainable tensor `tensor`, gathered whole from every
    /// rank's segments: its tensors' indices and values. Every rank calls it alike, for the
    /// same tensor (an all-gather of one bucket: the finest gather, as fine as the buckets are
    /// cut). An error for a tensor cut into pieces ([`Self::gather_piece`]).
    pub fn gather_params_bucket(
        &self,
        comm: &Communicator,
        tensor: usize,
    ) -> Result<(Range<usize>, Vec<Vec<f32>>)> {
        self.check_holds()?;
        let b = self
            .buckets
            .partition_point(|bucket| bucket.tensors.end <= tensor);
        if b >= self.buckets.len() {
            return Err(DistError::Config(format!(
                "trainable tensor {tensor} of a sharded optimizer of {} tensors",
                self.tensors.len()
            )));
        }
        if self.is_piece(b) {
            return Err(DistError::Config(format!(
                "trainable tensor {tensor} ({}) is cut into pieces of rows: it is gathered a \
                 piece at a time",
                self.tensors[tensor].0
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
