//! One epoch of a stage: training steps over micro-batches, validation through the pipeline,
//! and the metrics row every rank agrees on.

use super::*;

/// Sums over a stage's share of an epoch: (loss x samples, correct, samples).
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Sums {
    loss: f64,
    correct: f64,
    count: f64,
}

impl PipelineRun<'_> {
    /// Micro-batch sizes of a batch of `n`: M nearly equal parts (fewer when n < M).
    fn micro_sizes(&self, n: usize) -> Vec<usize> {
        let m = self.opts.micro_batches.min(n).max(1);
        (0..m).map(|i| n / m + usize::from(i < n % m)).collect()
    }

    /// (first sample, size) of each micro-batch of a batch of `n`.
    pub(super) fn micro_split(&self, n: usize) -> Vec<(usize, usize)> {
        let mut start = 0;
        self.micro_sizes(n)
            .into_iter()
            .map(|k| {
                start += k;
                (start - k, k)
            })
            .collect()
    }

    pub(super) fn train_epoch(
        &self,
        pipe: &mut Pipeline,
        model: StageModel,
        optim: &mut ModuleOptimizer,
        epoch: usize,
    ) -> Result<(StageModel, Sums)> {
        let mut model = model;
        let mut sums = Sums::default();
        {
            // Dropout's stream of this epoch, a function of (seed, epoch, rank) as elsewhere.
            let _rng = SEED_LOCK.lock().unwrap_or_else(|e| e.into_inner());
            self.device.seed(epoch_seed(
                self.cfg.seed,
                epoch as u64 - 1,
                self.comm.rank(),
            ));
        }
        let loss_fn = CrossEntropyLossConfig::new()
            .with_smoothing((self.cfg.label_smoothing > 0.0).then_some(self.cfg.label_smoothing))
            .init(&self.device);
        for (i, batch) in self
            .loaders
            .train
            .epoch(epoch as u64 - 1, &self.device)
            .enumerate()
        {
            let (images, targets) = images_and_classes(batch?)?;
            let n = images.dims()[0];
            let parts = self.micro_split(n);
            let mut correct = 0.0f64;
            let mut out = pipe.step(
                &model,
                &mut |m| Activation::Rank4(images.clone().narrow(0, parts[m].0, parts[m].1)),
                &mut |logits, m| {
                    let logits = logits.rank2("the last stage's output")?;
                    let y = targets.clone().narrow(0, parts[m].0, parts[m].1);
                    correct += hits(&logits, &y);
                    // The batch mean: each micro-batch's mean weighted by its share.
                    Ok(loss_fn
                        .forward(logits, y)
                        .mul_scalar(parts[m].1 as f32 / n as f32))
                },
                parts.len(),
                &self.device,
            )?;
            if self.is_last() {
                sums.loss += out.losses.iter().map(|&l| f64::from(l)).sum::<f64>() * n as f64;
                sums.correct += correct;
                sums.count += n as f64;
            }
            if let Some(replicas) = &self.replicas {
                allreduce_grads(&model, &mut out.grads, replicas, self.cfg.bucket_bytes)?;
            }
            let step = (epoch - 1) * self.steps_per_epoch + i;
            model = optim.step(self.rate(epoch, step), model, out.grads);
        }
        if let Some(replicas) = &self.replicas {
            // Batch norm's running statistics saw each replica's own data: replica 0's go to
            // the others (as DDP does), so validation, checkpoints and the export agree.
            model = broadcast_module(model, replicas)?;
        }

        Ok((model, sums))
    }

    pub(super) fn validate(&self, pipe: &mut Pipeline, model: &StageModel) -> Result<Sums> {
        let model = model.valid();
        let loss_fn = CrossEntropyLossConfig::new().init(&self.plain_device);
        let mut sums = Sums::default();
        // Every rank of a pipeline streams the same shard, so they agree on the batches.
        for batch in self.loaders.val.epoch(0, &self.plain_device) {
            let (images, targets) = images_and_classes(batch?)?;
            let n = images.dims()[0];
            let parts = self.micro_split(n);
            pipe.forward(
                &model,
                &mut |m| Activation::Rank4(images.clone().narrow(0, parts[m].0, parts[m].1)),
                &mut |logits, m| {
                    let logits = logits.rank2("the last stage's output")?;
                    let y = targets.clone().narrow(0, parts[m].0, parts[m].1);
                    sums.correct += hits(&logits, &y);
                    let loss = loss_fn.forward(logits, y).into_scalar::<f32>();
                    sums.loss += f64::from(loss) * parts[m].1 as f64;
                    sums.count += parts[m].1 as f64;
                    Ok(())
                },
                parts.len(),
                &self.plain_device,
            )?;
        }
        Ok(sums)
    }

    /// The epoch's row of `metrics.csv`, the same on every rank: the last stages' sums added
    /// over the job (the other ranks add zeros).
    pub(super) fn epoch_row(
        &self,
        train: Sums,
        val: Sums,
        epoch: usize,
        took: Duration,
    ) -> Result<Row> {
        let mut v = [
            train.loss as f32,
            train.correct as f32,
            train.count as f32,
            val.loss as f32,
            val.correct as f32,
            val.count as f32,
        ];
        self.comm.allreduce(&mut v, ReduceOp::Sum)?;
        let per = |a: f32, n: f32| if n > 0.0 { f64::from(a / n) } else { f64::NAN };
        Ok([
            ("train_loss", per(v[0], v[2])),
            ("train_accuracy", 100.0 * per(v[1], v[2])),
            ("val_loss", per(v[3], v[5])),
            ("val_accuracy", 100.0 * per(v[4], v[5])),
            (
                "train_lr",
                epoch_lr(|i| self.rate(epoch, i), epoch, self.steps_per_epoch, 1),
            ),
            (
                "train_images_per_sec",
                f64::from(v[2]) / took.as_secs_f64().max(1e-9),
            ),
        ]
        .into_iter()
        .map(|(k, x)| (k.to_string(), x))
        .collect())
    }
}

/// A batch's images and class indices.
fn images_and_classes(batch: hearth_datasets::Batch) -> Result<(Tensor<4>, Tensor<1, Int>)> {
    let classes = batch
        .classes
        .ok_or_else(|| HearthError::Training("the loader gave no class indices".into()))?;
    Ok((batch.images, classes))
}
