//! One step of the sharded optimizer: the gradients reduced to each rank's segments, one verdict
//! on their finiteness, LARS's norms over every segment, the segments' updates on every core,
//! and every tensor gathered whole again.

use super::*;

impl ZeroOptimizer {
    /// One step. `source` gives each bucket's gradient (this rank's mean over its own
    /// samples; every rank holds the same number, as data parallel splits the global batch
    /// evenly) and the current values of this rank's segments (the same on every rank); `lr` is
    /// the schedule's rate. `take(finite)` decides, with whether every averaged gradient value
    /// is finite, whether to update (the same on every rank, since `finite` is agreed first).
    /// Every rank must call it alike.
    pub fn step(
        &mut self,
        comm: &Communicator,
        source: &mut dyn StepSource,
        lr: f32,
        take: &mut dyn FnMut(bool) -> bool,
    ) -> Result<Stepped> {
        let mut out: Vec<Vec<f32>> = vec![Vec::new(); self.tensors.len()];
        let stepped = self.step_with(comm, source, lr, take, &mut |tensors, values| {
            for (t, v) in tensors.zip(values) {
                out[t] = v;
            }
            Ok(())
        })?;
        Ok(if stepped {
            Stepped::Updated(out)
        } else {
            Stepped::Skipped
        })
    }

    /// [`Self::step`], handing each bucket's updated tensors to `deliver` (their indices in
    /// the trainable order and their values, each whole) as soon as the bucket's all-gather
    /// ends, instead of returning them all at the end: a caller that puts them in place at
    /// once lets the old values go bucket by bucket, and the step never holds a second copy of
    /// the model. Whether it updated (`false`: skipped, `deliver` never called).
    pub fn step_with(
        &mut self,
        comm: &Communicator,
        source: &mut dyn StepSource,
        lr: f32,
        take: &mut dyn FnMut(bool) -> bool,
        deliver: &mut dyn FnMut(Range<usize>, Vec<Vec<f32>>) -> Result<()>,
    ) -> Result<bool> {
        // 1. Each bucket's averaged gradient, this rank's segment kept.
        let reduced = self.reduce_gradients(comm, source)?;
        self.step_reduced(comm, reduced, source, lr, take, deliver)
    }

    /// [`Self::step_with`] from gradients already reduced to this rank's segments
    /// ([`Self::reduce_gradients`], or [`super::overlap::ShardedExchange`] during the backward
    /// pass): `source` gives the values only.
    pub fn step_reduced(
        &mut self,
        comm: &Communicator,
        reduced: ReducedGradients,
        source: &mut dyn StepSource,
        lr: f32,
        take: &mut dyn FnMut(bool) -> bool,
        deliver: &mut dyn FnMut(Range<usize>, Vec<Vec<f32>>) -> Result<()>,
    ) -> Result<bool> {
        let ReducedGradients {
            mut grads,
            mut theirs,
            finite,
        } = reduced;
        if grads.len() != self.buckets.len()
            || theirs.len() != self.replica.as_ref().map_or(0, |_| self.buckets.len())
        {
            return Err(step_mismatch(format!(
                "{} reduced buckets ({} replica segments) for {} buckets",
                grads.len(),
                theirs.len(),
                self.buckets.len()
            )));
        }
        // 2. One verdict for the job.
        let mut verdict = [if finite { 0.0 } else { 1.0 }];
        comm.allreduce(&mut verdict, ReduceOp::Sum)?;
        if !take(verdict[0] == 0.0) {
            return Ok(false);
        }
        if let Some(max) = self.clip_norm {
            self.clip(comm, max, &mut grads, &mut theirs)?;
        }
        if self.replica.is_none() && !self.whole.needs_norms() {
            return self.step_bucket_by_bucket(comm, grads, source, lr, deliver);
        }
        // 3. The segments' values, and LARS's norms summed over every rank's segments.
        let mut values: Vec<Vec<f32>> = (0..self.buckets.len())
            .map(|b| self.segment_values(b, source))
            .collect();
        for (b, (v, g)) in values.iter().zip(&grads).enumerate() {
            same_segment(b, v, g)?;
        }
        let norms = self.summed_norms(comm, &values, &grads)?;
        // 4. This rank's update of every bucket's segment (the buckets are independent: spread
        //    over the cores), then bucket by bucket every rank's segment to every rank.
        // The replica's segments: updated alike, their values dropped (the all-gather brings
        // the owner's, the same).
        let mut replica_values: Vec<Vec<f32>> = match &self.replica {
            Some(r) => (0..self.buckets.len())
                .map(|b| source.values(self.segment(b, r.of)))
                .collect(),
            None => Vec::new(),
        };
        let mut work: Vec<Update<'_>> = self
            .mine
            .iter()
            .zip(values.iter_mut())
            .zip(grads.drain(..))
            .zip(self.state.iter_mut())
            .collect();
        if let Some(r) = self.replica.as_mut() {
            work.extend(
                r.mine
                    .iter()
                    .zip(replica_values.iter_mut())
                    .zip(theirs.drain(..))
                    .zip(r.state.iter_mut()),
            );
        }
        update_on_every_core(work, self.updates, lr, norms.as_deref());
        drop(replica_values);
        self.applied = self.updates + 1;
        if self.holds_params() {
            self.params = values;
        } else {
            self.gather_tensors(comm, source, values, deliver)?;
        }
        self.updates += 1;
        self.applied = self.updates;
        Ok(true)
    }

    /// This rank's segment of bucket `b`'s current values: taken from the held parameters
    /// (stage 3: the step puts them back updated), else read from `source`.
    fn segment_values(&mut self, b: usize, source: &mut dyn StepSource) -> Vec<f32> {
        if self.holds_params() {
            std::mem::take(&mut self.params[b])
        } else {
            source.values(self.segment(b, self.rank))
        }
    }

    /// Scales the averaged gradient's segments (`grads`, this rank's; `theirs`, its replica's)
    /// so that the whole gradient's L2 norm, summed over every rank's own segments (of `comm`,
    /// or of [`ZeroOptimizer::with_norm_over`]'s job), is at most `max` (PyTorch's
    /// `clip_grad_norm_`).
    fn clip(
        &self,
        comm: &Communicator,
        max: f64,
        grads: &mut [Vec<f32>],
        theirs: &mut [Vec<f32>],
    ) -> Result<()> {
        let mine: f64 = grads
            .iter()
            .flatten()
            .map(|&x| f64::from(x) * f64::from(x))
            .sum();
        let mut total = [mine as f32];
        let over: &Communicator = self.norm_over.as_deref().unwrap_or(comm);
        over.allreduce(&mut total, ReduceOp::Sum)?;
        let norm = f64::from(total[0]).max(0.0).sqrt();
        let coef = max / (norm + 1e-6);
        if coef < 1.0 {
            // The scale as 1 / (1 / coef) in f32, as a caller dividing by the inverse applies it.
            let inv = 1.0 / (1.0 / coef) as f32;
            for x in grads.iter_mut().chain(theirs.iter_mut()).flatten() {
                *x *= inv;
            }
        }
        Ok(())
    }

    /// LARS's `[Σw², Σg²]` per tensor summed over every rank's segments (`None` for the
    /// rules that need no norms).
    fn summed_norms(
        &self,
        comm: &Communicator,
        values: &[Vec<f32>],
        grads: &[Vec<f32>],
    ) -> Result<Option<Vec<f32>>> {
        if !self.whole.needs_norms() {
            return Ok(None);
        }
        let mut n = vec![0f32; 2 * self.tensors.len().max(1)];
        for b in 0..self.buckets.len() {
            let partial = self.mine[b].partial_norms(&values[b], &grads[b]);
            for (o, x) in n.iter_mut().zip(partial) {
                *o += x;
            }
        }
        comm.allreduce(&mut n, ReduceOp::Sum)?;
        Ok(Some(n))
    }

    /// Each bucket's tensors' updated values, whole, from every rank's updated segments
    /// (`values`, this rank's), to `deliver` bucket by bucket (a bucket holds whole tensors).
    fn gather_tensors(
        &self,
        comm: &Communicator,
        source: &mut dyn StepSource,
        values: Vec<Vec<f32>>,
        deliver: &mut dyn FnMut(Range<usize>, Vec<Vec<f32>>) -> Result<()>,
    ) -> Result<()> {
        for (b, v) in values.into_iter().enumerate() {
            self.deliver_bucket(comm, source, b, v, deliver)?;
        }
        Ok(())
    }

    /// Steps 3 and 4 a bucket at a time, where no update needs another bucket (no norms, no
    /// replica): a segment's values are read, updated and gathered before the next bucket's
    /// are read, so the step never holds every segment's values and averaged gradient at once
    /// (1/N of the model each). The same operations, and collectives, as the other path.
    fn step_bucket_by_bucket(
        &mut self,
        comm: &Communicator,
        grads: Vec<Vec<f32>>,
        source: &mut dyn StepSource,
        lr: f32,
        deliver: &mut dyn FnMut(Range<usize>, Vec<Vec<f32>>) -> Result<()>,
    ) -> Result<bool> {
        self.applied = self.updates + 1;
        for (b, g) in grads.into_iter().enumerate() {
            let mut v = self.segment_values(b, source);
            same_segment(b, &v, &g)?;
            self.mine[b].step_at(self.updates, lr, &mut v, &g, &mut self.state[b], None);
            drop(g);
            if self.holds_params() {
                // Stage 3: the segment stays here, updated; nothing is gathered.
                self.params[b] = v;
            } else {
                self.deliver_bucket(comm, source, b, v, deliver)?;
            }
        }
        self.updates += 1;
        self.applied = self.updates;
        Ok(true)
    }

    /// Bucket `b`'s tensors' updated values, whole, from every rank's updated segment (`v`,
    /// this rank's), to `deliver` (a bucket holds whole tensors).
    fn deliver_bucket(
        &self,
        comm: &Communicator,
        source: &mut dyn StepSource,
        b: usize,
        v: Vec<f32>,
        deliver: &mut dyn FnMut(Range<usize>, Vec<Vec<f32>>) -> Result<()>,
    ) -> Result<()> {
        // The old values go before the new ones come (the gathered buffer then takes the
        // memory they had).
        source.release(self.buckets[b].tensors.clone());
        let gathered = self.all_gather(comm, b, &v)?;
        drop(v);
        deliver(
            self.buckets[b].tensors.clone(),
            self.split_bucket(b, gathered),
        )
    }
}

/// One segment's update: its optimizer, values, averaged gradient and state.
type Update<'a> = (
    ((&'a ShardOptimizer, &'a mut Vec<f32>), Vec<f32>),
    &'a mut Vec<f32>,
);

/// Runs the segments' updates on every core (they are independent), largest first onto the
/// least loaded core.
fn update_on_every_core(mut work: Vec<Update<'_>>, updates: u64, lr: f32, norms: Option<&[f32]>) {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(work.len())
        .max(1);
    let mut groups: Vec<Vec<_>> = (0..threads).map(|_| Vec::new()).collect();
    let mut load = vec![0usize; threads];
    work.sort_by_key(|w| std::cmp::Reverse(w.0.1.len()));
    for w in work {
        let i = (0..threads).min_by_key(|&i| load[i]).unwrap_or(0);
        load[i] += w.0.1.len();
        groups[i].push(w);
    }
    std::thread::scope(|scope| {
        for group in groups {
            scope.spawn(move || {
                for (((o, v), g), state) in group {
                    o.step_at(updates, lr, v, &g, state, norms);
                }
            });
        }
    });
}

/// Bucket `b`'s segment values `v` read for its averaged gradient `g`: the same length.
fn same_segment(b: usize, v: &[f32], g: &[f32]) -> Result<()> {
    if v.len() == g.len() {
        return Ok(());
    }
    Err(step_mismatch(format!(
        "{} values read for a segment of {} (bucket {b})",
        v.len(),
        g.len()
    )))
}

pub(super) fn step_mismatch(reason: String) -> DistError {
    DistError::Mismatch {
        op: "sharded optimizer step".into(),
        reason,
    }
}
