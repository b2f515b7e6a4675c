//! Single-process training on burn-train's Learner: `hearth train` and the library API.
//!
//! Data: an image folder (`train/` + `val/`, or one folder split by `val_fraction`), or, with no
//! folder, a generated synthetic set. Model: any [`Architecture`] or the small default ResNet,
//! optionally from torchvision weights with a new head (transfer learning, frozen backbone).
//! Burn's Learner runs the epochs with validation, metrics, TUI or plain progress, checkpoints
//! every epoch and early stopping; this module adds `metrics.csv`, restoring the best epoch's
//! weights into `model.bpk`, and the run summary.

mod data;
mod logger;
mod render;
mod step;

pub use data::{ImageBatch, LoaderAdapter};
pub use logger::{CsvMetricLogger, EpochTable, NonFinite, Report, epoch_value};
pub use render::PlainRenderer;
pub use step::SingleLabel;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use burn::module::Module;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, LearningRate, ModuleOptimizer, Optimizer, SgdConfig};
use burn::prelude::*;
use burn::store::{BurnpackStore, ModuleSnapshot};
use burn::train::checkpoint::{
    ComposedCheckpointingStrategy, KeepLastNCheckpoints, MetricCheckpointingStrategy,
};
use burn::train::metric::store::{Aggregate, Direction, Split};
use burn::train::metric::{
    AccuracyMetric, LearningRateMetric, LossMetric, Metric, TopKAccuracyMetric,
};
use burn::train::{Learner, MetricEarlyStoppingStrategy, StoppingCondition, SupervisedTraining};
use hearth_datasets::synth::{SynthConfig, generate};
use hearth_datasets::{Loader, LoaderConfig, Pipeline, train_val};
use hearth_models::{
    Architecture, BlockKind, HeadConfig, LoadOptions, ModelConfig, ResNetConfig, load_torchvision,
    save_model,
};

use crate::optim::LarsConfig;
use crate::schedule::{Decay, LrScaling, Schedule, scale_lr};
use crate::{HearthError, Result};

/// Name of the small ResNet the default run trains.
pub const DEFAULT_MODEL: &str = "resnet-mini";

/// The small ResNet of the default run: torchvision's BasicBlock ResNet, one block per stage,
/// widths 16-128 (0.7 M parameters).
pub fn mini_resnet(num_classes: usize) -> ModelConfig {
    ModelConfig::ResNet(
        ResNetConfig::new(BlockKind::Basic, [1, 1, 1, 1], num_classes)
            .with_stem_width(16)
            .with_stage_widths([16, 32, 64, 128]),
    )
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptimizerKind {
    Sgd,
    Adam,
    AdamW,
    Lars,
}

impl std::str::FromStr for OptimizerKind {
    type Err = HearthError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "sgd" => Ok(Self::Sgd),
            "adam" => Ok(Self::Adam),
            "adamw" => Ok(Self::AdamW),
            "lars" => Ok(Self::Lars),
            o => Err(HearthError::InvalidArgument(format!(
                "optimizer '{o}': expected sgd, adam, adamw or lars"
            ))),
        }
    }
}

/// Which validation metric early stopping and best-epoch selection follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Monitor {
    ValLoss,
    ValAccuracy,
}

impl std::str::FromStr for Monitor {
    type Err = HearthError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "val_loss" => Ok(Self::ValLoss),
            "val_accuracy" => Ok(Self::ValAccuracy),
            o => Err(HearthError::InvalidArgument(format!(
                "--monitor '{o}': expected val_loss or val_accuracy"
            ))),
        }
    }
}

/// Everything `hearth train` takes.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// Image folder; `None` generates the synthetic default set into the run directory.
    pub data: Option<PathBuf>,
    pub val_fraction: f64,
    /// torchvision name, or [`DEFAULT_MODEL`].
    pub model: String,
    pub weights: Option<PathBuf>,
    pub freeze_backbone: bool,
    pub epochs: usize,
    pub batch_size: usize,
    pub lr: f64,
    pub optimizer: OptimizerKind,
    pub momentum: f64,
    pub nesterov: bool,
    pub weight_decay: f64,
    pub schedule: Decay,
    pub warmup_epochs: usize,
    pub scale_lr: Option<(LrScaling, usize)>,
    pub label_smoothing: f32,
    pub monitor: Monitor,
    pub patience: Option<usize>,
    pub min_delta: f64,
    pub image_size: u32,
    pub workers: usize,
    pub seed: u64,
    pub run_dir: PathBuf,
    pub resume: bool,
    /// End the run after this epoch (checkpoint written), e.g. before a time limit; `--resume`
    /// continues it exactly.
    pub stop_after_epoch: Option<usize>,
    pub price_per_hour: Option<f64>,
}

impl TrainConfig {
    pub fn new(run_dir: PathBuf) -> Self {
        Self {
            data: None,
            val_fraction: 0.2,
            model: DEFAULT_MODEL.into(),
            weights: None,
            freeze_backbone: false,
            epochs: 12,
            batch_size: 32,
            lr: 0.05,
            optimizer: OptimizerKind::Sgd,
            momentum: 0.9,
            nesterov: false,
            weight_decay: 5e-4,
            schedule: Decay::Cosine { min_lr: 0.0 },
            warmup_epochs: 1,
            scale_lr: None,
            label_smoothing: 0.0,
            monitor: Monitor::ValAccuracy,
            patience: None,
            min_delta: 0.0,
            image_size: 32,
            workers: 2,
            seed: 0,
            run_dir,
            resume: false,
            stop_after_epoch: None,
            price_per_hour: None,
        }
    }

    fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(HearthError::InvalidArgument(m));
        if self.batch_size == 0 {
            return bad("--batch-size must be at least 1 (got 0)".into());
        }
        if self.epochs == 0 {
            return bad("--epochs must be at least 1".into());
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad(format!("--lr {} must be positive", self.lr));
        }
        if !(0.0..1.0).contains(&self.label_smoothing) {
            return bad("--label-smoothing must be in [0, 1)".into());
        }
        if self.image_size < hearth_models::MIN_INPUT_SIZE as u32 {
            return bad(format!(
                "--size {} is below the minimum of {}",
                self.image_size,
                hearth_models::MIN_INPUT_SIZE
            ));
        }
        Ok(())
    }
}

/// What a run reports at the end.
#[derive(Debug, Clone)]
pub struct TrainReport {
    pub run_dir: PathBuf,
    pub model_path: PathBuf,
    pub best_epoch: usize,
    pub best_val_accuracy: Option<f64>,
    pub best_val_loss: Option<f64>,
    pub epochs_run: usize,
    pub wall_seconds: f64,
    pub images_per_sec: f64,
    pub node_hours: f64,
    pub cost: Option<f64>,
    pub class_names: Vec<String>,
}

/// Weight decay applied as L2 on the gradient of multi-dimensional tensors only: batch-norm
/// scales and shifts and biases (1-d) are not decayed (Goyal et al. 2017's practice).
#[derive(Clone)]
struct DecayWeightsOnly<O> {
    inner: O,
    weight_decay: f64,
}

impl<O: Optimizer> Optimizer for DecayWeightsOnly<O> {
    type State<const D: usize> = O::State<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let grad = if D > 1 && self.weight_decay > 0.0 {
            grad + tensor.clone().mul_scalar(self.weight_decay)
        } else {
            grad
        };
        self.inner.step(lr, tensor, grad, state)
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        O::to_device(state, device)
    }
}

fn optimizer(cfg: &TrainConfig) -> ModuleOptimizer {
    match cfg.optimizer {
        OptimizerKind::Sgd => {
            // PyTorch semantics: no dampening.
            let momentum = (cfg.momentum > 0.0).then(|| {
                MomentumConfig::new()
                    .with_momentum(cfg.momentum)
                    .with_dampening(0.0)
                    .with_nesterov(cfg.nesterov)
            });
            ModuleOptimizer::from(DecayWeightsOnly {
                inner: SgdConfig::new().with_momentum(momentum).build(),
                weight_decay: cfg.weight_decay,
            })
        }
        OptimizerKind::Adam => ModuleOptimizer::from(DecayWeightsOnly {
            inner: AdamConfig::new().build(),
            weight_decay: cfg.weight_decay,
        }),
        OptimizerKind::AdamW => AdamWConfig::new()
            .with_weight_decay(cfg.weight_decay as f32)
            .init(),
        OptimizerKind::Lars => LarsConfig::new()
            .with_momentum(cfg.momentum)
            .with_weight_decay(cfg.weight_decay)
            .init(),
    }
}

fn prepare_run_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|source| HearthError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    let probe = dir.join(".hearth-write-test");
    std::fs::write(&probe, b"ok").map_err(|source| HearthError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    let _ = std::fs::remove_file(probe);
    Ok(())
}

fn model_config(name: &str, classes: usize) -> Result<ModelConfig> {
    if name == DEFAULT_MODEL {
        Ok(mini_resnet(classes))
    } else {
        Ok(Architecture::from_name(name)?.config(classes))
    }
}

/// Trains, validates every epoch, and exports the best epoch's weights to `run_dir/model.bpk`.
pub fn train(cfg: &TrainConfig, device: &Device, log: &mut dyn FnMut(&str)) -> Result<TrainReport> {
    cfg.validate()?;
    prepare_run_dir(&cfg.run_dir)?;
    let started = Instant::now();

    // Data.
    let data_dir = match &cfg.data {
        Some(d) => d.clone(),
        None => {
            let dir = cfg.run_dir.join("data");
            if !dir.join("val").is_dir() {
                log(&format!(
                    "generating the synthetic data set in {}",
                    dir.display()
                ));
                generate(
                    &dir,
                    &SynthConfig::new(6, 200, 40)
                        .with_seed(cfg.seed)
                        .with_val(40),
                )?;
            }
            dir
        }
    };
    let (train_set, val_set) = train_val(&data_dir, cfg.val_fraction, cfg.seed)?;
    train_set.require_classes(2)?;
    if let Some(w) = train_set.problems.summary() {
        log(&w);
    }
    let classes = train_set.classes.clone();
    log(&format!(
        "data: {} training and {} validation images, {} classes",
        train_set.len(),
        val_set.len(),
        classes.len()
    ));
    let train_loader = Loader::new(
        train_set,
        Pipeline::train(cfg.image_size),
        LoaderConfig::new(cfg.batch_size)
            .with_workers(cfg.workers)
            .with_seed(cfg.seed),
    )?;
    let val_loader = Loader::new(
        val_set,
        Pipeline::eval(cfg.image_size),
        LoaderConfig::new(cfg.batch_size)
            .with_workers(cfg.workers)
            .with_shuffle(false),
    )?;
    let steps_per_epoch = train_loader.batches_per_epoch().max(1);
    let images_per_epoch = train_loader.set().len();

    // Model, on the autodiff view of the device, from a seeded initialisation.
    let plain_device = device.clone();
    let device = &device.clone().autodiff();
    device.seed(cfg.seed);
    plain_device.seed(cfg.seed);
    let config = model_config(&cfg.model, classes.len())?;
    let mut model = config.init(device)?;
    if let Some(weights) = &cfg.weights {
        let report = load_torchvision(
            &mut model,
            weights,
            &LoadOptions {
                skip_head: true,
                ..Default::default()
            },
        )?;
        log(&format!(
            "loaded {} tensors from {}; new {}-class head",
            report.applied,
            weights.display(),
            classes.len()
        ));
        model = model.replace_head(HeadConfig::new(classes.len()), device)?;
    }
    if cfg.freeze_backbone {
        model = model.freeze_backbone();
        log("backbone frozen: only the head trains");
    }
    let trainee = SingleLabel {
        model,
        smoothing: cfg.label_smoothing,
    };

    // Learning rate.
    let lr = match cfg.scale_lr {
        Some((rule, base)) => {
            let scaled = scale_lr(cfg.lr, rule, cfg.batch_size, base)?;
            log(&format!(
                "learning rate {} scaled ({rule:?}, batch {} / base {base}) to {scaled}",
                cfg.lr, cfg.batch_size
            ));
            scaled
        }
        None => cfg.lr,
    };
    let decay = match cfg.schedule {
        Decay::Step { gamma, .. } => Decay::Step {
            step_size: (steps_per_epoch * cfg.epochs / 3).max(1),
            gamma,
        },
        d => d,
    };
    let schedule = Schedule::new(
        lr,
        cfg.warmup_epochs * steps_per_epoch,
        cfg.epochs * steps_per_epoch,
        decay,
    )?;

    // Resume: burn's checkpointer restores model, optimizer and scheduler of the last epoch;
    // the loader's data order is a function of (seed, epoch).
    let resume_epoch = if cfg.resume {
        let epoch = last_checkpoint(&cfg.run_dir)?;
        check_resume_compatible(&cfg.run_dir, &config)?;
        log(&format!("resuming after epoch {epoch}"));
        Some(epoch)
    } else {
        None
    };
    std::fs::write(cfg.run_dir.join("model_config.json"), config.to_json()).map_err(|source| {
        HearthError::Write {
            path: cfg.run_dir.join("model_config.json"),
            source,
        }
    })?;

    let table = EpochTable::default();
    if let Some(epoch) = resume_epoch {
        reload_table(&cfg.run_dir.join("metrics.csv"), &table, epoch);
    }
    let first_epoch = resume_epoch.unwrap_or(0) as u64;
    // One metric drives both the best-epoch checkpoint and early stopping.
    let (checkpointing, early_stopping) = match cfg.monitor {
        Monitor::ValLoss => monitored(&LossMetric::new(), Direction::Lowest, cfg.patience),
        Monitor::ValAccuracy => monitored(&AccuracyMetric::new(), Direction::Highest, cfg.patience),
    };
    let interrupter = burn::train::Interrupter::new();
    let non_finite = NonFinite::default();
    let csv_logger = CsvMetricLogger::new(cfg.run_dir.join("metrics.csv"), table.clone())
        .with_report(Box::new(|line: &str| eprintln!("{line}")))
        .with_nan_guard(non_finite.clone(), interrupter.clone());
    // The schedule spans all `epochs`; this launch may end earlier (`stop_after_epoch`).
    let last_epoch = cfg.stop_after_epoch.unwrap_or(cfg.epochs).min(cfg.epochs);
    let mut training = SupervisedTraining::new(
        &cfg.run_dir,
        Arc::new(LoaderAdapter::new(
            train_loader,
            device.clone(),
            first_epoch,
        )),
        Arc::new(LoaderAdapter::new(
            val_loader,
            plain_device.clone(),
            first_epoch,
        )),
    )
    .with_interrupter(interrupter)
    .with_metric_logger(csv_logger)
    .metrics((AccuracyMetric::new(), LossMetric::new()))
    .metric_train_numeric(TopKAccuracyMetric::new(5.min(classes.len())))
    .metric_valid_numeric(TopKAccuracyMetric::new(5.min(classes.len())))
    .metric_train_numeric(LearningRateMetric::new())
    .with_default_checkpointers()
    .with_checkpointing_strategy(checkpointing)
    .num_epochs(last_epoch)
    .summary();
    if let Some(strategy) = early_stopping {
        training = training.early_stopping(strategy);
    }
    if let Some(epoch) = resume_epoch {
        training = training.checkpoint(epoch);
    }
    // burn-train's TUI on a terminal; plain progress lines otherwise.
    if !std::io::IsTerminal::is_terminal(&std::io::stdout()) {
        training = training.renderer(Box::new(PlainRenderer::default()));
    }
    let learner = Learner::new(trainee, optimizer(cfg), schedule);
    let result = training.launch(learner);
    if let Some((epoch, step)) = non_finite.lock().ok().and_then(|n| *n) {
        return Err(HearthError::NanLoss { epoch, step });
    }
    if let Some(error) = result.error {
        return Err(HearthError::Training(error.to_string()));
    }

    // Restore the best epoch (Keras' restore_best_weights), not the last.
    let rows = table.lock().map(|t| t.clone()).unwrap_or_default();
    let epochs_run = rows.keys().copied().max().unwrap_or(0);
    let best = best_epoch(&rows, cfg.monitor, cfg.min_delta).unwrap_or(epochs_run);
    let mut best_model: SingleLabel = result.model;
    let best_file = cfg
        .run_dir
        .join("checkpoint")
        .join(format!("model-{best}.bpk"));
    if best_file.is_file() {
        let mut store = BurnpackStore::from_file(&best_file).auto_extension(false);
        best_model.load_from(&mut store).map_err(|e| {
            HearthError::Training(format!(
                "restoring epoch {best} from {}: {e}",
                best_file.display()
            ))
        })?;
        log(&format!(
            "restored the best epoch ({best}) from {}",
            best_file.display()
        ));
    }
    let model_path = cfg.run_dir.join("model.bpk");
    save_model(
        &best_model.model.valid(),
        &config,
        Some(&classes),
        &model_path,
    )?;
    if let Err(e) = crate::plot::plot_metrics(&rows, &cfg.run_dir.join("metrics.png")) {
        log(&format!("warning: no plot written: {e}"));
    }

    let wall = started.elapsed().as_secs_f64();
    let run_epochs = epochs_run.saturating_sub(first_epoch as usize).max(1);
    let node_hours = wall / 3600.0;
    let row = rows.get(&best);
    Ok(TrainReport {
        run_dir: cfg.run_dir.clone(),
        model_path,
        best_epoch: best,
        best_val_accuracy: row.and_then(|r| r.get("val_accuracy")).copied(),
        best_val_loss: row.and_then(|r| r.get("val_loss")).copied(),
        epochs_run,
        wall_seconds: wall,
        images_per_sec: (run_epochs * images_per_epoch) as f64 / wall.max(1e-9),
        node_hours,
        cost: cfg.price_per_hour.map(|p| p * node_hours),
        class_names: classes,
    })
}

/// Keep the last checkpoint and the best by `metric` (validation mean), and, with a patience,
/// stop after that many epochs without improvement of the same metric.
fn monitored<Me: Metric>(
    metric: &Me,
    direction: Direction,
    patience: Option<usize>,
) -> (
    ComposedCheckpointingStrategy,
    Option<MetricEarlyStoppingStrategy>,
) {
    let checkpointing = ComposedCheckpointingStrategy::builder()
        .add(KeepLastNCheckpoints::new(1))
        .add(MetricCheckpointingStrategy::new(
            metric,
            Aggregate::Mean,
            direction,
            Split::Valid,
        ))
        .build();
    let stopping = patience.map(|n_epochs| {
        MetricEarlyStoppingStrategy::new(
            metric,
            Aggregate::Mean,
            direction,
            Split::Valid,
            StoppingCondition::NoImprovementSince { n_epochs },
        )
    });
    (checkpointing, stopping)
}

/// The best epoch by the monitored metric; an improvement smaller than `min_delta` does not count.
pub fn best_epoch(
    rows: &std::collections::BTreeMap<usize, std::collections::BTreeMap<String, f64>>,
    monitor: Monitor,
    min_delta: f64,
) -> Option<usize> {
    let (key, higher) = match monitor {
        Monitor::ValLoss => ("val_loss", false),
        Monitor::ValAccuracy => ("val_accuracy", true),
    };
    let mut best: Option<(usize, f64)> = None;
    for (&epoch, row) in rows {
        let Some(&v) = row.get(key) else { continue };
        let better = match best {
            None => true,
            Some((_, b)) if higher => v > b + min_delta,
            Some((_, b)) => v < b - min_delta,
        };
        if better {
            best = Some((epoch, v));
        }
    }
    best.map(|(e, _)| e)
}

fn last_checkpoint(run_dir: &Path) -> Result<usize> {
    let dir = run_dir.join("checkpoint");
    let entries = std::fs::read_dir(&dir).map_err(|source| HearthError::Read {
        path: dir.clone(),
        source,
    })?;
    entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.strip_prefix("model-")?
                .strip_suffix(".bpk")?
                .parse::<usize>()
                .ok()
        })
        .max()
        .ok_or_else(|| HearthError::InvalidArgument(format!("no checkpoint in {}", dir.display())))
}

fn check_resume_compatible(run_dir: &Path, config: &ModelConfig) -> Result<()> {
    let path = run_dir.join("model_config.json");
    let saved = std::fs::read_to_string(&path).map_err(|source| HearthError::Read {
        path: path.clone(),
        source,
    })?;
    let saved = ModelConfig::from_json(&saved)
        .map_err(|e| HearthError::InvalidArgument(format!("{}: {e}", path.display())))?;
    if saved.to_json() != config.to_json() {
        return Err(HearthError::InvalidArgument(format!(
            "cannot resume {}: it was trained with a different model or class count \
             ({} classes there, {} now)",
            run_dir.display(),
            saved.num_classes(),
            config.num_classes()
        )));
    }
    Ok(())
}

/// Rows of an earlier `metrics.csv` up to `epoch`, so a resumed run's table is whole.
fn reload_table(csv: &Path, table: &EpochTable, epoch: usize) {
    let Ok(text) = std::fs::read_to_string(csv) else {
        return;
    };
    let mut lines = text.lines();
    let Some(header) = lines.next() else { return };
    let columns: Vec<&str> = header.split(',').collect();
    let Ok(mut t) = table.lock() else { return };
    for line in lines {
        let cells: Vec<&str> = line.split(',').collect();
        let Some(Ok(e)) = cells.first().map(|c| c.parse::<usize>()) else {
            continue;
        };
        if e > epoch {
            continue;
        }
        let row = t.entry(e).or_default();
        for (c, v) in columns.iter().zip(&cells).skip(1) {
            if let Ok(v) = v.parse::<f64>() {
                row.insert(c.to_string(), v);
            }
        }
    }
}
