//! Training: `hearth train` and the library API.
//!
//! Data: an image folder (`train/` + `val/`, or one folder split by `val_fraction`), or, with no
//! folder, a generated synthetic set. Model: any [`Architecture`](hearth_models::Architecture)
//! or the small default ResNet, optionally from torchvision weights with a new head (transfer
//! learning, frozen backbone), or a user's own Burn module ([`train_custom`]). Every mode runs
//! the one epoch loop (`epochs`) with validation, `metrics.csv`, the best-epoch rule shared by
//! checkpoints, early stopping and the export into `model.bpk`, exact resume, and the summary.
//!
//! The steps of a run, one file each (private modules, named here for the reader):
//! - `config`: [`TrainConfig`] and its checks;
//! - `distributed`: joining a job, every rank reading the same data;
//! - `sets`: the image sets and this rank's loaders;
//! - `model`: the model (seeded, optionally pretrained) and the optimizer;
//! - [`run_dir`]: the run directory, atomic writes, what `--resume` reads back;
//! - `epochs`: the one epoch loop of every mode, over a `Strategy`;
//! - `allreduce`: one process or data parallel (gradient allreduce, ZeRO, overlap);
//! - `shared` and `objective`: what those modes share below all of them (rates and phases,
//!   timeouts, the loss and metrics of single- and multi-label runs);
//! - `trainee`: what a mode trains, Hearth's classifiers or a user's own Burn module ([`Net`], [`Examples`], [`train_custom`]);
//! - `best`: which epoch is best, which checkpoints stay, when to stop early;
//! - `checkpoint`: an epoch's weights written a tensor at a time (`streamed`: one fed in
//!   pieces, a window at a time);
//! - `export`: `model.bpk`, `metrics.png`, `auroc.csv`;
//! - `pipeline`: pipeline model parallelism (`--pipeline-stages`): stages, micro-batches,
//!   per-stage checkpoints, the assembled export;
//! - `elastic`: elastic data parallelism (`--elastic`);
//! - `ps`: parameter servers (`--ps`), sync or asynchronous (DOWNPOUR, ADAG, DynSGD, EASGD).
//!
//! A new training mode is a file (or folder) here with its `Strategy` for `epochs`.

mod allreduce;
mod best;
mod builder;
mod catalog;
mod checkpoint;
mod clip;
mod config;
mod distributed;
mod elastic;
mod ema;
mod epochs;
mod exchange;
mod export;
mod faults;
mod flat;
mod gate;
mod hparams;
mod logger;
mod model;
mod net;
mod objective;
mod pipeline;
mod precision;
mod ps;
mod report;
pub mod run_dir;
mod scores;
mod sets;
mod shared;
mod step_log;
mod streamed;
mod targets;
mod trainee;
mod validate;
pub mod zero;

pub use crate::settings::{
    ADAG_SCRATCH_MOMENTUM, AugmentPreset, Balance, DEFAULT_MOMENTUM, EASGD_PEAK_ALPHA,
    ElasticOptions, FinetuneBn, Monitor, OptimizerKind, PipelineBalance, PipelineOptions,
    Precision, PsOptions, PsServers, TrainingMode,
};
pub use best::{BestRule, Patience, best_epoch};
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
pub use elastic::{mark_finished, request_leave};
pub use hparams::{Hparams, LaunchRecord, PipelineRecord, PsRecord, Recorded, ServersRecord};
pub use logger::EpochTable;
pub use model::{SeedGuard, epoch_seed, seed_lock};
pub use precision::{LossScaler, Mixed, SharedScaler};
pub use report::{EpochRows, TrainReport};
pub use targets::Targets;
pub use trainee::{Custom, ExampleError, Examples, Net};

use burn::prelude::*;

use crate::{HearthError, Result};

/// Trains, validates every epoch, and exports the best epoch's weights to `run_dir/model.bpk`.
///
/// A multi-label set (`labels` CSV) trains a sigmoid head with biases at one on binary
/// cross-entropy (per-label accuracy, AUROC); any other a softmax head on cross-entropy (with
/// top-5 accuracy above 5 classes).
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
        TrainingMode::Pipeline(_) => pipeline::train(cfg, device, log),
        TrainingMode::Elastic(opts) => elastic::train(cfg, opts, device, log),
        TrainingMode::ParameterServers(opts) => ps::train(cfg, opts, device, log),
        TrainingMode::DataParallel => {
            allreduce::train_with(cfg, &trainee::ImageRecipe, device, log)
        }
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
    refuse_image_settings(cfg, &defaults)?;
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
    let monitor = cfg.checkpoint.monitor;
    if !custom.is_multi_label() && monitor.auroc() {
        return Err(HearthError::InvalidArgument(format!(
            "checkpoint.monitor {} needs multi-label targets (Custom::multi_label)",
            monitor.column()
        )));
    }
    // The image checks, less the one answered above: an AUROC with multi-label examples
    // instead of a --labels file (the average's still needs `optim.model_ema`).
    let mut checked = cfg.clone();
    checked.checkpoint.monitor = if monitor.averaged() {
        Monitor::ValEmaLoss
    } else {
        defaults.checkpoint.monitor
    };
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

/// A custom model's run refuses the settings of Hearth's image models, by name.
fn refuse_image_settings(cfg: &TrainConfig, defaults: &TrainConfig) -> Result<()> {
    let image_only: [(&str, bool); 15] = [
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
            "data.mixup and data.cutmix (they mix image batches; mix in your Examples::batch)",
            cfg.data.mixing().on(),
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
    Ok(())
}
