//! Training on burn-train's Learner: `hearth train` and the library API.
//!
//! Data: an image folder (`train/` + `val/`, or one folder split by `val_fraction`), or, with no
//! folder, a generated synthetic set. Model: any [`Architecture`](hearth_models::Architecture)
//! or the small default ResNet, optionally from torchvision weights with a new head (transfer
//! learning, frozen backbone). Burn's Learner runs the epochs with validation, metrics, TUI or
//! plain progress and checkpoints; this module adds `metrics.csv`, the best-epoch rule shared by
//! checkpoints, early stopping and the export into `model.bpk`, exact resume, and the summary.
//!
//! The steps of a run, one file each (private modules, named here for the reader):
//! - `config`: [`TrainConfig`] and its checks;
//! - `distributed`: joining a job, every rank reading the same data;
//! - `sets`: the image sets and this rank's loaders;
//! - `model`: the model (seeded, optionally pretrained) and the optimizer;
//! - [`run_dir`]: the run directory, atomic writes, what `--resume` reads back;
//! - `phase`: one Learner launch for single and data-parallel runs (the whole run, or the
//!   frozen / fine-tuning phases);
//! - `epochs`: the one epoch loop of the modes the Learner does not drive, over a `Strategy`;
//! - `allreduce`: one process or data parallel on that loop, for a user's own module;
//! - `shared` and `objective`: what those modes share below all of them (rates and phases,
//!   timeouts, the loss and metrics of single- and multi-label runs);
//! - `trainee`: what elastic and parameter-server runs train, Hearth's classifiers or a user's
//!   own Burn module ([`Net`], [`Examples`], [`train_custom`]);
//! - `best`: which epoch is best, which checkpoints stay, when to stop early;
//! - `export`: `model.bpk`, `metrics.png`, `auroc.csv`;
//! - `pipeline`: pipeline model parallelism (`--pipeline-stages`): stages, micro-batches,
//!   per-stage checkpoints, the assembled export;
//! - `elastic`: elastic data parallelism (`--elastic`);
//! - `ps`: parameter servers (`--ps`), sync or asynchronous (DOWNPOUR, ADAG, DynSGD, EASGD).
//!
//! A new training mode is a file (or folder) here with its `Strategy` for `epochs`, or a
//! burn-train strategy handed to `phase` where the Learner can drive it.

mod allreduce;
mod best;
mod builder;
mod catalog;
mod config;
mod data;
mod distributed;
mod elastic;
mod epochs;
mod export;
mod faults;
mod flat;
mod gate;
mod hparams;
mod logger;
mod model;
mod objective;
mod phase;
mod pipeline;
mod precision;
mod ps;
mod render;
mod report;
pub mod run_dir;
mod sets;
mod shared;
mod speed;
mod step;
mod targets;
mod trainee;
mod validate;
pub mod zero;

pub use crate::settings::{
    AugmentPreset, Balance, DEFAULT_MOMENTUM, EASGD_PEAK_ALPHA, ElasticOptions, FinetuneBn,
    Monitor, OptimizerKind, PipelineBalance, PipelineOptions, Precision, PsOptions, PsServers,
    TrainingMode,
};
pub use best::{BestRule, KeepBestAndLast, Patience, best_epoch};
pub use builder::TrainConfigBuilder;
pub use burn_dist::ps::Mode as PsMode;
pub use catalog::{
    DEFAULT_MODEL, MINI_DENSENET, MINI_MODELS, MINI_VGG, MINI_VGG_PLAIN, mini_resnet, mini_vgg,
    model_config,
};
pub use config::{
    CheckpointSettings, ComputeSettings, DataSettings, ExchangeSettings, MAY_CHANGE_ON_RESUME,
    ModelSettings, OptimSettings, TrainConfig,
};
pub use data::{ImageBatch, LoaderAdapter};
pub use elastic::{mark_finished, request_leave};
pub use hparams::{Hparams, LaunchRecord, PipelineRecord, PsRecord, Recorded, ServersRecord};
pub use logger::{CsvMetricLogger, EpochTable, NonFinite, Report, epoch_value};
pub use model::epoch_seed;
pub use precision::{LossScaler, Mixed, SharedScaler};
pub use render::PlainRenderer;
pub use report::{EpochRows, TrainReport};
pub use speed::{EpochCount, ImagesPerSecond};
pub use step::{MultiLabel, SingleLabel, Task};
pub use targets::Targets;
pub use trainee::{Custom, ExampleError, Examples, Net};

use std::sync::Arc;
use std::time::Instant;

use burn::prelude::*;
use hearth_datasets::ImageSet;
use hearth_models::ModelConfig;

use crate::{HearthError, Result};

/// Trains, validates every epoch, and exports the best epoch's weights to `run_dir/model.bpk`.
///
/// A multi-label set (`labels` CSV) trains [`MultiLabel`] (sigmoid head with biases at one,
/// binary cross-entropy, per-class AUROC); any other trains [`SingleLabel`].
pub fn train(cfg: &TrainConfig, device: &Device, log: &mut dyn FnMut(&str)) -> Result<TrainReport> {
    cfg.validate()?;
    crate::device::check_precision(device, cfg.compute.precision)?;
    if cfg.compute.recompute {
        log(if cfg.mode.pipeline().is_some() {
            "`compute.recompute`: each stage keeps only its micro-batches' inputs and computes their \
             activations again in the backward"
        } else {
            "`compute.recompute`: each unit keeps only its input and computes its activations again in \
             the backward"
        });
    }
    if cfg.exchange.overlap {
        log(
            "`exchange.overlap`: the model runs unit by unit, and each unit's gradients are averaged while \
             the units before it compute",
        );
    }
    match &cfg.mode {
        TrainingMode::Pipeline(_) => return pipeline::train(cfg, device, log),
        TrainingMode::Elastic(opts) => return elastic::train(cfg, opts, device, log),
        TrainingMode::ParameterServers(opts) => return ps::train(cfg, opts, device, log),
        TrainingMode::DataParallel => {}
    }
    let started = Instant::now();
    let dist = match &cfg.dist {
        Some(info) if info.world > 1 => {
            Some(distributed::connect(info, log)?.with_compression(cfg.exchange.compression))
        }
        _ => None,
    };
    let rank = dist.as_ref().map_or(0, |c| c.rank());
    let mut quiet = |_: &str| {};
    let log: &mut dyn FnMut(&str) = if rank == 0 { log } else { &mut quiet };
    if rank == 0 {
        run_dir::start(cfg, log)?;
        log(&format!("augmentation: {}", cfg.data.augmentation));
    }
    if cfg.exchange.overlap
        && let Some(notice) = dist.as_ref().and_then(shared::one_host_overlap_notice)
    {
        log(notice);
    }
    let (train_set, val_set) = match &dist {
        Some(comm) => distributed::load_data(cfg, comm, log)?,
        None => sets::load(cfg, log)?,
    };
    let dist = dist.map(Arc::new);
    let run = Run::new(cfg, device, train_set, val_set, started, dist, log)?;
    if run.multi_label {
        run.train::<MultiLabel>(log)
    } else {
        if cfg.checkpoint.monitor == Monitor::ValAuroc {
            return Err(HearthError::InvalidArgument(
                "`checkpoint.monitor` val_auroc needs a multi-label data set (`data.labels` FILE.csv)".into(),
            ));
        }
        run.train::<SingleLabel>(log)
    }
}

/// Trains a user's own Burn module on their own data ([`Custom`]: a [`Net`] and two
/// [`Examples`] sets) with `cfg`'s settings in `cfg.mode`: data parallel over `cfg.dist`'s
/// ranks (one process without it), elastic or on parameter servers: the
/// same validation, metrics, early stopping, checkpoints, exact resume and export as Hearth's
/// image models get. `model.bpk` holds the module's
/// weights (burnpack: load them with `ModuleRecord::load` into the same module).
///
/// The settings that only mean something for Hearth's image models (the `data` and `model`
/// sections, a pipeline `mode`, `compute.recompute`, `exchange.overlap`) are refused by name
/// when set.
pub fn train_custom<N: Net, E: Examples<Input = N::Input>>(
    cfg: &TrainConfig,
    custom: &Custom<N, E>,
    device: &Device,
    log: &mut dyn FnMut(&str),
) -> Result<TrainReport> {
    let defaults = TrainConfig::new(cfg.run_dir.clone());
    let image_only: [(&str, bool); 14] = [
        (
            "data.folder (the examples are the data)",
            cfg.data.folder.is_some(),
        ),
        (
            "data.val_fraction (the validation examples are given apart)",
            cfg.data.val_fraction != defaults.data.val_fraction,
        ),
        (
            "data.labels (a multi-label custom set: Custom::multi_label)",
            cfg.data.labels.is_some(),
        ),
        (
            "model.name (the module is the model)",
            cfg.model.name != defaults.model.name,
        ),
        ("model.weights", cfg.model.weights.is_some()),
        (
            "model.freeze_backbone (a custom module has no known backbone)",
            cfg.model.freeze_backbone,
        ),
        ("model.unfreeze_after", cfg.model.unfreeze_after.is_some()),
        ("model.finetune_lr", cfg.model.finetune_lr.is_some()),
        (
            "data.augmentation (augment in your Examples::batch)",
            cfg.data.augmentation != defaults.data.augmentation,
        ),
        (
            "data.image_size",
            cfg.data.image_size != defaults.data.image_size,
        ),
        (
            "data.workers (your Examples make the batches)",
            cfg.data.workers != defaults.data.workers,
        ),
        (
            "mode Pipeline (stages split Hearth's own models)",
            cfg.mode.pipeline().is_some(),
        ),
        (
            "compute.recompute (it recomputes a model's units, which a custom module does not have)",
            cfg.compute.recompute,
        ),
        (
            "exchange.overlap (it exchanges each of a model's units' gradients as the backward pass \
             finishes it, and a custom module has no units)",
            cfg.exchange.overlap,
        ),
    ];
    if let Some((name, _)) = image_only.iter().find(|(_, set)| *set) {
        return Err(HearthError::InvalidArgument(format!(
            "{name} is a setting of Hearth's image models; a custom model's run refuses it"
        )));
    }
    if cfg.compute.precision.is_low() && !N::MIXED_PRECISION {
        return Err(HearthError::InvalidArgument(format!(
            "precision {}: this module computes in f32 only (its Net::logits_in is the \
             default); override logits_in and set Net::MIXED_PRECISION to train it in mixed \
             precision, or train in fp32",
            cfg.compute.precision
        )));
    }
    if custom.is_multi_label() && cfg.optim.label_smoothing > 0.0 {
        return Err(HearthError::InvalidArgument(
            "optim.label_smoothing applies to single-label targets; this custom set is multi-label"
                .into(),
        ));
    }
    if !custom.is_multi_label() && cfg.checkpoint.monitor == Monitor::ValAuroc {
        return Err(HearthError::InvalidArgument(
            "checkpoint.monitor val_auroc needs multi-label targets (Custom::multi_label)".into(),
        ));
    }
    // The image checks, less the one answered above: val_auroc with multi-label examples
    // instead of a --labels file.
    let mut checked = cfg.clone();
    checked.checkpoint.monitor = defaults.checkpoint.monitor;
    checked.validate()?;
    crate::device::check_precision(device, cfg.compute.precision)?;
    match &cfg.mode {
        TrainingMode::Elastic(opts) => elastic::train_with(cfg, opts, custom, device, log),
        TrainingMode::ParameterServers(opts) => ps::train_with(cfg, opts, custom, device, log),
        // Refused above, with the other image-model settings.
        TrainingMode::Pipeline(_) | TrainingMode::DataParallel => {
            allreduce::train_with(cfg, custom, device, log)
        }
    }
}

/// What the steps of a run share once the data and the job are known.
struct Run<'a> {
    cfg: &'a TrainConfig,
    /// The autodiff view of the device (training) and the device itself (validation, export).
    device: Device,
    plain_device: Device,
    loaders: sets::Loaders,
    classes: Vec<String>,
    multi_label: bool,
    config: ModelConfig,
    /// The learning rate after large-batch scaling.
    lr: f64,
    /// The epoch this launch starts after (0, or the checkpoint `--resume` continues).
    resume_epoch: usize,
    /// Every epoch of the run so far, also those before a resume.
    table: EpochTable,
    dist: Option<Arc<burn_dist::Communicator>>,
    rank: usize,
    world: usize,
    started: Instant,
    /// `--precision`, with the fp16 loss scaler both training phases share.
    mixed: Mixed,
}

impl<'a> Run<'a> {
    fn new(
        cfg: &'a TrainConfig,
        device: &Device,
        train_set: ImageSet,
        val_set: ImageSet,
        started: Instant,
        dist: Option<Arc<burn_dist::Communicator>>,
        log: &mut dyn FnMut(&str),
    ) -> Result<Self> {
        let classes = train_set.classes.clone();
        let multi_label = train_set.multi_label;
        let (rank, world) = dist.as_ref().map_or((0, 1), |c| (c.rank(), c.world()));
        let loaders = sets::Loaders::new(cfg, train_set, val_set, rank, world)?;
        let config = catalog::model_config(&cfg.model.name, classes.len())?;
        let lr = cfg.scaled_lr(log)?;
        // Resume: burn's checkpointer restores model, optimizer and scheduler of the last
        // complete epoch; data order, augmentation and the model's random stream are functions
        // of (seed, epoch); the earlier epochs' metrics come back from metrics.csv.
        let hparams = cfg.hyperparameters();
        let table = EpochTable::default();
        let resume_epoch = if cfg.checkpoint.resume {
            let epoch = run_dir::last_complete_checkpoint(&cfg.run_dir)?;
            run_dir::check_resume_compatible(&cfg.run_dir, &config.to_json(), &hparams)?;
            zero::check_resume(cfg, epoch)?;
            run_dir::reload_table(&cfg.run_dir.join("metrics.csv"), &table, epoch)?;
            log(&format!("resuming after epoch {epoch}"));
            epoch
        } else {
            0
        };
        if rank == 0 {
            run_dir::record(&cfg.run_dir, &config.to_json(), &hparams)?;
        }
        Ok(Self {
            cfg,
            device: device.clone().autodiff(),
            plain_device: device.clone(),
            loaders,
            classes,
            multi_label,
            config,
            lr,
            resume_epoch,
            table,
            dist,
            rank,
            world,
            started,
            mixed: {
                let mut mixed = Mixed::new(cfg.compute.precision, world > 1, rank);
                mixed.recompute = cfg.compute.recompute;
                if let (Some(s), true) = (&mixed.scaler, resume_epoch > 0) {
                    s.restore(&cfg.run_dir, resume_epoch)?;
                }
                mixed
            },
        })
    }

    fn epochs_done(&self) -> usize {
        self.table
            .lock()
            .ok()
            .and_then(|t| t.keys().copied().max())
            .unwrap_or(0)
    }

    fn phase<T: Task>(
        &self,
        trainee: T,
        lr: f64,
        first: usize,
        last: usize,
    ) -> phase::Phase<'_, T> {
        phase::Phase {
            trainee,
            lr,
            first,
            last,
            patience_origin: None,
            batches_per_epoch: self.loaders.train.batches_per_epoch().max(1),
            train_loader: &self.loaders.train,
            val_loader: &self.loaders.val,
            table: &self.table,
            dist: self.dist.as_ref(),
            started: self.started,
        }
    }

    /// Phase 1 (the whole run, or the frozen epochs before `unfreeze_after`), phase 2 (everything
    /// at the fine-tuning rate), then the export of the best epoch.
    fn train<T: Task>(self, log: &mut dyn FnMut(&str)) -> Result<TrainReport> {
        let cfg = self.cfg;
        let model = model::init_model(
            cfg,
            &self.config,
            self.classes.len(),
            T::MULTI_LABEL,
            &self.device,
            log,
        )?;
        // This launch may end before `epochs` (`stop_after_epoch`); the schedule spans them all.
        let end = cfg
            .checkpoint
            .stop_after_epoch
            .unwrap_or(cfg.epochs)
            .min(cfg.epochs);
        if self.resume_epoch >= end {
            return Err(HearthError::InvalidArgument(format!(
                "{} has already finished epoch {} of {}; nothing left to train",
                cfg.run_dir.display(),
                self.resume_epoch,
                cfg.epochs
            )));
        }
        let unfreeze_at = cfg
            .model
            .unfreeze_after
            .filter(|_| cfg.model.freeze_backbone);
        let phase1_end = unfreeze_at.map_or(end, |n| n.min(end));
        let mut done = self.resume_epoch;
        let mut trained: Option<T> = None;
        if done < phase1_end {
            let backbone = if cfg.model.freeze_backbone {
                log("backbone frozen: only the head trains");
                model.clone().freeze_backbone()
            } else {
                model.clone()
            };
            let mut phase = self.phase(
                T::wrap(backbone, cfg.optim.label_smoothing).with_mixed(self.mixed.clone()),
                self.lr,
                done,
                phase1_end,
            );
            // With a fine-tuning phase ahead, patience counts from fine-tuning only.
            phase.patience_origin = unfreeze_at.is_none().then_some(0);
            trained = Some(phase.run(cfg, &self.device, &self.plain_device)?);
            done = self.epochs_done();
        }
        if let Some(n) = unfreeze_at
            && done >= n
            && done < end
        {
            let finetune_lr = cfg.model.finetune_lr.unwrap_or(self.lr / 10.0);
            if let Some(comm) = &self.dist {
                // Phase 2 starts from rank 0's checkpoint of epoch `done` on every rank (as a
                // resume does): no rank reads it before rank 0 has written it.
                comm.barrier()?;
            }
            log(&shared::unfreeze_line(done, finetune_lr));
            let mut phase = self.phase(
                T::wrap(model::unfrozen(cfg, model), cfg.optim.label_smoothing)
                    .with_mixed(self.mixed.clone()),
                finetune_lr,
                done,
                end,
            );
            phase.patience_origin = Some(n);
            trained = Some(phase.run(cfg, &self.device, &self.plain_device)?);
        }
        let Some(last_model) = trained else {
            return Err(HearthError::Training("no epoch was trained".into()));
        };
        if let Some(comm) = &self.dist {
            // Everyone is done with collectives before anyone hangs up.
            comm.barrier()?;
        }
        self.finish(last_model, end, log)
    }

    /// After the last phase: says why the run ended early, exports the best epoch and sums up
    /// the run (every rank's skipped files on rank 0).
    fn finish<T: Task>(
        self,
        last_model: T,
        end: usize,
        log: &mut dyn FnMut(&str),
    ) -> Result<TrainReport> {
        let cfg = self.cfg;
        let rows: EpochRows = self.table.lock().map(|t| t.clone()).unwrap_or_default();
        let epochs_run = rows.keys().copied().max().unwrap_or(0);
        if let Some(patience) = cfg.checkpoint.patience
            && epochs_run < end
        {
            // burn-train stops quietly: say why the run ended before --epochs, as the other
            // modes do.
            log(&format!(
                "early stopping after epoch {epochs_run}: no improvement of {} in {patience} epochs",
                cfg.checkpoint.monitor.column()
            ));
        }
        let best = best_epoch(&rows, cfg.checkpoint.monitor, cfg.checkpoint.min_delta).ok_or_else(
            || {
                HearthError::Training(format!(
                    "no epoch has a {} value to pick the best one by",
                    cfg.checkpoint.monitor.column()
                ))
            },
        )?;
        let exported = export::export::<T>(
            cfg,
            last_model.into_classifier(),
            best,
            &rows,
            &self.config,
            &self.classes,
            &self.loaders.full_val,
            self.rank,
            &self.plain_device,
            log,
        )?;
        let images =
            epochs_run.saturating_sub(self.resume_epoch).max(1) * self.loaders.train.set().len();
        let mut report =
            TrainReport::summarise(cfg, &rows, best, self.started, images, self.classes);
        report.per_class_auroc = exported.per_class_auroc;
        // Every rank's skipped files, on rank 0 (each rank decodes only its shard).
        report.skipped = match &self.dist {
            Some(comm) => shared::gather_lines(comm, &self.loaders.skipped())?,
            None => self.loaders.skipped(),
        };
        report.rank = self.rank;
        report.set_world(self.world, cfg.price_per_hour);
        Ok(report)
    }
}
