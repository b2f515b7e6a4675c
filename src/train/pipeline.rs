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

use std::collections::BTreeSet;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{ModuleOptimizer, OptimizerRecord};
use burn::prelude::*;
use burn::store::ModuleRecord;
use burn_dist::ddp::{allreduce_grads, broadcast_module, module_values, with_module_values};
use burn_dist::pipeline::{Activation, Pipeline};
use burn_dist::transport::group::{Grid, Group};
use burn_dist::wire::Kind;
use burn_dist::{Communicator, ReduceOp};
use hearth_models::stages::Unit;
use hearth_models::{Classifier, ModelConfig, Preprocessing, save_model_with};

use super::best::{BestRule, Patience, best_epoch};
use super::config::{PipelineBalance, PipelineOptions};
use super::logger::{EpochTable, metrics_csv};
use super::model::{SEED_LOCK, epoch_seed, model_config, optimizer};
use super::{EpochRows, TrainConfig, TrainReport, distributed, run_dir, sets};
use crate::pipeline::{StageModel, UnitCost, balance, balance_by, stage_memory};
use crate::schedule::Schedule as LrSchedule;
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
    table: EpochTable,
    lr: LrSchedule,
    steps_per_epoch: usize,
}

/// Sums over a stage's share of an epoch: (loss x samples, correct, samples).
#[derive(Debug, Default, Clone, Copy)]
struct Sums {
    loss: f64,
    correct: f64,
    count: f64,
}

pub(super) fn train(
    cfg: &TrainConfig,
    device: &Device,
    log: &mut dyn FnMut(&str),
) -> Result<TrainReport> {
    let Some(opts) = &cfg.pipeline else {
        return Err(HearthError::InvalidArgument(
            "pipeline training without pipeline options".into(),
        ));
    };
    let started = Instant::now();
    let info = cfg.dist.clone().filter(|i| i.world > 1).ok_or_else(|| {
        HearthError::InvalidArgument(format!(
            "--pipeline-stages {} needs {} processes or a multiple (one per stage and replica): \
             add --nproc {}",
            opts.stages, opts.stages, opts.stages
        ))
    })?;
    let grid = Grid::new(opts.stages, info.world)?;
    let comm = Arc::new(distributed::connect(&info, log)?);
    let rank = comm.rank();
    let mut quiet = |_: &str| {};
    let log: &mut dyn FnMut(&str) = if rank == 0 { log } else { &mut quiet };
    if rank == 0 {
        run_dir::prepare(&cfg.run_dir)?;
    }
    let (train_set, val_set) = distributed::load_data(cfg, &comm, log)?;
    if train_set.multi_label {
        return Err(HearthError::InvalidArgument(
            "multi-label sets do not train with --pipeline-stages yet".into(),
        ));
    }
    if !cfg.batch_size.is_multiple_of(grid.replicas) {
        return Err(HearthError::InvalidArgument(format!(
            "--batch-size {} must divide evenly over {} pipelines",
            cfg.batch_size, grid.replicas
        )));
    }
    let (stage, replica) = grid.place(rank);
    let classes = train_set.classes.clone();
    let config = model_config(&cfg.model, classes.len())?;
    let ranges = split(cfg, opts, &config, device)?;
    let plain = device.clone();
    log(&format!(
        "pipeline: {} stages x {} replicas, {} micro-batches of a {}-image batch per replica, {:?}",
        grid.stages,
        grid.replicas,
        opts.micro_batches,
        cfg.batch_size / grid.replicas,
        opts.schedule
    ));
    let loaders = sets::Loaders::new(cfg, train_set, val_set, replica, grid.replicas)?;
    let steps_per_epoch = loaders.train.batches_per_epoch().max(1);
    let replicas = if grid.replicas > 1 {
        let group = Group::new(comm.transport().clone(), grid.stage_replicas(stage), 1)?;
        Some(Communicator::new(Arc::new(group)).with_compression(cfg.compression))
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
        table: EpochTable::default(),
        lr: cfg.lr_schedule(cfg.scaled_lr(log)?, steps_per_epoch)?,
        steps_per_epoch,
    };
    run.train(started, log)
}

/// The run's recorded split (`pipeline_split.txt`), which a resumed run keeps.
fn split_file(run_dir: &Path) -> PathBuf {
    run_dir.join("pipeline_split.txt")
}

fn format_split(ranges: &[Range<usize>]) -> String {
    ranges
        .iter()
        .map(|r| format!("{}:{}", r.start, r.end))
        .collect::<Vec<_>>()
        .join(",")
}

/// The stages' unit ranges: `--pipeline-split`, or balanced by parameter count.
fn split(
    cfg: &TrainConfig,
    opts: &PipelineOptions,
    config: &ModelConfig,
    device: &Device,
) -> Result<Vec<Range<usize>>> {
    let n = config.units();
    let ranges = match &opts.split {
        Some(r) => r.clone(),
        None => balance(&config.unit_params(device)?, opts.stages)?,
    };
    if ranges.last().map(|r| r.end) != Some(n) {
        return Err(HearthError::InvalidArgument(format!(
            "--pipeline-split must cover units 0..{n} of {} (it ends at {})",
            cfg.model,
            ranges.last().map_or(0, |r| r.end)
        )));
    }
    Ok(ranges)
}

/// `run_dir/checkpoint/stage-<s>`.
fn stage_dir(run_dir: &Path, stage: usize) -> PathBuf {
    run_dir.join("checkpoint").join(format!("stage-{stage}"))
}

fn model_file(run_dir: &Path, stage: usize, epoch: usize) -> PathBuf {
    stage_dir(run_dir, stage).join(format!("model-{epoch}.bpk"))
}

fn optim_file(run_dir: &Path, stage: usize, epoch: usize) -> PathBuf {
    stage_dir(run_dir, stage).join(format!("optim-{epoch}.bpk"))
}

/// Epochs whose model and optimizer files exist for every one of `stages` stages (on a shared
/// disk; on separate machines each rank checks what it can see, and the ranks agree on the
/// minimum).
pub fn complete_pipeline_checkpoints(run_dir: &Path, stages: usize) -> BTreeSet<usize> {
    (0..stages)
        .map(|s| stage_epochs(run_dir, s))
        .reduce(|a, b| a.intersection(&b).copied().collect())
        .unwrap_or_default()
}

/// Epochs for which stage `stage` has both its model and optimizer files.
fn stage_epochs(run_dir: &Path, stage: usize) -> BTreeSet<usize> {
    run_dir::checkpoints_in(&stage_dir(run_dir, stage), &["model", "optim"])
}

impl PipelineRun<'_> {
    fn is_last(&self) -> bool {
        self.stage + 1 == self.grid.stages
    }

    /// This stage's units, each seeded by its index (the same on every replica and for every
    /// split).
    fn init_stage(&self) -> Result<StageModel> {
        let _rng = SEED_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let mut units: Vec<Unit> = Vec::new();
        for u in self.ranges[self.stage].clone() {
            self.device
                .seed(epoch_seed(self.cfg.seed, u64::MAX - u as u64, 0));
            units.extend(self.config.init_units(u..u + 1, &self.device)?);
        }
        let stage = StageModel { units };
        // Materialise the lazily initialised parameters while the seed holds.
        let _ = module_values(&stage);
        Ok(stage)
    }

    fn pipeline(&self) -> Result<Pipeline> {
        Ok(Pipeline::new(
            self.comm.transport().clone(),
            self.grid.pipeline(self.replica),
            self.opts.schedule,
        )?
        .with_timeout(collective_timeout()))
    }

    /// Micro-batch sizes of a batch of `n`: M nearly equal parts (fewer when n < M).
    fn micro_sizes(&self, n: usize) -> Vec<usize> {
        let m = self.opts.micro_batches.min(n).max(1);
        (0..m).map(|i| n / m + usize::from(i < n % m)).collect()
    }

    /// (first sample, size) of each micro-batch of a batch of `n`.
    fn micro_split(&self, n: usize) -> Vec<(usize, usize)> {
        let mut start = 0;
        self.micro_sizes(n)
            .into_iter()
            .map(|k| {
                start += k;
                (start - k, k)
            })
            .collect()
    }

    /// The final split: the one a resumed run recorded, else measured by time
    /// (`--pipeline-balance time`), else the one given; printed with each stage's parameters.
    fn settle_split(&mut self, pipe: &mut Pipeline, log: &mut dyn FnMut(&str)) -> Result<()> {
        let file = split_file(&self.cfg.run_dir);
        let mut measured: Option<Vec<UnitCost>> = None;
        if self.cfg.resume && file.is_file() {
            let text = std::fs::read_to_string(&file).map_err(|source| HearthError::Read {
                path: file.clone(),
                source,
            })?;
            let recorded = PipelineOptions::parse_split(text.trim())?;
            if recorded.len() != self.grid.stages
                || recorded.last().map(|r| r.end) != Some(self.config.units())
            {
                return Err(HearthError::InvalidArgument(format!(
                    "--resume: {} records the split {} for another layout than {} stages of {} units",
                    file.display(),
                    text.trim(),
                    self.grid.stages,
                    self.config.units()
                )));
            }
            self.ranges = recorded;
        } else if self.opts.balance != PipelineBalance::Params && self.opts.split.is_none() {
            let costs = self.measure_units(pipe)?;
            self.ranges = match self.opts.balance {
                PipelineBalance::Memory => {
                    let params = self.config.unit_params(&self.plain_device)?;
                    let state = self.state_bytes_per_param();
                    balance_by(costs.len(), self.grid.stages, |s, r| {
                        stage_memory(&params, &costs, r, state, self.in_flight(s))
                    })?
                }
                _ => {
                    let weights: Vec<usize> = costs
                        .iter()
                        .map(|c| ((c.seconds * 1e6).round() as usize).max(1))
                        .collect();
                    balance(&weights, self.grid.stages)?
                }
            };
            measured = Some(costs);
        }
        if self.comm.rank() == 0 {
            run_dir::write_atomic(&file, &format_split(&self.ranges))?;
        }
        let weights = self.config.unit_params(&self.plain_device)?;
        log(&format!(
            "split ({}): {}",
            if measured.is_some() && self.opts.balance == PipelineBalance::Memory {
                "balanced by estimated memory"
            } else if measured.is_some() {
                "balanced by measured time"
            } else if self.cfg.resume {
                "as the run recorded it"
            } else if self.opts.split.is_some() {
                "as given"
            } else {
                "balanced by parameters"
            },
            format_split(&self.ranges)
        ));
        for (s, r) in self.ranges.iter().enumerate() {
            let params: usize = weights[r.clone()].iter().sum();
            let ms = measured
                .as_ref()
                .map(|c| {
                    let seconds: f64 = c[r.clone()].iter().map(|u| u.seconds).sum();
                    let memory = stage_memory(
                        &weights,
                        c,
                        r.clone(),
                        self.state_bytes_per_param(),
                        self.in_flight(s),
                    );
                    format!(
                        ", {:.1} ms per micro-batch pass, ~{:.0} MB",
                        1e3 * seconds,
                        memory / 1e6
                    )
                })
                .unwrap_or_default();
            log(&format!(
                "  stage {s}: units {}..{} of {}, {params} parameters{ms} (ranks {:?})",
                r.start,
                r.end,
                self.config.units(),
                self.grid.stage_replicas(s)
            ));
        }
        Ok(())
    }

    /// Time and held memory of one training pass of every unit on a micro-batch of the first
    /// batch ([`crate::pipeline::measure_units`]), measured on each unit's rank.
    fn measure_units(&self, pipe: &mut Pipeline) -> Result<Vec<UnitCost>> {
        let stage = self.init_stage()?;
        let batch = self
            .loaders
            .train
            .epoch(0, &self.device)
            .next()
            .ok_or_else(|| HearthError::Training("the training set gave no batch".into()))??;
        let n = batch.images.dims()[0];
        let x = batch.images.narrow(0, 0, self.micro_split(n)[0].1);
        crate::pipeline::measure_units(
            &stage,
            self.ranges[self.stage].start,
            self.config.units(),
            pipe,
            &self.comm,
            Activation::Rank4(x),
            &self.device,
        )
    }

    /// Bytes each parameter costs a stage: weights, gradients, their sum over micro-batches,
    /// and the optimizer's state (momentum: 1 value; Adam, AdamW, LARS: up to 2).
    fn state_bytes_per_param(&self) -> f64 {
        let optimizer_values = match self.cfg.optimizer {
            super::config::OptimizerKind::Sgd => 1.0,
            _ => 2.0,
        };
        4.0 * (3.0 + optimizer_values)
    }

    /// Micro-batches whose activations stage `s` holds at once under the schedule.
    fn in_flight(&self, s: usize) -> usize {
        self.opts
            .schedule
            .held(s, self.grid.stages, self.opts.micro_batches)
    }

    fn train(mut self, started: Instant, log: &mut dyn FnMut(&str)) -> Result<TrainReport> {
        let cfg = self.cfg;
        let rank = self.comm.rank();
        let hparams = cfg.hyperparameters();
        let mut pipe = self.pipeline()?;
        self.settle_split(&mut pipe, log)?;
        let mut model = self.init_stage()?;
        let mut optim = optimizer(cfg);
        let resume_epoch = if cfg.resume {
            let epoch = self.agreed_resume_epoch()?;
            run_dir::check_resume_compatible(&cfg.run_dir, &self.config, &hparams)?;
            run_dir::reload_table(&cfg.run_dir.join("metrics.csv"), &self.table, epoch)?;
            model = model.load_record(
                ModuleRecord::load(model_file(&cfg.run_dir, self.stage, epoch)).map_err(|e| {
                    HearthError::Training(format!("stage {} epoch {epoch}: {e}", self.stage))
                })?,
            );
            optim = optim.load_record(
                OptimizerRecord::load(optim_file(&cfg.run_dir, self.stage, epoch)).map_err(
                    |e| HearthError::Training(format!("stage {} epoch {epoch}: {e}", self.stage)),
                )?,
            );
            log(&format!("resuming after epoch {epoch}"));
            epoch
        } else {
            0
        };
        if rank == 0 {
            run_dir::record(&cfg.run_dir, &self.config, &hparams)?;
        }
        let end = cfg.stop_after_epoch.unwrap_or(cfg.epochs).min(cfg.epochs);
        if resume_epoch >= end {
            return Err(HearthError::InvalidArgument(format!(
                "{} has already finished epoch {resume_epoch} of {}; nothing left to train",
                cfg.run_dir.display(),
                cfg.epochs
            )));
        }
        let rule = BestRule {
            table: self.table.clone(),
            monitor: cfg.monitor,
            min_delta: cfg.min_delta,
        };
        for epoch in resume_epoch + 1..=end {
            let t = Instant::now();
            let (trained, train_sums) = self.train_epoch(&mut pipe, model, &mut optim, epoch)?;
            model = trained;
            let val_sums = self.validate(&mut pipe, &model, epoch)?;
            let row = self.epoch_row(train_sums, val_sums, epoch, t.elapsed())?;
            if let Ok(mut table) = self.table.lock() {
                table.insert(epoch, row.clone());
            }
            if rank == 0 {
                self.write_csv()?;
                log(&format!(
                    "epoch {epoch}/{}: train loss {:.4} acc {:.1}% | val loss {:.4} acc {:.1}% | {:.0} img/s",
                    cfg.epochs,
                    row["train_loss"],
                    row["train_accuracy"],
                    row["val_loss"],
                    row["val_accuracy"],
                    row["train_images_per_sec"]
                ));
            }
            self.checkpoint(&model, &optim, epoch, rule.best())?;
            if let Some(patience) = cfg.patience {
                let stop = Patience {
                    rule: rule.clone(),
                    patience,
                    origin: 0,
                };
                if stop.exhausted(epoch) && epoch < end {
                    log(&format!(
                        "early stopping after epoch {epoch}: no improvement of {} in {patience} epochs",
                        cfg.monitor.column()
                    ));
                    break;
                }
            }
        }
        self.comm.barrier()?;
        let rows: EpochRows = self.table.lock().map(|t| t.clone()).unwrap_or_default();
        let best = best_epoch(&rows, cfg.monitor, cfg.min_delta).ok_or_else(|| {
            HearthError::Training(format!(
                "no epoch has a {} value to pick the best one by",
                cfg.monitor.column()
            ))
        })?;
        self.export(best, &rows, log)?;
        self.comm.barrier()?;
        let epochs_run = rows.keys().copied().max().unwrap_or(0);
        let mut report = TrainReport::summarise(
            cfg,
            &rows,
            best,
            started,
            epochs_run.saturating_sub(resume_epoch).max(1) * self.loaders.train.set().len(),
            self.classes.clone(),
        );
        report.rank = rank;
        report.world = self.comm.world();
        Ok(report)
    }

    /// The last epoch every stage has a complete checkpoint of, agreed by all ranks (each sees
    /// its own disk).
    fn agreed_resume_epoch(&self) -> Result<usize> {
        let mine = complete_pipeline_checkpoints(&self.cfg.run_dir, self.grid.stages)
            .last()
            .copied()
            .unwrap_or(0);
        // The smallest over the ranks (exact in f32 for epoch counts).
        let all = self.comm.all_gather(&[mine as f32])?;
        let epoch = all.into_iter().fold(f32::MAX, f32::min) as usize;
        if epoch == 0 {
            return Err(HearthError::InvalidArgument(format!(
                "--resume: {} has no epoch checkpointed by every pipeline stage",
                self.cfg.run_dir.display()
            )));
        }
        Ok(epoch)
    }

    fn train_epoch(
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
            model = optim.step(self.lr.lr_at(step), model, out.grads);
        }
        if let Some(replicas) = &self.replicas {
            // Batch norm's running statistics saw each replica's own data: replica 0's go to
            // the others (as DDP does), so validation, checkpoints and the export agree.
            model = broadcast_module(model, replicas)?;
        }

        Ok((model, sums))
    }

    fn validate(&self, pipe: &mut Pipeline, model: &StageModel, _epoch: usize) -> Result<Sums> {
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
    fn epoch_row(
        &self,
        train: Sums,
        val: Sums,
        epoch: usize,
        took: Duration,
    ) -> Result<std::collections::BTreeMap<String, f64>> {
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
        let step = epoch * self.steps_per_epoch - 1;
        Ok([
            ("train_loss", per(v[0], v[2])),
            ("train_accuracy", 100.0 * per(v[1], v[2])),
            ("val_loss", per(v[3], v[5])),
            ("val_accuracy", 100.0 * per(v[4], v[5])),
            ("train_lr", self.lr.lr_at(step)),
            (
                "train_images_per_sec",
                f64::from(v[2]) / took.as_secs_f64().max(1e-9),
            ),
        ]
        .into_iter()
        .map(|(k, x)| (k.to_string(), x))
        .collect())
    }

    fn write_csv(&self) -> Result<()> {
        let table = self.table.lock().map(|t| t.clone()).unwrap_or_default();
        run_dir::write_atomic(&self.cfg.run_dir.join("metrics.csv"), &metrics_csv(&table))
    }

    /// Replica 0 of each stage writes its part of `epoch` and keeps only the best and the last
    /// epochs.
    fn checkpoint(
        &self,
        model: &StageModel,
        optim: &ModuleOptimizer,
        epoch: usize,
        best: Option<usize>,
    ) -> Result<()> {
        if self.replica == 0 {
            let dir = stage_dir(&self.cfg.run_dir, self.stage);
            std::fs::create_dir_all(&dir).map_err(|source| HearthError::Write {
                path: dir.clone(),
                source,
            })?;
            let fail = |what: &str, e: String| {
                HearthError::Training(format!(
                    "saving stage {}'s {what} of epoch {epoch}: {e}",
                    self.stage
                ))
            };
            // Optimizer first: a model file is the sign that the epoch's files are complete.
            optim
                .to_record()
                .save(optim_file(&self.cfg.run_dir, self.stage, epoch))
                .map_err(|e| fail("optimizer state", e.to_string()))?;
            // The record holds batch norm's latest statistics, not the ones a step behind.
            burn_dist::ddp::sync_running_stats(model);
            model
                .clone()
                .into_record()
                .save(model_file(&self.cfg.run_dir, self.stage, epoch))
                .map_err(|e| fail("weights", e.to_string()))?;
            for old in stage_epochs(&self.cfg.run_dir, self.stage)
                .into_iter()
                .filter(|&e| e != epoch && Some(e) != best)
            {
                let _ = std::fs::remove_file(model_file(&self.cfg.run_dir, self.stage, old));
                let _ = std::fs::remove_file(optim_file(&self.cfg.run_dir, self.stage, old));
            }
        }
        // Every stage's files exist before any rank goes on (and before a resume could look).
        self.comm.barrier()?;
        Ok(())
    }

    /// Replica 0 of every stage sends its best-epoch part to rank 0, which assembles the whole
    /// model and writes `model.bpk` and `metrics.png`.
    fn export(&self, best: usize, rows: &EpochRows, log: &mut dyn FnMut(&str)) -> Result<()> {
        let transport = self.comm.transport().clone();
        let tag = |stage: usize, tensor: usize, chunk: usize| {
            ((stage as u64) << 48) | ((tensor as u64) << 20) | chunk as u64
        };
        let load = |stage: usize| -> Result<StageModel> {
            let units = self
                .config
                .init_units(self.ranges[stage].clone(), &self.plain_device)?;
            let record =
                ModuleRecord::load(model_file(&self.cfg.run_dir, stage, best)).map_err(|e| {
                    HearthError::Training(format!(
                        "the best epoch's ({best}) checkpoint of stage {stage}: {e}"
                    ))
                })?;
            Ok(StageModel { units }.load_record(record))
        };
        let rank = self.comm.rank();
        if self.replica == 0 && rank != 0 {
            for (t, values) in module_values(&load(self.stage)?).into_iter().enumerate() {
                for (c, chunk) in values.chunks(EXPORT_CHUNK).enumerate() {
                    transport.send(
                        0,
                        Kind::User,
                        tag(self.stage, t, c),
                        burn_dist::wire::f32_to_bytes(chunk),
                    )?;
                }
            }
            return Ok(());
        }
        if rank != 0 {
            return Ok(());
        }
        let mut units = load(0)?.units;
        for stage in 1..self.grid.stages {
            let from = self.grid.pipeline(0)[stage];
            let empty = StageModel {
                units: self
                    .config
                    .init_units(self.ranges[stage].clone(), &self.plain_device)?,
            };
            let mut values = module_values(&empty);
            for (t, v) in values.iter_mut().enumerate() {
                let mut at = 0;
                for c in 0..v.len().div_ceil(EXPORT_CHUNK) {
                    let bytes = transport.recv(
                        from,
                        Kind::User,
                        tag(stage, t, c),
                        Instant::now() + collective_timeout(),
                    )?;
                    let expect = (v.len() - at).min(EXPORT_CHUNK);
                    let piece = burn_dist::wire::bytes_to_f32(&bytes, expect).map_err(|e| {
                        HearthError::Training(format!("stage {stage}'s tensor {t} at export: {e}"))
                    })?;
                    v[at..at + expect].copy_from_slice(&piece);
                    at += expect;
                }
            }
            units.extend(with_module_values(empty, values)?.units);
        }
        let model = Classifier::from_units(&self.config, units)?;
        save_model_with(
            &model,
            &self.config,
            Some(&self.classes),
            Some(&Preprocessing::eval(self.cfg.image_size)),
            &self.cfg.run_dir.join("model.bpk"),
        )?;
        log(&format!(
            "exported the best epoch ({best}, by {}) assembled from {} stages into {}",
            self.cfg.monitor.column(),
            self.grid.stages,
            self.cfg.run_dir.join("model.bpk").display()
        ));
        if let Err(e) = crate::plot::plot_metrics(rows, &self.cfg.run_dir.join("metrics.png")) {
            log(&format!("warning: no plot written: {e}"));
        }
        Ok(())
    }
}

/// A batch's images and class indices.
fn images_and_classes(batch: hearth_datasets::Batch) -> Result<(Tensor<4>, Tensor<1, Int>)> {
    let classes = batch
        .classes
        .ok_or_else(|| HearthError::Training("the loader gave no class indices".into()))?;
    Ok((batch.images, classes))
}

/// Samples of `logits` whose highest score is the class in `targets`.
pub(super) fn hits(logits: &Tensor<2>, targets: &Tensor<1, Int>) -> f64 {
    logits
        .clone()
        .argmax(1)
        .flatten::<1>(0, 1)
        .equal(targets.clone())
        .int()
        .sum()
        .into_scalar::<i64>() as f64
}

/// How long a stage waits for a neighbour (`HEARTH_COLLECTIVE_TIMEOUT`, default 120 s); a
/// neighbour that dies is reported sooner by the transport.
pub(super) fn collective_timeout() -> Duration {
    burn_dist::rendezvous::env_secs("HEARTH_COLLECTIVE_TIMEOUT").unwrap_or(Duration::from_secs(120))
}
