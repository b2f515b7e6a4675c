//! One epoch of a stage: training steps over micro-batches, validation through the pipeline,
//! and the metrics row every rank agrees on.

use super::*;
use crate::settings::Precision;
use crate::train::Targets;
use crate::train::exchange::Update;
use crate::train::precision::{LossScaler, divide};
use crate::train::targets::{BatchMixing, train_targets};
use burn::optim::GradientsParams;
use burn_dist::DistError;

/// Sums over a stage's share of an epoch: (loss x samples, correct, samples, samples with
/// their class among the 5 highest scores).
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Sums {
    pub(super) loss: f64,
    pub(super) correct: f64,
    pub(super) count: f64,
    top5: f64,
    /// Steps skipped for non-finite fp16 gradients (the same on every rank).
    skipped: f64,
}

/// One batch's pass through this stage: its gradients and, on the last stage, the batch's
/// mean loss, hits and size.
struct BatchDone {
    grads: GradientsParams,
    loss: f64,
    correct: f64,
    top5: f64,
    n: usize,
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
        zero: &mut Option<ZeroOptimizer>,
        epoch: usize,
        scaler: &mut Option<LossScaler>,
    ) -> Result<(StageModel, Sums, ValScores)> {
        let mut model = model;
        model.precision = self.cfg.compute.precision;
        let mut sums = Sums::default();
        // A multi-label epoch's outputs on the last stages, for its `train_auroc`.
        let mut scores = ValScores::default();
        {
            // Dropout's stream of this epoch, a function of (seed, epoch, rank) as elsewhere.
            seed_stream(
                &self.device,
                self.cfg.seed,
                epoch as u64 - 1,
                self.comm.rank(),
            );
            // --recompute's seeds per micro-batch: the same stream, from its own end.
            pipe.seed(!crate::train::model::epoch_seed(
                self.cfg.seed,
                epoch as u64 - 1,
                self.comm.rank(),
            ));
        }
        // Mixup and cutmix: every stage draws the same for the same batch (the first mixes
        // the images, the last the targets).
        let mixing = BatchMixing::new(self.cfg.data.mixing(), self.cfg.seed);
        for (i, batch) in self
            .loaders
            .train
            .epoch(epoch as u64 - 1, &self.device)
            .enumerate()
        {
            let (images, targets) = train_targets(
                batch?,
                self.objective.multi_label(),
                mixing.as_ref(),
                epoch as u64 - 1,
            )?;
            // fp16: the last stage multiplies the loss by the scale, so every stage's
            // gradients (and the activations' between them) carry it.
            let factor = scaler
                .as_ref()
                .map_or(1.0, |s| s.loss_factor(self.overflow_at));
            let mut done = self.run_batch(pipe, &model, images, &targets, factor, &mut scores)?;
            // The batch's sums on the last stage (zeros elsewhere).
            let mut done_sums = crate::train::objective::Sums::default();
            if self.is_last() {
                sums.loss += done.loss * done.n as f64;
                sums.correct += done.correct;
                sums.top5 += done.top5;
                sums.count += done.n as f64;
                done_sums = crate::train::objective::Sums {
                    loss: done.loss * done.n as f64,
                    hits: done.correct,
                    samples: done.n as f64,
                    top5: done.top5,
                };
            }
            if let Some(s) = scaler.as_ref() {
                // Unscaled before the exchange, as data parallel sends them.
                divide(&model, &mut done.grads, s.scale());
            }
            let rate = self.rate(epoch, (epoch - 1) * self.steps_per_epoch + i);
            let stepped;
            (model, stepped) = match (zero.as_mut(), &self.replicas) {
                (Some(z), Some(replicas)) => {
                    self.sharded_update(z, replicas, model, done.grads, scaler, rate)?
                }
                _ => self.plain_update(model, done.grads, optim, scaler, rate)?,
            };
            if stepped {
                self.average_step(&model);
            } else {
                sums.skipped += 1.0;
            }
            self.log_step(
                epoch,
                &done_sums,
                (epoch - 1) * self.steps_per_epoch + i + 1,
                rate,
            )?;
        }
        if let Some(replicas) = &self.replicas {
            // Batch norm's running statistics saw each replica's own data: replica 0's go to
            // the others (as DDP does), so validation, checkpoints and the export agree.
            model = broadcast_module(model, replicas)?;
        }
        self.settle_average()?;

        Ok((model, sums, scores))
    }

    /// `checkpoint.log_every`: the batch's sums (the last stage's; zeros elsewhere) counted,
    /// and at every N-th step of the run (`step`, from 1) summed over the job and written by
    /// rank 0, with the step's rate.
    fn log_step(
        &self,
        epoch: usize,
        sums: &crate::train::objective::Sums,
        step: usize,
        rate: f64,
    ) -> Result<()> {
        let mut cell = self.step_log.borrow_mut();
        let Some(l) = cell.as_mut() else {
            return Ok(());
        };
        l.add(epoch, *sums);
        l.stepped(step as u64, rate, |s| s.all_reduce(&self.comm))
    }

    /// One batch through the pipeline in micro-batches: this stage's gradients and, on the
    /// last stage, the batch's mean loss (unscaled), hits and top-5 hits, its outputs kept in
    /// `scores` (multi-label). `factor` scales the loss the backward starts from (fp16).
    fn run_batch(
        &self,
        pipe: &mut Pipeline,
        model: &StageModel,
        images: Tensor<4>,
        targets: &Targets,
        factor: f32,
        scores: &mut ValScores,
    ) -> Result<BatchDone> {
        let objective = self.objective;
        let n = images.dims()[0];
        let parts = self.micro_split(n);
        let (mut correct, mut top5, mut loss) = (0.0f64, 0.0f64, 0.0f64);
        let out = pipe.step(
            model,
            &mut |m| Activation::Rank4(images.clone().narrow(0, parts[m].0, parts[m].1)),
            &mut |logits, m| {
                let logits = logits.rank2("the last stage's output")?;
                let y = targets.narrow(parts[m].0, parts[m].1);
                correct += objective.hits(&logits, &y);
                top5 += objective.top5_hits(&logits, &y).unwrap_or(0.0);
                scores
                    .push(&logits, &y)
                    .map_err(|e| DistError::Config(e.to_string()))?;
                // The batch mean: each micro-batch's mean weighted by its share.
                let l = objective
                    .loss(logits, &y, true)
                    .map_err(|e| DistError::Config(e.to_string()))?
                    .mul_scalar(parts[m].1 as f32 / n as f32);
                if factor == 1.0 {
                    return Ok(l);
                }
                loss += f64::from(l.clone().into_scalar::<f32>());
                Ok(l.mul_scalar(factor))
            },
            parts.len(),
            &self.device,
        )?;
        if factor == 1.0 {
            loss = out.losses.iter().map(|&l| f64::from(l)).sum::<f64>();
        }
        Ok(BatchDone {
            grads: out.grads,
            loss,
            correct,
            top5,
            n,
        })
    }

    /// `--zero`: the replicas' exchange and this rank's shard's update in one; fp16's verdict
    /// on the replicas' averaged gradients, then one for the whole job; `--clip-grad` by the
    /// norm over the job (the sharded optimizer adds this rank's segments' squares to every
    /// other rank's part, [`ZeroOptimizer::with_norm_over`]). The model, and whether it
    /// stepped.
    fn sharded_update(
        &self,
        z: &mut ZeroOptimizer,
        replicas: &Communicator,
        model: StageModel,
        grads: GradientsParams,
        scaler: &mut Option<LossScaler>,
        rate: f64,
    ) -> Result<(StageModel, bool)> {
        let update = Update {
            clip: None,
            scaler: scaler.as_mut(),
        };
        Ok(update.sharded(z, rate, model, grads, replicas, |finite| {
            self.agree_finite(finite)
        })?)
    }

    /// fp16's one verdict for the whole job: a stage's overflow skips the step on every stage
    /// and replica (a flag summed over every rank).
    fn agree_finite(&self, finite: bool) -> std::result::Result<bool, burn_dist::DistError> {
        let mut flag = [if finite { 0.0f32 } else { 1.0 }];
        self.comm.allreduce(&mut flag, ReduceOp::Sum)?;
        Ok(flag[0] == 0.0)
    }

    /// The replicas' allreduce, fp16's one verdict for the whole job (a stage's overflow
    /// skips the step on every stage and replica, from a flag summed over every rank), the
    /// optimizer's step. The model, and whether it stepped.
    fn plain_update(
        &self,
        model: StageModel,
        mut grads: GradientsParams,
        optim: &mut ModuleOptimizer,
        scaler: &mut Option<LossScaler>,
        rate: f64,
    ) -> Result<(StageModel, bool)> {
        if let Some(replicas) = &self.replicas {
            allreduce_grads(
                &model,
                &mut grads,
                replicas,
                self.cfg.exchange.bucket_size(),
            )?;
        }
        let update = Update {
            clip: self.cfg.optim.clip_grad,
            scaler: scaler.as_mut(),
        };
        // The norm over the whole model: every rank's part of the squares summed over the job.
        // Here each stage's replicas hold its whole gradient (equal after their allreduce):
        // each adds its share; a stage sharded with `--zero` adds its segments' own.
        let replicas = self.replicas.as_ref().map_or(1, |r| r.world()) as f64;
        update.apply(
            model,
            rate,
            grads,
            optim,
            |finite| Ok(self.agree_finite(finite)?),
            |mine| {
                let mut v = [(mine / replicas) as f32];
                self.comm.allreduce(&mut v, ReduceOp::Sum)?;
                Ok(f64::from(v[0]))
            },
        )
    }

    /// Validation of this replica's shard: the sums, and (multi-label, last stages) the
    /// outputs for the epoch's AUROC.
    pub(super) fn validate(
        &self,
        pipe: &mut Pipeline,
        model: &StageModel,
    ) -> Result<(Sums, ValScores)> {
        let mut model = model.valid();
        model.precision = self.cfg.compute.precision;
        let objective = self.objective;
        let mut sums = Sums::default();
        let mut scores = ValScores::default();
        // Every rank of a pipeline streams the same shard, so they agree on the batches.
        for batch in self.loaders.val.epoch(0, &self.plain_device) {
            let (images, targets) = targets(batch?, objective.multi_label())?;
            let n = images.dims()[0];
            let parts = self.micro_split(n);
            pipe.forward(
                &model,
                &mut |m| Activation::Rank4(images.clone().narrow(0, parts[m].0, parts[m].1)),
                &mut |logits, m| {
                    let logits = logits.rank2("the last stage's output")?;
                    let y = targets.narrow(parts[m].0, parts[m].1);
                    sums.correct += objective.hits(&logits, &y);
                    sums.top5 += objective.top5_hits(&logits, &y).unwrap_or(0.0);
                    scores
                        .push(&logits, &y)
                        .map_err(|e| DistError::Config(e.to_string()))?;
                    let loss = objective
                        .loss(logits, &y, false)
                        .map_err(|e| DistError::Config(e.to_string()))?
                        .into_scalar::<f32>();
                    sums.loss += f64::from(loss) * parts[m].1 as f64;
                    sums.count += parts[m].1 as f64;
                    Ok(())
                },
                parts.len(),
                &self.plain_device,
            )?;
        }
        Ok((sums, scores))
    }

    /// The epoch's row of `metrics.csv`, the same on every rank: the last stages' sums added
    /// over the job (the other ranks add zeros), and a multi-label run's AUROC over the outputs
    /// every last stage kept (training's and validation's).
    pub(super) fn epoch_row(
        &self,
        (train, train_scores): (Sums, ValScores),
        (val, scores): (Sums, ValScores),
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
            train.top5 as f32,
            val.top5 as f32,
        ];
        self.comm.allreduce(&mut v, ReduceOp::Sum)?;
        let per = |a: f32, n: f32| if n > 0.0 { f64::from(a / n) } else { f64::NAN };
        let (train_auroc, auroc) = if self.objective.multi_label() {
            (
                train_scores.gather(&self.comm)?.auroc(),
                scores.gather(&self.comm)?.auroc(),
            )
        } else {
            (None, None)
        };
        let mut row: Row = [
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
            ("elapsed_seconds", self.started.elapsed().as_secs_f64()),
        ]
        .into_iter()
        .map(|(k, x)| (k.to_string(), x))
        .collect();
        if let Some(a) = auroc {
            row.insert("val_auroc".into(), a);
        }
        if let Some(a) = train_auroc {
            row.insert("train_auroc".into(), a);
        }
        insert_top5(
            &mut row,
            self.classes.len(),
            self.objective.multi_label(),
            (f64::from(v[6]), f64::from(v[2])),
            (f64::from(v[7]), f64::from(v[5])),
        );
        if self.cfg.compute.precision == Precision::Fp16 {
            // Every rank took the same verdicts: its own count is the job's.
            row.insert("train_skipped_steps".into(), train.skipped);
        }
        Ok(row)
    }
}
