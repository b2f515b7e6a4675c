//! One Learner launch: a contiguous range of epochs trained with one learning rate and one set
//! of trainable parameters (the whole run, or the frozen and fine-tuning phases of transfer
//! learning).

use std::sync::Arc;

use burn::train::metric::LearningRateMetric;
use burn::train::{Learner, SupervisedTraining, TrainingStrategy};
use hearth_datasets::Loader;

use super::best::{BestRule, KeepBestAndLast, Patience};
use super::model::optimizer;
use super::run_dir::complete_checkpoints;
use super::shared::epoch_lr;
use super::{
    CsvMetricLogger, EpochCount, EpochTable, ImagesPerSecond, LoaderAdapter, NonFinite,
    PlainRenderer, Task, TrainConfig,
};
use crate::schedule::Schedule;
use crate::{HearthError, Result};

/// Epochs `first + 1 ..= last` of the run, starting from checkpoint `first` when it is not 0.
pub struct Phase<'a, T: Task> {
    pub trainee: T,
    pub lr: f64,
    pub first: usize,
    pub last: usize,
    /// Early stopping, if any: the epoch patience counts from at the earliest.
    pub patience_origin: Option<usize>,
    /// Loader batches per epoch on this rank.
    pub batches_per_epoch: usize,
    pub train_loader: &'a Loader,
    pub val_loader: &'a Loader,
    pub table: &'a EpochTable,
    pub dist: Option<&'a Arc<burn_dist::Communicator>>,
    /// When the run started (`elapsed_seconds` counts from it in every phase).
    pub started: std::time::Instant,
}

impl<T: Task> Phase<'_, T> {
    /// The learning-rate schedule over the whole run, in optimizer steps (burn-train advances
    /// the scheduler once per optimizer step, so with gradient accumulation K that is a K-th of
    /// the batches); a resumed phase continues at its iteration.
    fn schedule(&self, cfg: &TrainConfig) -> Result<Schedule> {
        cfg.lr_schedule(self.lr, self.batches_per_epoch)
    }

    /// `metrics.csv` and the epoch lines (rank 0), with the NaN guard, the epoch's rate and the
    /// metrics averaged over the ranks.
    fn csv_logger(
        &self,
        cfg: &TrainConfig,
        schedule: &Schedule,
        rank: usize,
        non_finite: &NonFinite,
        interrupter: &burn::train::Interrupter,
    ) -> CsvMetricLogger {
        let mut csv_logger =
            CsvMetricLogger::new(cfg.run_dir.join("metrics.csv"), self.table.clone())
                .with_nan_guard(non_finite.clone(), interrupter.clone())
                .with_started(self.started);
        if rank == 0 {
            csv_logger =
                csv_logger.with_report(Box::new(|line: &str| eprintln!("{line}")), cfg.epochs);
        }
        let (rates, batches) = (schedule.clone(), self.batches_per_epoch);
        let k = cfg.optim.grad_accum.unwrap_or(1);
        csv_logger = csv_logger.with_epoch_lr(Box::new(move |epoch| {
            epoch_lr(|i| rates.lr_at(i), epoch, batches, k)
        }));
        if let Some(comm) = self.dist {
            // Metric averaging runs on its own tag space, beside the gradient traffic.
            csv_logger = csv_logger
                .with_rank_averaging(Arc::new(comm.sibling(burn_dist::wire::Kind::Metric)));
        }
        csv_logger
    }

    /// Data parallel's strategy for burn-train (where the run is distributed): buckets,
    /// overlap, fp16's shared verdict, and `--zero`'s sharding.
    fn ddp_strategy(
        &self,
        cfg: &TrainConfig,
        scaler: Option<super::SharedScaler>,
    ) -> Result<Option<burn_dist::ddp::DdpStrategy>> {
        let Some(comm) = self.dist else {
            return Ok(None);
        };
        let mut strategy = burn_dist::ddp::DdpStrategy::new(comm.clone())
            .with_bucket_bytes(cfg.exchange.bucket_bytes)
            .with_overlap(cfg.exchange.overlap);
        if let Some(s) = scaler {
            // fp16: the verdict on the averaged gradients, the same on every rank.
            strategy = strategy.with_step_guard(Arc::new(s));
        }
        // The fine-tuning phase right after the frozen one: the state it starts from holds
        // the head alone; the backbone's starts from zero (as burn's optimizer's would).
        let fine_tuning_start =
            cfg.model.freeze_backbone && cfg.model.unfreeze_after == Some(self.first);
        if let Some(s) = super::zero::sharding(
            cfg,
            self.lr,
            self.batches_per_epoch,
            &self.trainee,
            fine_tuning_start,
        )? {
            strategy = strategy.with_sharding(s);
        }
        Ok(Some(strategy))
    }

    pub fn run(
        self,
        cfg: &TrainConfig,
        device: &burn::prelude::Device,
        plain_device: &burn::prelude::Device,
    ) -> Result<T> {
        let schedule = self.schedule(cfg)?;
        let rule = BestRule {
            table: self.table.clone(),
            monitor: cfg.checkpoint.monitor,
            min_delta: cfg.checkpoint.min_delta,
        };
        let mut checkpointing =
            KeepBestAndLast::new(rule.clone(), complete_checkpoints(&cfg.run_dir));
        if let Some(s) = &self.trainee.mixed().scaler {
            checkpointing = checkpointing.with_loss_scaler(s.clone(), cfg.run_dir.clone());
        }
        let interrupter = burn::train::Interrupter::new();
        let non_finite = NonFinite::default();
        let rank = self.dist.map_or(0, |c| c.rank());
        let csv_logger = self.csv_logger(cfg, &schedule, rank, &non_finite, &interrupter);
        let first_epoch = self.first as u64;
        let mut training = SupervisedTraining::new(
            &cfg.run_dir,
            Arc::new(
                LoaderAdapter::new(self.train_loader.clone(), device.clone(), first_epoch)
                    .with_epoch_seed(cfg.seed, rank),
            ),
            Arc::new(LoaderAdapter::new(
                self.val_loader.clone(),
                plain_device.clone(),
                first_epoch,
            )),
        )
        .with_interrupter(interrupter)
        .with_metric_logger(csv_logger)
        .metric_train_numeric(LearningRateMetric::new())
        .metric_train_numeric(ImagesPerSecond::new())
        .metric_train_numeric(EpochCount::skipped_images(self.train_loader.clone()))
        .metric_valid_numeric(EpochCount::skipped_images(self.val_loader.clone()))
        .with_default_checkpointers()
        .with_checkpointing_strategy(checkpointing)
        .num_epochs(self.last);
        training = T::register_metrics(training, self.train_loader.set().classes.len());
        let scaler = self.trainee.mixed().scaler.clone();
        if let Some(s) = &scaler {
            training = training.metric_train_numeric(EpochCount::skipped_steps(s.clone()));
        }
        if let Some(k) = cfg.optim.grad_accum.filter(|&k| k > 1) {
            training = training.grads_accumulation(k);
        }
        if let Some(strategy) = self.ddp_strategy(cfg, scaler)? {
            training =
                training.with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)));
        }
        if rank == 0 {
            training = training.summary();
        } else {
            // Rank 0 alone writes the run directory's logs.
            training = training.with_application_logger(None);
        }
        if let (Some(patience), Some(origin)) = (cfg.checkpoint.patience, self.patience_origin) {
            training = training.early_stopping(Patience {
                rule,
                patience,
                origin,
            });
        }
        if self.first > 0 {
            // burn-train loads the optimizer state on Burn's default device.
            crate::device::check_burn_default(device)?;
            training = training.checkpoint(self.first);
        }
        // burn-train's dashboard on a terminal (the `tui` feature); plain progress lines
        // otherwise.
        if rank != 0
            || !cfg!(feature = "tui")
            || !std::io::IsTerminal::is_terminal(&std::io::stdout())
        {
            training = training.renderer(Box::new(if rank == 0 {
                PlainRenderer::default()
            } else {
                PlainRenderer::quiet()
            }));
        }
        let learner = Learner::new(self.trainee, optimizer(cfg), schedule);
        let result = training.launch(learner);
        // A data error first: an epoch it cut short can leave a NaN in the metrics, and the
        // data's cause is the one to name.
        if let Some(error) = result.error {
            return Err(HearthError::Training(error.to_string()));
        }
        if let Some((epoch, step)) = non_finite.lock().ok().and_then(|n| *n) {
            return Err(HearthError::NanLoss { epoch, step });
        }
        Ok(result.model)
    }
}
