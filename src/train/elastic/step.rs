//! Training in one world: steps with their control allreduce and commit, and the validation
//! at the end of each data epoch (the epoch's row; the rest is [`Epochs::run`]'s).

use super::*;
use burn::optim::GradientsParams;

/// What a step's members agreed on: the control vector, summed over the world (who asks to
/// leave, whether joiners wait, the step's loss, hits and samples, each member's speed).
pub(super) struct Control {
    values: Vec<f32>,
    world: usize,
}

impl Control {
    fn leaving(&self) -> Vec<usize> {
        (0..self.world).filter(|&r| self.values[r] > 0.5).collect()
    }
    fn joiners_wait(&self) -> bool {
        self.values[self.world] > 0.5
    }
    pub(super) fn loss(&self) -> f64 {
        f64::from(self.values[self.world + 1])
    }
    pub(super) fn hits(&self) -> f64 {
        f64::from(self.values[self.world + 2])
    }
    pub(super) fn samples(&self) -> f32 {
        self.values[self.world + 3]
    }
    fn speed(&self, r: usize) -> f32 {
        self.values[self.world + 4 + r]
    }
    pub(super) fn top5(&self) -> f64 {
        f64::from(self.values[2 * self.world + 4])
    }
    /// A multi-label step's outputs, every member's rows ([`ValScores::write_rows`]).
    fn scores(&self) -> &[f32] {
        &self.values[2 * self.world + 5..]
    }
}

/// One step's compute on this worker: its gradients (its shares' part of the global mean,
/// summed over the step's batches), its loss sum, hits and samples, the step's samples over
/// every worker, and the epoch position after the step.
struct Computed {
    grads: GradientsParams,
    loss_sum: f64,
    correct: f64,
    /// Samples with their class among the 5 highest scores (0 where top-5 does not apply).
    top5: f64,
    /// A multi-label step's outputs on this worker: each batch's, with the row of the step's
    /// control vector it starts at.
    scores: Vec<(usize, ValScores)>,
    mine: usize,
    total: usize,
    position: usize,
}

/// How a step ended: committed (with what the members agreed), or the world is left.
enum Stepped {
    Committed(Control),
    Stop(Interrupt),
}

impl<T: Trainee> ElasticRun<'_, T> {
    /// Steps in one world until the epoch's samples are done, a change is asked for, or a step
    /// fails.
    pub(super) fn steps(
        &mut self,
        world: &mut World,
        commit: &mut Commit<T::Model>,
        log: &mut dyn FnMut(&str),
    ) -> Result<Interrupt> {
        let mut stream: Option<(u64, u64, Stream<Input<T>>)> = None;
        loop {
            if commit.position as usize >= self.trainee.train_len() {
                self.report_exchange(world, commit, log);
                return Ok(Interrupt::EpochEnd);
            }
            // The stream of the rest of the epoch for the current world and shares.
            if stream
                .as_ref()
                .is_none_or(|(e, p, _)| *e != commit.epoch || *p != commit.position)
            {
                stream = Some((commit.epoch, commit.position, self.stream(world, commit)?));
            }
            let Some((_, at, s)) = stream.as_mut() else {
                continue;
            };
            let control = match self.step(world, commit, s, log)? {
                Stepped::Committed(control) => control,
                Stepped::Stop(interrupt) => return Ok(interrupt),
            };
            *at = commit.position;
            if let Some(interrupt) = self.change_asked(world, &control, log) {
                return Ok(interrupt);
            }
            if self.rebalance(world, commit, &control, log)? {
                stream = None;
            }
        }
    }

    /// Rank 0's line on the epoch's time in the exchange (--zero's exchange is inside its
    /// sharded step: not timed apart).
    fn report_exchange(
        &mut self,
        world: &World,
        commit: &Commit<T::Model>,
        log: &mut dyn FnMut(&str),
    ) {
        let line = self.exchange.report(commit.epoch as usize + 1);
        if let (0, None, Some(line)) = (world.rank(), &self.zero, line) {
            log(&line);
        }
    }

    /// One optimizer step: the compute, the control allreduce, the exchange and update, the
    /// commit. Nothing in `commit` changes unless the step completes.
    fn step(
        &mut self,
        world: &World,
        commit: &mut Commit<T::Model>,
        s: &mut Stream<Input<T>>,
        log: &mut dyn FnMut(&str),
    ) -> Result<Stepped> {
        let t = Instant::now();
        // --overlap: the exchange runs while the backward goes on, unit by unit (one backward
        // per step: --grad-accum is refused with it). The shares are weighted in the loss
        // already, so the exchange sums.
        // (What is handed over leaves unscaled, as `divide` leaves the rest.)
        let scale = commit.scaler.as_ref().map(|s| s.scale());
        let overlapped = match self.exchange.plan(&world.comm, scale) {
            Ok(o) => o,
            Err(e) => return Ok(Stepped::Stop(Interrupt::Failed(e.to_string()))),
        };
        let mut c = self.compute(world, commit, s)?;
        if self.faults.after_compute(commit.step) {
            LEAVE.store(true, Ordering::SeqCst);
        }
        // The step's compute, without the end of the exchange: a fast worker waiting for a
        // slow one's last buckets is not slow (--balance throughput reads this).
        let took = t.elapsed().as_secs_f64().max(1e-6);
        // --overlap: the last buckets, and whatever was not handed over; before the control
        // allreduce, since nothing else may use the communicator while it runs.
        if let Some(o) = overlapped
            && let Err(e) =
                self.exchange
                    .exchange(&commit.model, &mut c.grads, &world.comm, Some(o), log)
        {
            return Ok(Stepped::Stop(Interrupt::Failed(e.to_string())));
        }
        let rate = c.mine as f64 / took;
        self.speed = if self.speed > 0.0 {
            0.7 * self.speed + 0.3 * rate
        } else {
            rate
        };
        let rows = self.score_rows(&c)?;
        let control = match self.agree(world, &c, rows) {
            Ok(control) => control,
            Err(e) => return Ok(Stepped::Stop(Interrupt::Failed(e.to_string()))),
        };
        self.faults.in_step(commit.step);
        if control.samples() as usize != c.total {
            // Every member computes the shares from the same commit: a difference is a bug.
            return Err(HearthError::Training(format!(
                "step {}: the members trained on {} samples, the step has {}",
                commit.step + 1,
                control.samples(),
                c.total
            )));
        }
        if let Some(interrupt) = self.update(world, commit, c.grads)? {
            return Ok(Stepped::Stop(interrupt));
        }
        let w = world.size();
        let now = unix_now() - commit.start_unix;
        commit.worker_seconds += (now - commit.elapsed).max(0.0) * w as f64;
        commit.elapsed = now;
        commit.step += 1;
        commit.position = c.position as u64;
        commit.sums[0] += control.loss();
        commit.sums[1] += control.hits();
        commit.sums[2] += c.total as f64;
        commit.sums[3] += control.top5();
        if self.trainee.multi_label() {
            let classes = self.trainee.classes().len();
            commit.train_scores.read_rows(control.scores(), classes);
        }
        commit.world_log.push((commit.step, now, w));
        self.exchange.stepped(t.elapsed());
        self.log_step(world, commit, &control, log)?;
        if let Some(z) = self.zero.as_mut() {
            // Every member finished the step: the shard before it is no longer needed.
            let mut ack = [0f32];
            if let Err(e) = world.comm.allreduce(&mut ack, ReduceOp::Sum) {
                return Ok(Stepped::Stop(Interrupt::Failed(e.to_string())));
            }
            z.previous = None;
            z.pending = None;
        }
        Ok(Stepped::Committed(control))
    }

    /// The step's gradients on this worker: `--grad-accum K` global batches (fewer at the
    /// epoch's end), this worker's share of each; the sum of the K batch-mean gradients is the
    /// step's (burn-train's accumulation), so a membership change never splits a step. With
    /// fp16 the loss is multiplied by the committed scale and the gradients divided by it.
    fn compute(
        &mut self,
        world: &World,
        commit: &Commit<T::Model>,
        s: &mut Stream<Input<T>>,
    ) -> Result<Computed> {
        let n = self.trainee.train_len();
        let k = self.cfg.optim.grad_accum.unwrap_or(1).max(1);
        let mut acc = GradientsAccumulator::<T::Model>::new();
        let factor = commit
            .scaler
            .as_ref()
            .map_or(1.0, |s| s.loss_factor(self.faults.overflow_at()));
        let (mut loss_sum, mut correct, mut top5) = (0.0f64, 0.0f64, 0.0f64);
        let (mut mine, mut total) = (0usize, 0usize);
        let mut scored = Vec::new();
        let mut pos = commit.position as usize;
        for sub in 0..k {
            if pos >= n {
                break;
            }
            let (input, targets) = s
                .next()
                .ok_or_else(|| HearthError::Training("the loader ended early".into()))??;
            let part = targets.len();
            let global_part = step_len(n, pos, self.cfg.batch_size);
            let stream_at = commit.step * k as u64 + sub as u64;
            seed_stream(&self.device, self.cfg.seed, stream_at, world.rank());
            // This worker's share of the global batch's mean.
            let share = part as f32 / global_part.max(1) as f32 * factor;
            // A multi-label batch's outputs go in the step's rows from where this worker's
            // share of the global batch starts.
            let mut scores = self.trainee.multi_label().then(ValScores::default);
            let (grads, sums) = self.objective.train_batch_scored(
                &commit.model,
                input,
                &targets,
                share,
                scores.as_mut(),
            )?;
            if let Some(s) = scores {
                let first =
                    step_positions(n, pos, self.cfg.batch_size, &world.weights, world.rank())?;
                let start = first.first().map_or(0, |p| p - pos);
                scored.push((sub * self.cfg.batch_size + start, s));
            }
            loss_sum += sums.loss;
            correct += sums.hits;
            top5 += sums.top5;
            acc.accumulate(&commit.model, grads);
            mine += part;
            total += global_part;
            pos += global_part;
        }
        let mut grads = acc.grads();
        if let Some(s) = &commit.scaler {
            // Unscaled before the exchange, as data parallel sends them (an fp16 wire would
            // overflow on gradients still multiplied by the scale).
            divide(&commit.model, &mut grads, s.scale());
        }
        Ok(Computed {
            grads,
            loss_sum,
            correct,
            top5,
            scores: scored,
            mine,
            total,
            position: pos,
        })
    }

    /// The step's control vector, summed over the world: the same on every member afterwards.
    fn agree(
        &self,
        world: &World,
        c: &Computed,
        rows: Vec<f32>,
    ) -> std::result::Result<Control, DistError> {
        let w = world.size();
        let mut control = vec![0.0f32; 2 * w + 5];
        control.extend(rows);
        control[world.rank()] = f32::from(LEAVE.load(Ordering::SeqCst));
        if world.rank() == 0 && w < self.opts.max_workers && !self.join.waiting().is_empty() {
            control[w] = 1.0;
        }
        control[w + 1] = c.loss_sum as f32;
        control[w + 2] = c.correct as f32;
        control[w + 3] = c.mine as f32;
        control[w + 4 + world.rank()] = self.speed as f32;
        control[2 * w + 4] = c.top5 as f32;
        world.comm.allreduce(&mut control, ReduceOp::Sum)?;
        Ok(Control {
            values: control,
            world: w,
        })
    }

    /// A multi-label step's outputs for the control vector: a row for each sample of its K
    /// global batches, this worker's filled (every member fills its own; empty otherwise).
    fn score_rows(&self, c: &Computed) -> Result<Vec<f32>> {
        if !self.trainee.multi_label() {
            return Ok(Vec::new());
        }
        let rows = self.cfg.optim.grad_accum.unwrap_or(1).max(1) * self.cfg.batch_size;
        let mut out = vec![0.0f32; rows * ValScores::row_len(self.trainee.classes().len())];
        for (slot, s) in &c.scores {
            s.write_rows(&mut out, *slot)?;
        }
        Ok(out)
    }

    /// The exchange and the update into `commit` (its model, scaler and skipped count; with
    /// --zero the shard). `Some` when the world is left: nothing of the commit changed then.
    fn update(
        &mut self,
        world: &World,
        commit: &mut Commit<T::Model>,
        mut grads: GradientsParams,
    ) -> Result<Option<Interrupt>> {
        let mut scaler = commit.scaler.clone();
        let lr = self
            .rates
            .rate(commit.epoch as usize + 1, commit.step as usize);
        let update = Update {
            clip: self.cfg.optim.clip_grad,
            scaler: scaler.as_mut(),
        };
        if let Some(z) = self.zero.as_mut() {
            // --zero: the shard's step on a copy (the commit's shard stays as it was should
            // the step fail); the gradients are summed (the shares are weighted in the loss
            // already), one fp16 verdict for the job inside it. (On a copy of the model too,
            // which shares the commit's values: they stay until the step commits.)
            let mut next = z.current.clone();
            let model = commit.model.clone();
            match update.sharded(&mut next, lr, model, grads, &world.sharded, Ok) {
                Err(e) => {
                    // Failed in the all-gather after the local update: another member may
                    // have finished the step (see sharded.rs).
                    if next.applied() > next.updates() {
                        z.pending = Some(next);
                    }
                    return Ok(Some(Interrupt::Failed(e.to_string())));
                }
                Ok((model, true)) => {
                    let before = std::mem::replace(&mut z.current, next);
                    z.previous = Some((z.since, before));
                    z.since = commit.step + 1;
                    commit.model = model;
                    Self::average_step(commit);
                }
                Ok((_, false)) => commit.epoch_skipped += 1,
            }
            commit.scaler = scaler;
            return Ok(None);
        }
        // (--overlap: summed during the backward.)
        if !self.cfg.exchange.overlap
            && let Err(e) =
                self.exchange
                    .exchange(&commit.model, &mut grads, &world.comm, None, &mut |_| {})
        {
            return Ok(Some(Interrupt::Failed(e.to_string())));
        }
        // The commit: nothing above changed any state. Every member holds the summed
        // gradients whole, so its verdict and norm are the world's; a skipped step still
        // counts (its samples and the schedule go on).
        let model = commit.model.clone();
        let (model, stepped) = update.apply(model, lr, grads, &mut commit.optim, Ok, Ok)?;
        commit.model = model;
        match stepped {
            true => Self::average_step(commit),
            false => commit.epoch_skipped += 1,
        }
        commit.scaler = scaler;
        Ok(None)
    }

    /// After a committed step: the change its members asked for (leaving, or joiners
    /// waiting), if any.
    fn change_asked(
        &self,
        world: &World,
        control: &Control,
        log: &mut dyn FnMut(&str),
    ) -> Option<Interrupt> {
        let w = world.size();
        let mut leaving = control.leaving();
        if self.zero.is_some() && leaving.len() < w {
            // --zero: a worker's state lives on with it and the worker before it (its
            // replica), so two neighbours never leave in one change: the second asks again
            // after the next step (every member filters alike).
            let mut go: Vec<usize> = Vec::new();
            for &r in &leaving {
                let (before, after) = ((r + w - 1) % w, (r + 1) % w);
                if !go.contains(&before) && !go.contains(&after) {
                    go.push(r);
                }
            }
            if go.len() < leaving.len() && world.rank() == 0 {
                log(&format!(
                    "`exchange.zero`: of the workers asking to leave, {go:?} leave now (neighbours leave \
                     one change at a time)"
                ));
            }
            leaving = go;
        }
        (!leaving.is_empty() || control.joiners_wait()).then_some(Interrupt::Planned { leaving })
    }

    /// `--balance throughput`: every `REBALANCE_EVERY` steps, the global batch shared by the
    /// members' measured speeds; `true` when the shares changed (the stream is cut anew).
    fn rebalance(
        &self,
        world: &mut World,
        commit: &Commit<T::Model>,
        control: &Control,
        log: &mut dyn FnMut(&str),
    ) -> Result<bool> {
        let w = world.size();
        if self.opts.balance != Balance::Throughput
            || !commit.step.is_multiple_of(REBALANCE_EVERY)
            || !(0..w).all(|r| control.speed(r) > 0.0)
        {
            return Ok(false);
        }
        let speeds: Vec<f64> = (0..w).map(|r| f64::from(control.speed(r))).collect();
        if speeds == world.weights {
            return Ok(false);
        }
        let global = self.cfg.batch_size;
        let shares = burn_dist::elastic::shares(global, &speeds)?;
        if world.rank() == 0 && shares != burn_dist::elastic::shares(global, &world.weights)? {
            log(&format!(
                "shares of the global batch by throughput: {shares:?}"
            ));
        }
        world.weights = speeds;
        Ok(true)
    }

    /// This worker's batches for the rest of the epoch with the world's current shares.
    pub(super) fn stream(
        &self,
        world: &World,
        commit: &Commit<T::Model>,
    ) -> Result<Stream<Input<T>>> {
        let n = self.trainee.train_len();
        let order = self.trainee.order(commit.epoch);
        let mut batches = Vec::new();
        let mut at = commit.position as usize;
        while at < n {
            let positions =
                step_positions(n, at, self.cfg.batch_size, &world.weights, world.rank())?;
            batches.push(positions.into_iter().map(|p| order[p]).collect());
            at += step_len(n, at, self.cfg.batch_size);
        }
        Ok(self
            .trainee
            .train_batches(commit.epoch, batches, &self.device))
    }

    /// The end of a data epoch: validation over the world and the epoch's row. The committed
    /// model becomes rank 0's (its batch-norm statistics); the epoch itself is committed by
    /// [`Members::checkpoint`] once [`Epochs::run`] has recorded the row.
    pub(super) fn validate(&mut self, world: &World, commit: &mut Commit<T::Model>) -> Result<Row> {
        let epoch = commit.epoch as usize + 1;
        // Batch norm statistics differ between members: rank 0's for everyone (as DDP does).
        let model = burn_dist::ddp::broadcast_module(commit.model.clone(), &world.comm)?;
        let (rank, size) = (world.rank(), world.size());
        let parts = val_share(self.trainee.val_len(), rank, size, self.cfg.batch_size);
        let val = self.objective.validate(
            &model.valid(),
            self.trainee.val_batches(parts.clone(), &self.plain_device),
            Some(&world.comm),
        )?;
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
        let took = (commit.elapsed - commit.epoch_started).max(1e-9);
        let in_epoch: Vec<usize> = commit
            .world_log
            .iter()
            .rev()
            .take_while(|(s, _, _)| *s as usize > (epoch - 1) * self.steps_per_epoch)
            .map(|p| p.2)
            .collect();
        let mean_world = in_epoch.iter().sum::<usize>() as f64 / in_epoch.len().max(1) as f64;
        let mut row: BTreeMap<String, f64> = [
            ("train_loss", ratio(commit.sums[0], commit.sums[2])),
            (
                "train_accuracy",
                100.0 * ratio(commit.sums[1], commit.sums[2]),
            ),
            ("val_loss", val.sums.mean_loss()),
            ("val_accuracy", val.sums.accuracy()),
            (
                "train_lr",
                epoch_lr(
                    |i| self.rates.rate(epoch, i),
                    epoch,
                    self.batches_per_epoch,
                    self.cfg.optim.grad_accum.unwrap_or(1),
                ),
            ),
            ("train_images_per_sec", commit.sums[2] / took),
            ("world_size", mean_world),
            ("worker_seconds", commit.worker_seconds),
            ("elapsed_seconds", commit.elapsed),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        if let Some(a) = val.auroc {
            row.insert("val_auroc".into(), a);
        }
        if let Some(a) = commit.train_scores.auroc() {
            row.insert("train_auroc".into(), a);
        }
        insert_top5(
            &mut row,
            self.trainee.classes().len(),
            self.trainee.multi_label(),
            (commit.sums[3], commit.sums[2]),
            (val.sums.top5, val.sums.samples),
        );
        if commit.scaler.is_some() {
            row.insert("train_skipped_steps".into(), commit.epoch_skipped as f64);
        }
        self.validate_average(world, commit, parts, &mut row)?;
        commit.model = model;
        Ok(row)
    }

    /// Rank 0 (after `metrics.csv`): the epoch's model and optimizer files (best and last kept), and the
    /// whole committed state for an exact `--resume`.
    pub(super) fn checkpoint(
        &self,
        c: &Commit<T::Model>,
        world: &World,
        epoch: usize,
        best: Option<usize>,
    ) -> Result<()> {
        let gate = self.gate();
        let dir = &self.cfg.run_dir;
        let mut steps = String::from("step,elapsed_seconds,world_size\n");
        for (s, t, w) in &c.world_log {
            steps.push_str(&format!("{s},{t:.3},{w}\n"));
        }
        gate.write(&dir.join("world.csv"), steps.as_bytes())?;
        save_epoch_weights(dir, epoch, c.model.clone(), &gate)?;
        self.save_average(c, &gate, epoch, best)?;
        for old in 1..epoch {
            if Some(old) != best {
                gate.remove(&model_checkpoint(dir, old))?;
            }
        }
        if self.save_state(c, world)? && self.zero.is_some() {
            self.prune_shards(c.step);
        }
        Ok(())
    }
}
