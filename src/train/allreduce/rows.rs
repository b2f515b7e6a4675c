//! The epoch's numbers in data parallel: the training sums over the ranks (and each rank's
//! curve), validation with rank 0's batch-norm statistics, and the epoch's row of
//! `metrics.csv`, the weight average's columns included.

use super::*;

impl<T: Trainee> Allreduce<'_, T> {
    /// The epoch's training sums over the ranks, its `train_auroc` (multi-label) and each
    /// rank's own curve (`train_loss_rank<r>`, `train_accuracy_rank<r>`; none in one process).
    #[allow(clippy::type_complexity)]
    pub(super) fn gather_train(
        &self,
        train: Sums,
        scores: Option<ValScores>,
    ) -> Result<(Sums, Option<f64>, Vec<(String, f64)>)> {
        let Some(comm) = &self.metrics else {
            return Ok((train, scores.and_then(|s| s.auroc()), Vec::new()));
        };
        let mut per_rank = Vec::new();
        let mine = [train.mean_loss() as f32, train.accuracy() as f32];
        for (r, v) in comm.all_gather(&mine)?.chunks(2).enumerate() {
            per_rank.push((format!("train_loss_rank{r}"), f64::from(v[0])));
            per_rank.push((format!("train_accuracy_rank{r}"), f64::from(v[1])));
        }
        let auroc = match scores {
            Some(s) => s.gather(comm)?.auroc(),
            None => None,
        };
        Ok((train.all_reduce(comm)?, auroc, per_rank))
    }

    /// Validates `model` (the model or its weight average) on this rank's share of the
    /// validation set, with rank 0's batch-norm statistics on every rank (as DDP's broadcast),
    /// combined over the ranks; returns it with those statistics.
    fn score(
        &self,
        mut model: T::Model,
    ) -> Result<(T::Model, crate::train::objective::Validation)> {
        if let Some(comm) = &self.comm
            && self.trainee.has_batch_norm()
        {
            model = burn_dist::ddp::broadcast_module(model, comm)?;
        }
        let parts = val_share(
            self.trainee.val_len(),
            self.rank,
            self.world,
            self.cfg.batch_size,
        );
        let val = self.objective.validate(
            &model.valid(),
            self.trainee.val_batches(parts, &self.plain_device),
            self.metrics.as_deref(),
        )?;
        Ok((model, val))
    }

    /// [`Self::score`] of ZeRO stage 3's skeleton: each batch's forward gathers the units'
    /// parameters one unit at a time, every rank running as many forwards as the largest
    /// share has batches (rank 0's). The skeleton's statistics stay its own, as a gathered
    /// model's did: rank 0's are broadcast into a copy for the pass (its parameters are
    /// empty, so only the buffers travel).
    fn score_gathered(
        &self,
        gathering: &crate::pipeline::Gathering<'_>,
    ) -> Result<crate::train::objective::Validation> {
        let mut model = self.model()?.clone();
        if let Some(comm) = &self.comm
            && self.trainee.has_batch_norm()
        {
            model = burn_dist::ddp::broadcast_module(model, comm)?;
        }
        let (len, batch) = (self.trainee.val_len(), self.cfg.batch_size);
        let rounds = val_share(len, 0, self.world, batch).len();
        self.objective.validate_gathered(
            &model,
            self.trainee.val_batches(
                val_share(len, self.rank, self.world, batch),
                &self.plain_device,
            ),
            rounds,
            gathering,
            self.metrics.as_deref(),
        )
    }

    /// The epoch's validation (with rank 0's batch-norm statistics on every rank, as DDP's
    /// broadcast) and its row of `metrics.csv`, after `train` (summed over the ranks) took
    /// `took` seconds with `k` batches per step.
    pub(super) fn validate_row(
        &mut self,
        epoch: usize,
        k: usize,
        train: &Sums,
        took: f64,
    ) -> Result<Row> {
        // `--zero 3`: one unit's parameters gathered at a time, the skeleton kept.
        let val = match self.gathering() {
            Some(g) => self.score_gathered(&g)?,
            None => {
                let model = self.take_model()?;
                let (model, val) = self.score(model)?;
                self.model = Some(model);
                val
            }
        };
        let mut row: Row = [
            ("train_loss", train.mean_loss()),
            ("train_accuracy", train.accuracy()),
            ("val_loss", val.sums.mean_loss()),
            ("val_accuracy", val.sums.accuracy()),
            (
                "train_lr",
                epoch_lr(|i| self.rates.rate(epoch, i), epoch, self.batches, k),
            ),
            ("train_images_per_sec", train.samples / took),
            ("elapsed_seconds", self.started.elapsed().as_secs_f64()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        if let Some(a) = val.auroc {
            row.insert("val_auroc".into(), a);
        }
        insert_top5(
            &mut row,
            self.trainee.classes().len(),
            self.trainee.multi_label(),
            (train.top5, train.samples),
            (val.sums.top5, val.sums.samples),
        );
        if let Some(e) = self.ema.take() {
            // Scored as the model is, with rank 0's batch-norm statistics of the average.
            let (average, val) = self.score(e.model.clone())?;
            self.ema = Some(e.with_model(average));
            row.insert("val_ema_loss".into(), val.sums.mean_loss());
            row.insert("val_ema_accuracy".into(), val.sums.accuracy());
            if let Some(a) = val.auroc {
                row.insert("val_ema_auroc".into(), a);
            }
        }
        if self.scaler.is_some() {
            row.insert(
                "train_skipped_steps".into(),
                std::mem::take(&mut self.epoch_skipped) as f64,
            );
        }
        Ok(row)
    }
}
