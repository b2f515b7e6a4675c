//! Pipeline model parallelism as a training mode (`hearth train --pipeline-stages P
//! --micro-batches M [--nproc N]`), with data parallelism across pipelines (2D: N = P x D).
//!
//! Ranks form a [`Grid`]: replica d's pipeline is ranks `d*P .. d*P+P`. Each rank builds only
//! its stage's units ([`hearth_models::stages`]), each unit seeded by its index so a stage's
//! replicas start identical and the split does not change the initial weights. Every rank of a
//! pipeline streams the same shard of the data (its replica's); the first stage feeds the
//! images, the last computes the loss and the metrics. A step is one [`Pipeline::step`] over
//! the replica's batch cut into M micro-batches (each micro-batch's mean loss weighted by its
//! share of the batch, so the step's gradient is the batch mean), an allreduce of each stage's
//! gradients over its D replicas, and an optimizer step on every stage with the same learning
//! rate. After each epoch replica 0's batch-norm statistics go to the other replicas of its
//! stage (as in data parallel). Validation runs the pipeline forward only.
//!
//! Metrics reach every rank (an allreduce of the last stages' sums), so every rank applies the
//! same best-epoch rule and early stopping; rank 0 writes `metrics.csv` and `metrics.png`.
//! Checkpoints: replica 0 of each stage writes `checkpoint/stage-<s>/{model,optim}-<epoch>.bpk`
//! on its own disk; an epoch is complete when every stage has both. The learning-rate schedule
//! is a function of the step, so it needs no file. The export sends the best epoch's stages to
//! rank 0, which assembles the whole model (the only time one process holds all of it) into
//! `model.bpk`, loadable by `hearth predict` like any other.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::optim::{ModuleOptimizer, OptimizerRecord};
use burn::prelude::*;
use burn::store::ModuleRecord;
use burn_dist::ddp::{allreduce_grads, broadcast_module, module_values, with_module_values};
use burn_dist::pipeline::{Activation, Pipeline};
use burn_dist::transport::group::{Grid, Group};
use burn_dist::wire::Kind;
use burn_dist::zero::ZeroOptimizer;
use burn_dist::{Communicator, ReduceOp};
use hearth_models::stages::Unit;
use hearth_models::{Classifier, HeadActivation, ModelConfig, Preprocessing, save_model_with};

use super::catalog::model_config;
use super::epochs::{Epochs, Row, Strategy};
use super::export::auroc_report;
use super::model::{epoch_seed, init_model, optimizer, seed_lock, seed_stream};
use super::objective::{Objective, insert_top5};
use super::precision::LossScaler;
use super::scores::ValScores;
use super::shared::{Rates, collective_timeout, epoch_lr};
use super::step_log::StepLog;
use super::targets::targets;
use super::{TrainConfig, TrainReport, distributed, run_dir, sets};
use crate::pipeline::{StageModel, UnitCost, balance, balance_by, stage_memory};
use crate::settings::Precision;
use crate::settings::{PipelineBalance, PipelineOptions};
use crate::{HearthError, Result};

/// Largest piece of a tensor sent to rank 0 at export (values), well under the frame cap.
const EXPORT_CHUNK: usize = 8 << 20;

/// What the steps of a pipeline run share.
struct PipelineRun<'a> {
    cfg: &'a TrainConfig,
    opts: &'a PipelineOptions,
    device: Device,
    plain_device: Device,
    comm: Arc<Communicator>,
    /// This stage's replicas (2D), averaging its gradients.
    replicas: Option<Communicator>,
    grid: Grid,
    stage: usize,
    replica: usize,
    ranges: Vec<Range<usize>>,
    config: ModelConfig,
    classes: Vec<String>,
    loaders: sets::Loaders,
    /// Each step's rate and the transfer-learning phases.
    rates: Rates,
    /// The loss and metrics.
    objective: Objective,
    steps_per_epoch: usize,
    /// `HEARTH_FP16_OVERFLOW_AT_STEP` for this rank.
    overflow_at: Option<u64>,
    /// When the run started: each epoch's `elapsed_seconds` counts from it.
    started: Instant,
    /// `checkpoint.log_every`: the step scalars, the last stages' sums over the job, written
    /// by rank 0 (set once the resumed epoch is known).
    step_log: std::cell::RefCell<Option<StepLog>>,
    /// `optim.model_ema`: this stage's weight average (`average.rs`).
    ema: std::cell::RefCell<Option<super::ema::Ema<StageModel>>>,
}

pub(super) fn train(
    cfg: &TrainConfig,
    device: &Device,
    log: &mut dyn FnMut(&str),
) -> Result<TrainReport> {
    let Some(opts) = cfg.mode.pipeline() else {
        return Err(HearthError::InvalidArgument(
            "pipeline training without pipeline options".into(),
        ));
    };
    let started = Instant::now();
    let info = cfg.dist.clone().filter(|i| i.world > 1).ok_or_else(|| {
        HearthError::InvalidArgument(format!(
            "`PipelineOptions.stages` {} needs {} processes or a multiple (one per stage and replica): \
             add `dist.world` {}",
            opts.stages, opts.stages, opts.stages
        ))
    })?;
    let grid = Grid::new(opts.stages, info.world)?;
    let comm = Arc::new(distributed::connect(&info, log)?);
    let rank = comm.rank();
    let mut quiet = |_: &str| {};
    let log: &mut dyn FnMut(&str) = if rank == 0 { log } else { &mut quiet };
    if rank == 0 {
        run_dir::start(cfg, log)?;
    }
    let (train_set, val_set) = distributed::load_data(cfg, &comm, log)?;
    let multi_label = train_set.multi_label;
    if !cfg.batch_size.is_multiple_of(grid.replicas) {
        return Err(HearthError::InvalidArgument(format!(
            "`batch_size` {} must divide evenly over {} pipelines",
            cfg.batch_size, grid.replicas
        )));
    }
    let (stage, replica) = grid.place(rank);
    let classes = train_set.classes.clone();
    let config = model_config(&cfg.model.name, classes.len())?;
    let ranges = files::split(cfg, opts, &config, device)?;
    let plain = device.clone();
    log(&format!(
        "pipeline: {} stages x {} replicas, {} micro-batches of a {}-image batch per replica, {} schedule",
        grid.stages,
        grid.replicas,
        opts.micro_batches,
        cfg.batch_size / grid.replicas,
        opts.schedule.name()
    ));
    let loaders = sets::Loaders::new(cfg, train_set, val_set, replica, grid.replicas)?;
    let lr = cfg.scaled_lr(log)?;
    let steps_per_epoch = loaders.train.batches_per_epoch().max(1);
    let replicas = if grid.replicas > 1 {
        let group = Group::new(comm.transport().clone(), grid.stage_replicas(stage), 1)?;
        Some(Communicator::from_env(Arc::new(group)).with_compression(cfg.exchange.compression))
    } else {
        None
    };
    let run = PipelineRun {
        cfg,
        opts,
        device: device.clone().autodiff(),
        plain_device: plain,
        comm,
        replicas,
        grid,
        stage,
        replica,
        ranges,
        config,
        classes,
        loaders,
        rates: Rates::new(cfg, lr, steps_per_epoch)?,
        objective: Objective::new(cfg, multi_label),
        steps_per_epoch,
        overflow_at: super::faults::Faults::rank(rank, cfg.compute.precision).overflow_at(),
        started,
        step_log: Default::default(),
        ema: Default::default(),
    };
    run.train(log)
}

impl PipelineRun<'_> {
    fn is_last(&self) -> bool {
        self.stage + 1 == self.grid.stages
    }

    /// This stage's units, each seeded by its index (the same on every replica and for every
    /// split). With `--weights` or a multi-label set, the whole model as one process builds it
    /// (the pretrained units, the new head seeded by `--seed`; a multi-label run's sigmoid head
    /// with its biases at one), cut to this stage's units; with
    /// `--freeze-backbone`, everything but the head frozen. Both hold the whole model for a
    /// moment on every rank.
    fn init_stage(&self) -> Result<StageModel> {
        let range = self.ranges[self.stage].clone();
        if self.cfg.model.weights.is_some() || self.objective.multi_label() {
            let mut model = init_model(
                self.cfg,
                &self.config,
                self.classes.len(),
                self.objective.multi_label(),
                &self.device,
                &mut |_| {},
            )?;
            if self.cfg.model.freeze_backbone {
                model = model.freeze_backbone();
            }
            return Ok(Self::cut(model, range));
        }
        let seeded = |units: Range<usize>| -> Result<Vec<Unit>> {
            let _rng = seed_lock();
            let mut out: Vec<Unit> = Vec::new();
            for u in units {
                self.device
                    .seed(epoch_seed(self.cfg.seed, u64::MAX - u as u64, 0));
                let unit = self.config.init_units(u..u + 1, &self.device)?;
                // Materialise the lazily initialised parameters while the seed holds.
                let _ = module_values(&StageModel::new(unit.clone()));
                out.extend(unit);
            }
            Ok(out)
        };
        if self.cfg.model.freeze_backbone {
            let model = Classifier::from_units(&self.config, seeded(0..self.config.units())?)?;
            return Ok(Self::cut(model.freeze_backbone(), range));
        }
        Ok(StageModel::new(seeded(range)?))
    }

    /// Units `range` of `model`.
    fn cut(model: Classifier, range: Range<usize>) -> StageModel {
        StageModel::new(
            model
                .into_units()
                .into_iter()
                .skip(range.start)
                .take(range.len())
                .collect(),
        )
    }

    /// Whether `epoch` belongs to the fine-tuning phase (`--unfreeze-after N`: after epoch N).
    fn fine_tuning(&self, epoch: usize) -> bool {
        self.rates.fine_tuning(epoch)
    }

    /// The rate of optimizer step `step` in `epoch`'s phase.
    fn rate(&self, epoch: usize, step: usize) -> f64 {
        self.rates.rate(epoch, step)
    }

    /// Every rank checks that all build the same model with the same split (a resumed
    /// rank's comes from its own `pipeline_split.txt`), micro-batches and flags, before the
    /// first step. Paths are left out (a host may keep its copy elsewhere; the data itself was
    /// compared when it was read).
    fn agree(&self, hparams: &crate::train::Recorded) -> Result<()> {
        let mut settings = vec![
            ("model", self.config.to_json()),
            ("pipeline split", files::format_split(&self.ranges)),
            ("`PipelineOptions.stages`", self.grid.stages.to_string()),
            ("pipelines", self.grid.replicas.to_string()),
            (
                "`PipelineOptions.micro_batches`",
                self.opts.micro_batches.to_string(),
            ),
            (
                "`PipelineOptions.schedule`",
                self.opts.schedule.name().to_string(),
            ),
            (
                "`checkpoint.resume`",
                self.cfg.checkpoint.resume.to_string(),
            ),
        ];
        settings.extend(
            hparams
                .iter()
                .filter(|(k, _)| !matches!(k.as_str(), "data" | "labels" | "weights"))
                .map(|(k, v)| (k.as_str(), v.to_string())),
        );
        distributed::agree_settings(&self.comm, &settings)
    }

    /// `--zero`: this rank's shard of the stage's optimizer, over the stage's replicas; when
    /// resuming after `resume`, its state from the stage's file of that epoch (written by any
    /// number of replicas), read by replica 0.
    fn start_sharding(
        &self,
        model: &StageModel,
        resume: usize,
        log: &mut dyn FnMut(&str),
    ) -> Result<Option<ZeroOptimizer>> {
        let (Some(replicas), true) = (&self.replicas, self.cfg.exchange.zero > 0) else {
            return Ok(None);
        };
        // A resume inside the fine-tuning phase shards what that phase trains; one right at
        // the switch starts from the frozen phase's state of the head.
        let fine_tuning = self.cfg.model.freeze_backbone && self.fine_tuning(resume + 1);
        let trains = if fine_tuning {
            super::model::unfrozen(self.cfg, model.clone())
        } else {
            model.clone()
        };
        if burn_dist::flat::module::trainable_names(&trains).is_empty() {
            // A stage frozen whole (the backbone's first units): nothing to shard until the
            // fine-tuning phase starts.
            return Ok(None);
        }
        let from = if resume > 0 && self.stage_wrote_state(model, resume) {
            resume
        } else {
            0
        };
        let dir = files::stage_dir(&self.cfg.run_dir, self.stage);
        let at = super::zero::ShardStart {
            dir: &dir,
            resume: from,
            new_at_zero: fine_tuning && self.cfg.model.unfreeze_after == Some(resume),
            units: None,
            rows: None,
        };
        let z = super::zero::start(self.cfg, &trains, self.steps_per_epoch, replicas, at)?
            // `--clip-grad`: the norm over every stage, not this stage's replicas alone.
            .with_norm_over(self.comm.clone());
        log(&format!(
            "ZeRO stage {} over each stage's {} replicas: stage {}'s replica 0 keeps the \
             optimizer state of {}",
            self.cfg.exchange.zero,
            self.grid.replicas,
            self.stage,
            z.describe()
        ));
        Ok(Some(z))
    }

    /// Whether this stage trained something in `epoch`, so `--zero` wrote its state: not when
    /// the epoch was frozen and `frozen` (the stage as the frozen phase trains it) has nothing
    /// to train.
    fn stage_wrote_state(&self, frozen: &StageModel, epoch: usize) -> bool {
        self.fine_tuning(epoch)
            || !self.cfg.model.freeze_backbone
            || !burn_dist::flat::module::trainable_names(frozen).is_empty()
    }

    fn pipeline(&self) -> Result<Pipeline> {
        Ok(Pipeline::new(
            self.comm.transport().clone(),
            self.grid.pipeline(self.replica),
            self.opts.schedule,
        )?
        .with_timeout(collective_timeout())
        .with_recompute(self.cfg.compute.recompute))
    }
}

mod average;
mod files;
mod split;
mod step;
mod store;

/// A stage's part of the epoch loop: its pipeline links, its units and their optimizer.
struct StageStrategy<'r, 'a> {
    run: &'r PipelineRun<'a>,
    pipe: Pipeline,
    /// Taken out while an epoch trains (a step consumes the module).
    model: Option<StageModel>,
    optim: ModuleOptimizer,
    /// Whether the fine-tuning phase has unfrozen the backbone.
    unfrozen: bool,
    /// fp16's loss scale, the same on every rank (one verdict per step for the job).
    scaler: Option<LossScaler>,
    /// `--zero`: this rank's shard of the stage's optimizer over the stage's replicas
    /// (`optim` then never steps).
    zero: Option<ZeroOptimizer>,
}

impl Strategy for StageStrategy<'_, '_> {
    fn epoch(&mut self, epoch: usize, log: &mut dyn FnMut(&str)) -> Result<Option<Row>> {
        let t = Instant::now();
        let mut model = self
            .model
            .take()
            .ok_or_else(|| HearthError::Training("the stage lost its model".into()))?;
        if self.run.fine_tuning(epoch) && !self.unfrozen {
            let after = self.run.cfg.model.unfreeze_after.unwrap_or(epoch - 1);
            log(&self.run.rates.unfreeze_line(after));
            model = super::model::unfrozen(self.run.cfg, model);
            self.unfrozen = true;
            // --zero: the state moves to the larger set of trainable tensors (a stage that
            // trained nothing so far starts its sharded optimizer now).
            if let (true, Some(replicas)) = (self.run.cfg.exchange.zero > 0, &self.run.replicas) {
                self.zero = Some(match &self.zero {
                    Some(z) => super::zero::refit(
                        self.run.cfg,
                        z,
                        &model,
                        self.run.steps_per_epoch,
                        replicas,
                    )?
                    .with_norm_over(self.run.comm.clone()),
                    None => super::zero::start(
                        self.run.cfg,
                        &model,
                        self.run.steps_per_epoch,
                        replicas,
                        super::zero::ShardStart {
                            dir: &files::stage_dir(&self.run.cfg.run_dir, self.run.stage),
                            resume: 0,
                            new_at_zero: false,
                            units: None,
                            rows: None,
                        },
                    )?
                    .with_norm_over(self.run.comm.clone()),
                });
            }
        }
        let (model, sums, scores) = self.run.train_epoch(
            &mut self.pipe,
            model,
            &mut self.optim,
            &mut self.zero,
            epoch,
            &mut self.scaler,
        )?;
        let val = self.run.validate(&mut self.pipe, &model)?;
        self.model = Some(model);
        // Every rank gets the row: every rank decides early stopping the same way.
        let mut row = self
            .run
            .epoch_row((sums, scores), val, epoch, t.elapsed())?;
        self.run.validate_average(&mut self.pipe, &mut row)?;
        Ok(Some(row))
    }

    fn checkpoint(&mut self, epoch: usize, best: Option<usize>) -> Result<()> {
        let model = self
            .model
            .as_ref()
            .ok_or_else(|| HearthError::Training("the stage lost its model".into()))?;
        // --zero: the stage's replicas' shards to its replica 0 first, written before the
        // files that complete the epoch.
        if let (Some(z), Some(replicas)) = (&self.zero, &self.run.replicas) {
            super::zero::save_state(
                &files::stage_dir(&self.run.cfg.run_dir, self.run.stage),
                epoch,
                z,
                replicas,
            )?;
        }
        self.run
            .checkpoint(model, &self.optim, self.scaler.as_ref(), epoch, best)
    }

    fn decode_failures(&self) -> (usize, usize) {
        self.run.loaders.decode_failures()
    }
}

impl PipelineRun<'_> {
    fn train(mut self, log: &mut dyn FnMut(&str)) -> Result<TrainReport> {
        let cfg = self.cfg;
        let started = self.started;
        let rank = self.comm.rank();
        let hparams = cfg.hyperparameters();
        let mut pipe = self.pipeline()?;
        self.settle_split(&mut pipe, log)?;
        self.agree(&hparams)?;
        let mut model = self.init_stage()?;
        let mut optim = optimizer(cfg);
        let mut scaler = (cfg.compute.precision == Precision::Fp16).then(LossScaler::default);
        let epochs = Epochs::new(cfg, rank == 0);
        let resume_epoch = if cfg.checkpoint.resume {
            let epoch = self.agreed_resume_epoch()?;
            run_dir::check_resume_compatible(&cfg.run_dir, &self.config.to_json(), &hparams)?;
            if cfg.exchange.zero == 0 || self.stage_wrote_state(&model, epoch) {
                super::zero::check_resume_in(
                    cfg,
                    &files::stage_dir(&cfg.run_dir, self.stage),
                    epoch,
                )?;
            }
            epochs.reload(epoch)?;
            let (m, o) = self.load_checkpoint(model, optim, epoch)?;
            model = m;
            optim = o;
            if scaler.is_some() {
                scaler = Some(self.load_loss_scale(epoch)?);
            }
            log(&format!("resuming after epoch {epoch}"));
            epoch
        } else {
            0
        };
        if rank == 0 {
            run_dir::record(&cfg.run_dir, &self.config.to_json(), &hparams)?;
        }
        epochs.check_left(resume_epoch)?;
        *self.step_log.borrow_mut() = StepLog::open(
            cfg.checkpoint.log_every,
            &cfg.run_dir,
            rank == 0,
            (resume_epoch * self.steps_per_epoch) as u64,
            log,
        )?;
        let zero = self.start_sharding(&model, resume_epoch, log)?;
        self.start_average(&model, resume_epoch)?;
        let mut strategy = StageStrategy {
            run: &self,
            pipe,
            model: Some(model),
            optim,
            unfrozen: false,
            scaler,
            zero,
        };
        let last = epochs.run(resume_epoch, &mut strategy, log)?;
        self.comm.barrier()?;
        let best = epochs.best_or_err()?;
        let exported = self.export(best, log)?;
        let mut per_class_auroc = None;
        if let Some(model) = exported {
            epochs.plot(log);
            let multi_label = self.objective.multi_label();
            per_class_auroc = auroc_report(
                multi_label,
                &model,
                &self.classes,
                Box::new(
                    self.loaders
                        .full_val
                        .epoch(0, &self.plain_device)
                        .map(move |b| targets(b?, multi_label)),
                ),
                &cfg.run_dir,
                log,
            )?;
        }
        self.comm.barrier()?;
        let images = last.saturating_sub(resume_epoch).max(1) * self.loaders.train.set().len();
        let mut report = epochs.report(
            best,
            started,
            images,
            self.classes.clone(),
            rank,
            self.comm.world(),
        );
        report.per_class_auroc = per_class_auroc;
        report.skipped = self.loaders.skipped();
        Ok(report)
    }
}
