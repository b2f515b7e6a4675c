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
mod speed;
mod step;

pub use data::{ImageBatch, LoaderAdapter};
pub use logger::{CsvMetricLogger, EpochTable, NonFinite, Report, epoch_value};
pub use render::PlainRenderer;
pub use speed::ImagesPerSecond;
pub use step::{MultiLabel, SingleLabel, Task};

use std::collections::BTreeMap;
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
use burn::train::metric::{LearningRateMetric, Metric};
use burn::train::{Learner, MetricEarlyStoppingStrategy, StoppingCondition, SupervisedTraining};
use hearth_datasets::synth::{SynthConfig, generate};
use hearth_datasets::{ImageSet, Loader, LoaderConfig, Pipeline, train_val};
use hearth_models::{
    Architecture, BiasInit, BlockKind, HeadActivation, HeadConfig, LoadOptions, ModelConfig,
    ResNetConfig, load_torchvision, save_model,
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
    /// Mean per-class AUROC (multi-label sets).
    ValAuroc,
}

impl std::str::FromStr for Monitor {
    type Err = HearthError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "val_loss" => Ok(Self::ValLoss),
            "val_accuracy" => Ok(Self::ValAccuracy),
            "val_auroc" => Ok(Self::ValAuroc),
            o => Err(HearthError::InvalidArgument(format!(
                "--monitor '{o}': expected val_loss, val_accuracy or val_auroc"
            ))),
        }
    }
}

/// Everything `hearth train` takes.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// Image folder; `None` generates the synthetic default set into the run directory.
    pub data: Option<PathBuf>,
    /// Multi-label CSV (`path,label1|label2`), paths relative to `data` (default: the CSV's
    /// folder). Trains with one sigmoid per class and binary cross-entropy.
    pub labels: Option<PathBuf>,
    pub val_fraction: f64,
    /// torchvision name, or [`DEFAULT_MODEL`].
    pub model: String,
    pub weights: Option<PathBuf>,
    pub freeze_backbone: bool,
    /// With `freeze_backbone`: after this many epochs, unfreeze everything and fine-tune at
    /// `finetune_lr`.
    pub unfreeze_after: Option<usize>,
    /// Learning rate of the fine-tuning phase (default: a tenth of the scaled `lr`).
    pub finetune_lr: Option<f64>,
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
    /// Accumulate gradients over this many micro-batches per optimizer step.
    pub grad_accum: Option<usize>,
    /// Distributed data parallel: this process's place in the job (from `hearth launch`,
    /// torchrun, Slurm or mpirun variables). `batch_size` stays the global batch, split evenly
    /// over the ranks.
    pub dist: Option<burn_dist::rendezvous::RankInfo>,
    /// Gradient fusion bucket size in bytes (distributed runs).
    pub bucket_bytes: usize,
    /// Wire format of gradient averaging (distributed runs); parameters always travel exact.
    pub compression: burn_dist::Compression,
}

impl TrainConfig {
    pub fn new(run_dir: PathBuf) -> Self {
        Self {
            data: None,
            labels: None,
            val_fraction: 0.2,
            model: DEFAULT_MODEL.into(),
            weights: None,
            freeze_backbone: false,
            unfreeze_after: None,
            finetune_lr: None,
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
            grad_accum: None,
            dist: None,
            bucket_bytes: burn_dist::bucket::DEFAULT_BUCKET_BYTES,
            compression: burn_dist::Compression::None,
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
        if let Some(n) = self.unfreeze_after {
            if !self.freeze_backbone {
                return bad("--unfreeze-after needs --freeze-backbone".into());
            }
            if n == 0 || n >= self.epochs {
                return bad(format!(
                    "--unfreeze-after {n} must be between 1 and --epochs - 1 ({})",
                    self.epochs - 1
                ));
            }
        }
        if let Some(lr) = self.finetune_lr
            && !(lr.is_finite() && lr > 0.0)
        {
            return bad(format!("--finetune-lr {lr} must be positive"));
        }
        if self.grad_accum == Some(0) {
            return bad("--grad-accum must be at least 1".into());
        }
        if let Some(d) = &self.dist
            && self.batch_size % d.world != 0
        {
            return bad(format!(
                "--batch-size {} (the global batch) must divide evenly over {} ranks",
                self.batch_size, d.world
            ));
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
    /// Multi-label runs: mean per-class validation AUROC of the best epoch (0-100, as burn
    /// reports it).
    pub best_val_auroc: Option<f64>,
    /// Multi-label runs: each class's validation AUROC (0-1) for the exported model, as CheXNet
    /// reports it; also written to `auroc.csv`.
    pub per_class_auroc: Option<Vec<(String, f64)>>,
    /// This process's rank (0 when not distributed); only rank 0 exports and plots.
    pub rank: usize,
    pub world: usize,
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
///
/// A multi-label set (`labels` CSV) trains [`MultiLabel`] (sigmoid head with biases at one,
/// binary cross-entropy, per-class AUROC); any other trains [`SingleLabel`].
pub fn train(cfg: &TrainConfig, device: &Device, log: &mut dyn FnMut(&str)) -> Result<TrainReport> {
    cfg.validate()?;
    let started = Instant::now();
    let dist = match &cfg.dist {
        Some(info) if info.world > 1 => Some(connect(info, log)?.with_compression(cfg.compression)),
        _ => None,
    };
    let rank = dist.as_ref().map_or(0, |c| c.rank());
    let mut quiet = |_: &str| {};
    let log: &mut dyn FnMut(&str) = if rank == 0 { log } else { &mut quiet };
    // Rank 0 prepares the run directory and data; the others wait for it.
    if rank == 0 {
        prepare_run_dir(&cfg.run_dir)?;
    }
    let (train_set, val_set) = match &dist {
        Some(comm) if rank == 0 => {
            let sets = load_data(cfg, log);
            comm.barrier()?;
            sets?
        }
        Some(comm) => {
            comm.barrier()?;
            load_data(cfg, log)?
        }
        None => load_data(cfg, log)?,
    };
    let dist = dist.map(Arc::new);
    if train_set.multi_label {
        run::<MultiLabel>(cfg, device, train_set, val_set, started, dist, log)
    } else {
        if cfg.monitor == Monitor::ValAuroc {
            return Err(HearthError::InvalidArgument(
                "--monitor val_auroc needs a multi-label data set (--labels FILE.csv)".into(),
            ));
        }
        run::<SingleLabel>(cfg, device, train_set, val_set, started, dist, log)
    }
}

/// Joins the distributed job (QUIC, TLS from the job secret or CA in the environment).
fn connect(
    info: &burn_dist::rendezvous::RankInfo,
    log: &mut dyn FnMut(&str),
) -> Result<burn_dist::Communicator> {
    let membership = burn_dist::tls::Membership::from_env()?;
    if info.rank == 0 {
        log(&format!(
            "distributed: {} ranks ({}), coordinator {}",
            info.world, info.source, info.coordinator
        ));
    }
    let transport = burn_dist::rendezvous::connect(
        info,
        &membership,
        &burn_dist::rendezvous::RendezvousOptions::default(),
    )?;
    Ok(burn_dist::Communicator::new(Arc::new(transport)))
}

fn load_data(cfg: &TrainConfig, log: &mut dyn FnMut(&str)) -> Result<(ImageSet, ImageSet)> {
    let (train_set, val_set) = match (&cfg.labels, &cfg.data) {
        (Some(csv), data) => {
            ImageSet::from_csv(csv, data.as_deref())?.split(cfg.val_fraction, cfg.seed)?
        }
        (None, Some(dir)) => train_val(dir, cfg.val_fraction, cfg.seed)?,
        (None, None) => {
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
            train_val(&dir, cfg.val_fraction, cfg.seed)?
        }
    };
    train_set.require_classes(2)?;
    if let Some(w) = train_set.problems.summary() {
        log(&w);
    }
    log(&format!(
        "data: {} training and {} validation images, {} {}",
        train_set.len(),
        val_set.len(),
        train_set.classes.len(),
        if train_set.multi_label {
            "labels (multi-label)"
        } else {
            "classes"
        }
    ));
    Ok((train_set, val_set))
}

/// One Learner launch: epochs `first + 1 ..= last` of the run, starting from checkpoint
/// `first` when it is not 0.
struct Phase<'a, T: Task> {
    trainee: T,
    lr: f64,
    first: usize,
    last: usize,
    patience: Option<usize>,
    steps_per_epoch: usize,
    train_loader: &'a Loader,
    val_loader: &'a Loader,
    table: &'a EpochTable,
    dist: Option<&'a Arc<burn_dist::Communicator>>,
}

fn run_phase<T: Task>(
    cfg: &TrainConfig,
    phase: Phase<'_, T>,
    device: &Device,
    plain_device: &Device,
) -> Result<T> {
    let decay = match cfg.schedule {
        Decay::Step { gamma, .. } => Decay::Step {
            step_size: (phase.steps_per_epoch * cfg.epochs / 3).max(1),
            gamma,
        },
        d => d,
    };
    // The schedule spans the whole run; a resumed phase continues at its iteration.
    let schedule = Schedule::new(
        phase.lr,
        cfg.warmup_epochs * phase.steps_per_epoch,
        cfg.epochs * phase.steps_per_epoch,
        decay,
    )?;
    let (checkpointing, early_stopping) = T::monitored(cfg.monitor, phase.patience)?;
    let interrupter = burn::train::Interrupter::new();
    let non_finite = NonFinite::default();
    let rank = phase.dist.map_or(0, |c| c.rank());
    let mut csv_logger = CsvMetricLogger::new(cfg.run_dir.join("metrics.csv"), phase.table.clone())
        .with_nan_guard(non_finite.clone(), interrupter.clone());
    if rank == 0 {
        csv_logger = csv_logger.with_report(Box::new(|line: &str| eprintln!("{line}")));
    }
    if let Some(comm) = phase.dist {
        // Metric averaging runs on its own tag space, beside the gradient traffic.
        csv_logger =
            csv_logger.with_rank_averaging(Arc::new(comm.sibling(burn_dist::wire::Kind::Metric)));
    }
    let first_epoch = phase.first as u64;
    let mut training = SupervisedTraining::new(
        &cfg.run_dir,
        Arc::new(LoaderAdapter::new(
            phase.train_loader.clone(),
            device.clone(),
            first_epoch,
        )),
        Arc::new(LoaderAdapter::new(
            phase.val_loader.clone(),
            plain_device.clone(),
            first_epoch,
        )),
    )
    .with_interrupter(interrupter)
    .with_metric_logger(csv_logger)
    .metric_train_numeric(LearningRateMetric::new())
    .metric_train_numeric(ImagesPerSecond::new())
    .with_default_checkpointers()
    .with_checkpointing_strategy(checkpointing)
    .num_epochs(phase.last);
    training = T::register_metrics(training, phase.train_loader.set().classes.len());
    if let Some(k) = cfg.grad_accum.filter(|&k| k > 1) {
        training = training.grads_accumulation(k);
    }
    if let Some(comm) = phase.dist {
        let strategy =
            burn_dist::ddp::DdpStrategy::new(comm.clone()).with_bucket_bytes(cfg.bucket_bytes);
        training = training
            .with_training_strategy(burn::train::TrainingStrategy::Custom(Arc::new(strategy)));
    }
    if rank == 0 {
        training = training.summary();
    } else {
        // Rank 0 alone writes the run directory's logs.
        training = training.with_application_logger(None);
    }
    if let Some(strategy) = early_stopping {
        training = training.early_stopping(strategy);
    }
    if phase.first > 0 {
        training = training.checkpoint(phase.first);
    }
    // burn-train's TUI on a terminal; plain progress lines otherwise.
    if rank != 0 || !std::io::IsTerminal::is_terminal(&std::io::stdout()) {
        training = training.renderer(Box::new(if rank == 0 {
            PlainRenderer::default()
        } else {
            PlainRenderer::quiet()
        }));
    }
    let learner = Learner::new(phase.trainee, optimizer(cfg), schedule);
    let result = training.launch(learner);
    if let Some((epoch, step)) = non_finite.lock().ok().and_then(|n| *n) {
        return Err(HearthError::NanLoss { epoch, step });
    }
    if let Some(error) = result.error {
        return Err(HearthError::Training(error.to_string()));
    }
    Ok(result.model)
}

fn run<T: Task>(
    cfg: &TrainConfig,
    device: &Device,
    train_set: ImageSet,
    val_set: ImageSet,
    started: Instant,
    dist: Option<Arc<burn_dist::Communicator>>,
    log: &mut dyn FnMut(&str),
) -> Result<TrainReport> {
    let classes = train_set.classes.clone();
    let (rank, world) = dist.as_ref().map_or((0, 1), |c| (c.rank(), c.world()));
    // The global batch, split evenly; each rank streams its own shard of every epoch and
    // validates its shard of the validation set. The metrics are averaged over the ranks (the
    // logger), so all ranks see the same values and stop together.
    let train_loader = Loader::new(
        train_set,
        Pipeline::train(cfg.image_size),
        LoaderConfig::new(cfg.batch_size / world)
            .with_workers(cfg.workers)
            .with_seed(cfg.seed)
            .with_shard(rank, world),
    )?;
    let val_config = LoaderConfig::new(cfg.batch_size)
        .with_workers(cfg.workers)
        .with_shuffle(false);
    // Rank 0 reports per-class AUROC over the whole validation set.
    let full_val_loader = Loader::new(val_set, Pipeline::eval(cfg.image_size), val_config.clone())?;
    let val_loader = Loader::new(
        full_val_loader.set().clone(),
        Pipeline::eval(cfg.image_size),
        val_config.with_shard(rank, world),
    )?;
    let steps_per_epoch = train_loader.batches_per_epoch().max(1);
    let images_per_epoch = train_loader.set().len();

    // Model, on the autodiff view of the device, from a seeded initialisation.
    let plain_device = device.clone();
    let device = &device.clone().autodiff();
    let config = model_config(&cfg.model, classes.len())?;
    // Burn's backends keep one random generator per process: hold it from seeding until every
    // random parameter exists (Burn initialises parameters lazily), so concurrent trainings in
    // one process (tests, embedding programs) still start from their seed's weights.
    let rng_guard = SEED_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    device.seed(cfg.seed);
    plain_device.seed(cfg.seed);
    // CheXNet's multi-label head: one sigmoid per class, biases initialised to one.
    let head = if T::MULTI_LABEL {
        HeadConfig::new(classes.len())
            .with_activation(HeadActivation::Sigmoid)
            .with_bias(BiasInit::Constant(1.0))
    } else {
        HeadConfig::new(classes.len())
    };
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
        model = model.replace_head(head, device)?;
    } else if T::MULTI_LABEL {
        model = model.replace_head(head, device)?;
    }
    model.visit(&mut Materialize);
    drop(rng_guard);

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

    // Resume: burn's checkpointer restores model, optimizer and scheduler of the last epoch;
    // the loader's data order is a function of (seed, epoch).
    let hparams = hyperparameters(cfg);
    let resume_epoch = if cfg.resume {
        let epoch = last_checkpoint(&cfg.run_dir)?;
        check_resume_compatible(&cfg.run_dir, &config, &hparams)?;
        log(&format!("resuming after epoch {epoch}"));
        epoch
    } else {
        0
    };
    if rank == 0 {
        write_file(&cfg.run_dir.join("model_config.json"), &config.to_json())?;
        write_file(&cfg.run_dir.join("hparams.json"), &hparams_json(&hparams))?;
    }

    let table = EpochTable::default();
    if resume_epoch > 0 {
        reload_table(&cfg.run_dir.join("metrics.csv"), &table, resume_epoch);
    }
    // This launch may end before `epochs` (`stop_after_epoch`); the schedule spans them all.
    let end = cfg.stop_after_epoch.unwrap_or(cfg.epochs).min(cfg.epochs);
    if resume_epoch >= end {
        return Err(HearthError::InvalidArgument(format!(
            "{} has already finished epoch {resume_epoch} of {}; nothing left to train",
            cfg.run_dir.display(),
            cfg.epochs
        )));
    }
    let ran_to = |table: &EpochTable| {
        table
            .lock()
            .ok()
            .and_then(|t| t.keys().copied().max())
            .unwrap_or(0)
    };
    // Phase 1: the whole run, or the frozen-backbone epochs before `unfreeze_after`.
    let unfreeze_at = cfg.unfreeze_after.filter(|_| cfg.freeze_backbone);
    let phase1_end = unfreeze_at.map_or(end, |n| n.min(end));
    let mut done = resume_epoch;
    let mut trained: Option<T> = None;
    if done < phase1_end {
        let backbone = if cfg.freeze_backbone {
            log("backbone frozen: only the head trains");
            model.clone().freeze_backbone()
        } else {
            model.clone()
        };
        let phase = Phase {
            trainee: T::wrap(backbone, cfg.label_smoothing),
            lr,
            first: done,
            last: phase1_end,
            // With a fine-tuning phase ahead, patience counts from fine-tuning only.
            patience: if unfreeze_at.is_some() {
                None
            } else {
                cfg.patience
            },
            steps_per_epoch,
            train_loader: &train_loader,
            val_loader: &val_loader,
            table: &table,
            dist: dist.as_ref(),
        };
        trained = Some(run_phase(cfg, phase, device, &plain_device)?);
        done = ran_to(&table);
    }
    // Phase 2: everything trains, at the fine-tuning rate, from the last checkpoint.
    if let Some(n) = unfreeze_at
        && done >= n
        && done < end
    {
        let finetune_lr = cfg.finetune_lr.unwrap_or(lr / 10.0);
        log(&format!(
            "unfreezing the backbone after epoch {done}: fine-tuning everything at lr {finetune_lr}"
        ));
        let phase = Phase {
            trainee: T::wrap(model.unfreeze_all(), cfg.label_smoothing),
            lr: finetune_lr,
            first: done,
            last: end,
            patience: cfg.patience,
            steps_per_epoch,
            train_loader: &train_loader,
            val_loader: &val_loader,
            table: &table,
            dist: dist.as_ref(),
        };
        trained = Some(run_phase(cfg, phase, device, &plain_device)?);
    }
    let Some(last_model) = trained else {
        return Err(HearthError::Training("no epoch was trained".into()));
    };
    if let Some(comm) = &dist {
        // Everyone is done with collectives before anyone hangs up.
        comm.barrier()?;
    }

    // Restore the best epoch (Keras' restore_best_weights), not the last.
    let rows = table.lock().map(|t| t.clone()).unwrap_or_default();
    let epochs_run = rows.keys().copied().max().unwrap_or(0);
    let best = best_epoch(&rows, cfg.monitor, cfg.min_delta).unwrap_or(epochs_run);
    let mut best_model = last_model.into_classifier();
    let best_file = cfg
        .run_dir
        .join("checkpoint")
        .join(format!("model-{best}.bpk"));
    if best_file.is_file() {
        let mut trainee = T::wrap(best_model, cfg.label_smoothing);
        let mut store = BurnpackStore::from_file(&best_file).auto_extension(false);
        trainee.load_from(&mut store).map_err(|e| {
            HearthError::Training(format!(
                "restoring epoch {best} from {}: {e}",
                best_file.display()
            ))
        })?;
        best_model = trainee.into_classifier();
        log(&format!(
            "restored the best epoch ({best}) from {}",
            best_file.display()
        ));
    } else if best != epochs_run {
        log(&format!(
            "warning: the best epoch's checkpoint ({}) is gone; exporting the last epoch",
            best_file.display()
        ));
    }
    let best_model = best_model.valid();
    let model_path = cfg.run_dir.join("model.bpk");
    if rank == 0 {
        save_model(&best_model, &config, Some(&classes), &model_path)?;
        if let Err(e) = crate::plot::plot_metrics(&rows, &cfg.run_dir.join("metrics.png")) {
            log(&format!("warning: no plot written: {e}"));
        }
    }
    let per_class_auroc = if T::MULTI_LABEL && rank == 0 {
        let aucs = per_class_auroc(&best_model, &full_val_loader, &plain_device)?;
        let mut text = String::from("class,auroc\n");
        for (name, auc) in classes.iter().zip(&aucs) {
            let shown = auc.map(|a| format!("{a:.6}")).unwrap_or_default();
            text.push_str(&format!("{name},{shown}\n"));
            log(&format!(
                "  AUROC {name}: {}",
                auc.map(|a| format!("{a:.4}"))
                    .unwrap_or("undefined (one outcome only)".into())
            ));
        }
        write_file(&cfg.run_dir.join("auroc.csv"), &text)?;
        Some(
            classes
                .iter()
                .zip(aucs)
                .filter_map(|(n, a)| a.map(|a| (n.clone(), a)))
                .collect(),
        )
    } else {
        None
    };

    let wall = started.elapsed().as_secs_f64();
    let run_epochs = epochs_run.saturating_sub(resume_epoch).max(1);
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
        best_val_auroc: row.and_then(|r| r.get("val_auroc")).copied(),
        per_class_auroc,
        rank,
        world,
    })
}

/// Serialises seeding and parameter initialisation across threads (see `run`).
static SEED_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Forces Burn's lazy parameter initialisation now.
struct Materialize;

impl burn::module::ModuleVisitor for Materialize {
    fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
        let _ = param.val();
    }
}

fn write_file(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).map_err(|source| HearthError::Write {
        path: path.to_path_buf(),
        source,
    })
}

/// Each class's AUROC over the validation set (`None` where a class has one outcome only).
fn per_class_auroc(
    model: &hearth_models::Classifier,
    val: &Loader,
    device: &Device,
) -> Result<Vec<Option<f64>>> {
    let k = model.num_classes();
    let mut scores: Vec<Vec<(f64, bool)>> = vec![Vec::new(); k];
    for batch in val.epoch(0, device) {
        let batch = batch?;
        let Some(hot) = batch.multi_hot else {
            return Err(HearthError::Training(
                "AUROC needs multi-hot validation labels".into(),
            ));
        };
        let logits = model.forward(batch.images);
        let n = logits.dims()[0];
        let logits = logits
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| HearthError::Training(format!("reading outputs: {e:?}")))?;
        let hot = hot
            .into_data()
            .try_into_vec::<f32>()
            .map_err(|e| HearthError::Training(format!("reading labels: {e:?}")))?;
        for row in 0..n {
            for (c, s) in scores.iter_mut().enumerate() {
                s.push((logits[row * k + c] as f64, hot[row * k + c] > 0.5));
            }
        }
    }
    Ok(scores
        .into_iter()
        .map(|s| crate::metrics::auroc(&s))
        .collect())
}

/// The hyperparameters a resumed run must share with the original, by name.
fn hyperparameters(cfg: &TrainConfig) -> BTreeMap<&'static str, String> {
    let path = |p: &Option<PathBuf>| {
        p.as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default()
    };
    BTreeMap::from([
        ("data", path(&cfg.data)),
        ("labels", path(&cfg.labels)),
        ("val_fraction", cfg.val_fraction.to_string()),
        ("model", cfg.model.clone()),
        ("weights", path(&cfg.weights)),
        ("freeze_backbone", cfg.freeze_backbone.to_string()),
        ("unfreeze_after", format!("{:?}", cfg.unfreeze_after)),
        ("finetune_lr", format!("{:?}", cfg.finetune_lr)),
        ("epochs", cfg.epochs.to_string()),
        ("batch_size", cfg.batch_size.to_string()),
        ("lr", cfg.lr.to_string()),
        ("optimizer", format!("{:?}", cfg.optimizer)),
        ("momentum", cfg.momentum.to_string()),
        ("nesterov", cfg.nesterov.to_string()),
        ("weight_decay", cfg.weight_decay.to_string()),
        ("schedule", format!("{:?}", cfg.schedule)),
        ("warmup_epochs", cfg.warmup_epochs.to_string()),
        ("scale_lr", format!("{:?}", cfg.scale_lr)),
        ("label_smoothing", cfg.label_smoothing.to_string()),
        ("image_size", cfg.image_size.to_string()),
        ("seed", cfg.seed.to_string()),
        ("grad_accum", format!("{:?}", cfg.grad_accum)),
        ("compression", format!("{:?}", cfg.compression)),
    ])
}

fn hparams_json(h: &BTreeMap<&'static str, String>) -> String {
    serde_json::to_string_pretty(h).unwrap_or_default()
}

/// Keep the last checkpoint and the best by `metric` (validation mean), and, with a patience,
/// stop after that many epochs without improvement of the same metric.
pub(crate) fn monitored<Me: Metric>(
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
        Monitor::ValAuroc => ("val_auroc", true),
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

fn check_resume_compatible(
    run_dir: &Path,
    config: &ModelConfig,
    hparams: &BTreeMap<&'static str, String>,
) -> Result<()> {
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
    // Runs from before hparams.json existed resume on the model check alone.
    let path = run_dir.join("hparams.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(());
    };
    let saved: BTreeMap<String, String> = serde_json::from_str(&text)
        .map_err(|e| HearthError::InvalidArgument(format!("{}: {e}", path.display())))?;
    let differing: Vec<String> = hparams
        .iter()
        .filter_map(|(k, now)| {
            let then = saved.get(*k)?;
            (then != now).then(|| format!("{k}: {then} then, {now} now"))
        })
        .collect();
    if !differing.is_empty() {
        return Err(HearthError::InvalidArgument(format!(
            "cannot resume {} exactly: hyperparameters differ ({}); pass the original ones",
            run_dir.display(),
            differing.join("; ")
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
