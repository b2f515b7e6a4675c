//! What a training run takes: [`TrainConfig`] and its choices, checked before anything starts.

use std::path::PathBuf;

use hearth_datasets::Augmentation;

use crate::schedule::{Decay, LrScaling};
use crate::{HearthError, Result};

/// Name of the small ResNet the default run trains.
pub const DEFAULT_MODEL: &str = "resnet-mini";

/// A small VGG with batch norm and dropout (tests and quick runs of the VGG recipe).
pub const MINI_VGG: &str = "vgg-mini";

/// [`MINI_VGG`] without batch norm or dropout: a model whose training is a pure function of
/// the batches (exact equivalence tests of distributed modes).
pub const MINI_VGG_PLAIN: &str = "vgg-mini-plain";

/// Settings `--resume` may change: the run's length (extending a finished run) and early
/// stopping. Everything else `hparams.json` records must be what the run was started with.
/// `zero`: the stage may change (the state file is the same); switching sharding on or off is
/// refused on resume by its own check (`zero::check_resume`).
/// `recompute`: the same training (bar dropout's draws), with less memory held.
pub const MAY_CHANGE_ON_RESUME: [&str; 6] = [
    "epochs",
    "patience",
    "min_delta",
    "zero",
    "recompute",
    "launch",
];

/// A small DenseNet (growth 8, two layers per block, 16 stem channels): DenseNet-121's
/// architecture at test size (the multi-label recipe of seed 001 on a small machine).
pub const MINI_DENSENET: &str = "densenet-mini";

/// How batch norm normalises in the fine-tuning phase after `--unfreeze-after`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum FinetuneBn {
    /// By the running statistics the frozen phase used (the pretrained ones), which stay as
    /// they are, while the scales and shifts train: Keras's advice for fine-tuning, and what
    /// small per-rank or per-worker batches need (statistics of a few images swing too far).
    #[default]
    Frozen,
    /// By each training batch's statistics, updating the running ones (PyTorch's `train()`).
    Batch,
}

crate::names::named_settings!(FinetuneBn { Frozen => "frozen", Batch => "batch" });

/// SGD's and LARS's momentum unless set (`--momentum`), except in the parameter-server modes
/// that default to none ([`TrainConfig::momentum`]).
pub const DEFAULT_MOMENTUM: f64 = 0.9;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum OptimizerKind {
    Sgd,
    Adam,
    #[cfg_attr(feature = "cli", value(name = "adamw"))]
    AdamW,
    Lars,
}

crate::names::named_settings!(OptimizerKind { Sgd => "sgd", Adam => "adam", AdamW => "adamw", Lars => "lars" });

/// Which validation metric early stopping and best-epoch selection follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum Monitor {
    #[cfg_attr(feature = "cli", value(name = "val_loss"))]
    ValLoss,
    #[cfg_attr(feature = "cli", value(name = "val_accuracy"))]
    ValAccuracy,
    /// Mean per-class AUROC (multi-label sets).
    #[cfg_attr(feature = "cli", value(name = "val_auroc"))]
    ValAuroc,
}

crate::names::named_settings!(Monitor { ValLoss => "val_loss", ValAccuracy => "val_accuracy", ValAuroc => "val_auroc" });

impl Monitor {
    /// The `metrics.csv` column it reads.
    pub fn column(self) -> &'static str {
        self.name()
    }

    pub fn higher_is_better(self) -> bool {
        !matches!(self, Monitor::ValLoss)
    }
}

/// Named augmentation recipes (`--augment`); the per-transform flags adjust them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum AugmentPreset {
    /// Resize and center crop, as validation: nothing random.
    None,
    /// Random resized crop of 70-100% of the image and a horizontal flip: short fine-tuning runs
    /// and small data sets (the default).
    Light,
    /// torchvision's ImageNet recipe: random resized crop of 8-100%, horizontal flip.
    Imagenet,
}

crate::names::named_settings!(AugmentPreset { None => "none", Light => "light", Imagenet => "imagenet" });

impl AugmentPreset {
    pub fn augmentation(self) -> Augmentation {
        match self {
            AugmentPreset::None => Augmentation::none(),
            AugmentPreset::Light => Augmentation::light(),
            AugmentPreset::Imagenet => Augmentation::imagenet(),
        }
    }
}

/// How `--pipeline-stages` splits the model's units when no `--pipeline-split` is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum PipelineBalance {
    /// Equal learnable-parameter counts (weights, gradients and optimizer state per rank).
    #[default]
    Params,
    /// Equal training time per stage: every unit's forward and backward timed on its rank over
    /// a few warm-up passes of the first batch, before training (the split is recorded in the
    /// run directory, so a resumed run keeps it).
    Time,
    /// Equal memory per stage: parameter state (weights, gradients, their accumulation,
    /// optimizer state) plus the activations each stage holds at once under the schedule,
    /// measured per unit like `time` as host-heap growth (CPU devices; on a GPU the
    /// activations live in device memory, which this does not see, so the split weighs the
    /// parameter state only).
    Memory,
}

crate::names::named_settings!(PipelineBalance { Params => "params", Time => "time", Memory => "memory" });

/// Pipeline model parallelism (`--pipeline-stages`): the model's units split into `stages`
/// consecutive stages, one per rank of each pipeline; `world / stages` pipelines train data
/// parallel (2D).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelineOptions {
    pub stages: usize,
    /// Micro-batches per step (each replica's batch is cut into this many).
    pub micro_batches: usize,
    pub schedule: burn_dist::pipeline::Schedule,
    /// Explicit unit ranges, one per stage (`--pipeline-split 0:2,2:5`).
    pub split: Option<Vec<std::ops::Range<usize>>>,
    pub balance: PipelineBalance,
}

impl PipelineOptions {
    /// `0:2,2:5` as ranges; each `a:b` with a < b, each starting where the previous ended, the
    /// first at 0.
    pub fn parse_split(text: &str) -> Result<Vec<std::ops::Range<usize>>> {
        let bad = |m: String| HearthError::InvalidArgument(format!("--pipeline-split {text}: {m}"));
        let mut out: Vec<std::ops::Range<usize>> = Vec::new();
        for part in text.split(',').map(str::trim) {
            let (a, b) = part
                .split_once(':')
                .ok_or_else(|| bad(format!("'{part}' is not START:END")))?;
            let parse = |v: &str| {
                v.trim()
                    .parse::<usize>()
                    .map_err(|_| bad(format!("'{v}' is not a unit index")))
            };
            let (a, b) = (parse(a)?, parse(b)?);
            if a >= b {
                return Err(bad(format!("{a}:{b} is empty")));
            }
            let expected = out.last().map_or(0, |r| r.end);
            if a != expected {
                return Err(bad(format!(
                    "{a}:{b} must start at unit {expected}, where the previous stage ends"
                )));
            }
            out.push(a..b);
        }
        Ok(out)
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
    /// torchvision name, [`DEFAULT_MODEL`] or [`MINI_VGG`].
    pub model: String,
    pub weights: Option<PathBuf>,
    pub freeze_backbone: bool,
    /// With `freeze_backbone`: after this many epochs, unfreeze everything and fine-tune at
    /// `finetune_lr`.
    pub unfreeze_after: Option<usize>,
    /// Learning rate of the fine-tuning phase (default: a tenth of the scaled `lr`).
    pub finetune_lr: Option<f64>,
    /// Batch norm in the fine-tuning phase: frozen statistics (default) or batch statistics.
    pub finetune_bn: FinetuneBn,
    pub epochs: usize,
    pub batch_size: usize,
    pub lr: f64,
    pub optimizer: OptimizerKind,
    /// SGD's and LARS's momentum; `None`: the mode's default ([`TrainConfig::momentum`]).
    pub momentum: Option<f64>,
    pub nesterov: bool,
    pub weight_decay: f64,
    pub schedule: Decay,
    pub warmup_epochs: usize,
    pub scale_lr: Option<(LrScaling, usize)>,
    pub label_smoothing: f32,
    pub monitor: Monitor,
    /// Stop after this many epochs without an improvement of `monitor` by more than `min_delta`.
    pub patience: Option<usize>,
    /// Smallest change of `monitor` that counts as an improvement, for early stopping and for
    /// picking the exported epoch alike.
    pub min_delta: f64,
    pub image_size: u32,
    /// Training augmentation (validation is always resize + center crop).
    pub augmentation: Augmentation,
    pub workers: usize,
    pub seed: u64,
    pub run_dir: PathBuf,
    pub resume: bool,
    /// Replace the run already in `run_dir` (its metrics, checkpoints and model files); without
    /// it, a `run_dir` holding a run is an error (`--resume` continues one).
    pub overwrite: bool,
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
    /// The type steps compute in: f32, or bf16/f16 with f32 master weights (mixed precision,
    /// see [`super::Precision`]), in every mode. A custom module trains in it when its
    /// [`super::Net::MIXED_PRECISION`] says it computes in it; wgpu devices refuse bf16.
    pub precision: super::Precision,
    /// Data parallel's sharded optimizer (ZeRO): 0 off, 1 the optimizer state sharded over the
    /// ranks, 2 the gradients too (see `train::zero`).
    pub zero: u8,
    /// Activation recomputation (`--recompute`), every mode of Hearth's image models: the
    /// forward keeps only each unit's input (pipelines: each stage's), and the backward runs
    /// each unit's forward again with its graph. Less memory, one more forward per step.
    pub recompute: bool,
    /// `--overlap`: data parallel's (and elastic's) gradient exchange overlapped with the
    /// backward pass (the model runs unit by unit and each unit's gradients are reduced,
    /// bucket by bucket, while the units before it run). The same arithmetic as without it
    /// (the buckets are cut in another order), so not a hyperparameter: a resumed run may turn
    /// it on or off.
    pub overlap: bool,
    /// Pipeline model parallelism instead of pure data parallelism.
    pub pipeline: Option<PipelineOptions>,
    /// Elastic data parallelism: workers join and leave, the global batch stays fixed.
    pub elastic: Option<super::ElasticOptions>,
    /// Parameter servers (`--ps`): its own loop over burn-dist's `ps`.
    pub ps: Option<super::PsOptions>,
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
            finetune_bn: FinetuneBn::default(),
            epochs: 12,
            batch_size: 32,
            lr: 0.05,
            optimizer: OptimizerKind::Sgd,
            momentum: None,
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
            augmentation: AugmentPreset::Light.augmentation(),
            workers: 2,
            seed: 0,
            run_dir,
            resume: false,
            stop_after_epoch: None,
            overwrite: false,
            price_per_hour: None,
            grad_accum: None,
            dist: None,
            bucket_bytes: burn_dist::bucket::DEFAULT_BUCKET_BYTES,
            compression: burn_dist::Compression::None,
            precision: super::Precision::Fp32,
            zero: 0,
            recompute: false,
            overlap: false,
            pipeline: None,
            elastic: None,
            ps: None,
        }
    }

    /// Checks the settings, alone and together: every combination a mode cannot run is an
    /// error naming the flag (and why), before anything is read or launched.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(HearthError::InvalidArgument(m));
        // An unknown --model is said before any data is read or generated.
        super::model::model_config(&self.model, 2)?;
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
        if self.label_smoothing > 0.0 && self.labels.is_some() {
            return bad(
                "--label-smoothing smooths single-label cross-entropy; a multi-label run \
                 (--labels) trains one sigmoid per class with binary cross-entropy"
                    .into(),
            );
        }
        if !(self.min_delta.is_finite() && self.min_delta >= 0.0) {
            return bad(format!("--min-delta {} must be 0 or more", self.min_delta));
        }
        if self.patience == Some(0) {
            return bad("--patience must be at least 1".into());
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
        if self.finetune_bn != FinetuneBn::default()
            && (self.unfreeze_after.is_none() || !self.freeze_backbone)
        {
            return bad(
                "--finetune-bn applies to the fine-tuning phase: it needs --freeze-backbone \
                 --unfreeze-after N"
                    .into(),
            );
        }
        if let Some(lr) = self.finetune_lr
            && !(lr.is_finite() && lr > 0.0)
        {
            return bad(format!("--finetune-lr {lr} must be positive"));
        }
        if self.monitor == Monitor::ValAuroc && self.labels.is_none() {
            return bad(
                "--monitor val_auroc needs a multi-label data set (--labels FILE.csv)".into(),
            );
        }
        if self.bucket_bytes == 0 {
            return bad("--bucket-mb must be positive".into());
        }
        self.validate_optimizer()?;
        if self.grad_accum == Some(0) {
            return bad("--grad-accum must be at least 1".into());
        }
        if let Some(d) = &self.dist
            && self.elastic.is_none()
            && self.ps.is_none()
        {
            // The global batch is split over the data-parallel replicas: every rank, or every
            // pipeline (a pipeline's stages share their replica's batch).
            let (parts, what) = match &self.pipeline {
                Some(p) => ((d.world / p.stages.max(1)).max(1), "pipelines"),
                None => (d.world, "ranks"),
            };
            if !self.batch_size.is_multiple_of(parts) {
                return bad(format!(
                    "--batch-size {} (the global batch) must divide evenly over {parts} {what}",
                    self.batch_size
                ));
            }
        }
        if self.image_size < hearth_models::MIN_INPUT_SIZE as u32 {
            return bad(format!(
                "--size {} is below the minimum of {}",
                self.image_size,
                hearth_models::MIN_INPUT_SIZE
            ));
        }
        self.augmentation.pipeline(self.image_size)?;
        if let Some(p) = &self.pipeline {
            if p.stages == 0 || p.micro_batches == 0 {
                return bad("--pipeline-stages and --micro-batches must be at least 1".into());
            }
            if let Some(split) = &p.split
                && split.len() != p.stages
            {
                return bad(format!(
                    "--pipeline-split gives {} stages, --pipeline-stages {}",
                    split.len(),
                    p.stages
                ));
            }
            // The split must cover the model's units exactly (known from its name alone).
            if let Some(end) = p.split.as_ref().and_then(|s| s.last()).map(|r| r.end) {
                let units = super::model::model_config(&self.model, 2)?.units();
                if end != units {
                    return bad(format!(
                        "--pipeline-split ends at unit {end}, but --model {} has {units} units \
                         (0..{units}; `hearth units --model {}` lists them)",
                        self.model, self.model
                    ));
                }
            }
            // Without a meaning here: a pipeline's micro-batches are its accumulation.
            if self.grad_accum.is_some() {
                return bad(
                    "--grad-accum does not apply to --pipeline-stages: a pipeline step \
                            already sums the gradients of --micro-batches micro-batches; raise \
                            --micro-batches (and --batch-size) instead"
                        .into(),
                );
            }
        }
        if let Some(e) = &self.elastic {
            if e.min_workers == 0 || e.min_workers > e.max_workers {
                return bad(format!(
                    "--min-workers {} and --max-workers {} need 1 <= min <= max",
                    e.min_workers, e.max_workers
                ));
            }
            if self.batch_size < e.max_workers {
                return bad(format!(
                    "--batch-size {} (the global batch) must give each of --max-workers {} a sample",
                    self.batch_size, e.max_workers
                ));
            }
            if self.pipeline.is_some() {
                return bad(
                    "--pipeline-stages does not work with --elastic: a pipeline's stages are \
                     fixed ranks, and elastic membership changes them"
                        .into(),
                );
            }
        }
        if let Some(p) = &self.ps {
            self.validate_ps(p)?;
        }
        self.validate_zero()?;
        self.validate_overlap()?;
        self.validate_exchange()
    }

    /// The optimizer's settings: momentum and Nesterov only where the optimizer has them.
    fn validate_optimizer(&self) -> Result<()> {
        let bad = |m: String| Err(HearthError::InvalidArgument(m));
        let name = match self.optimizer {
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::Adam => "adam",
            OptimizerKind::AdamW => "adamw",
            OptimizerKind::Lars => "lars",
        };
        let momentum = self.momentum();
        if !(momentum.is_finite() && (0.0..1.0).contains(&momentum)) {
            return bad(format!("--momentum {momentum} must be in [0, 1)"));
        }
        let adaptive = matches!(self.optimizer, OptimizerKind::Adam | OptimizerKind::AdamW);
        // hparams.json records 0.9 for adam runs too: only another value is refused.
        if adaptive && self.momentum.is_some_and(|m| m != DEFAULT_MOMENTUM) {
            return bad(format!(
                "--momentum {momentum} applies to sgd and lars; --optimizer {name} keeps its own \
                 moment estimates (betas 0.9 and 0.999)"
            ));
        }
        if self.nesterov {
            if self.optimizer != OptimizerKind::Sgd {
                return bad(format!(
                    "--nesterov applies to --optimizer sgd; {name} has no Nesterov variant here"
                ));
            }
            if momentum == 0.0 {
                return bad(format!(
                    "--nesterov needs --momentum above 0 (0 is plain SGD{})",
                    if self.momentum.is_none() {
                        ", this mode's default"
                    } else {
                        ""
                    }
                ));
            }
        }
        Ok(())
    }

    /// `--overlap`: data parallel over two ranks or more, or elastic; what it does not work
    /// with refused by name.
    fn validate_overlap(&self) -> Result<()> {
        if !self.overlap {
            return Ok(());
        }
        let why = if self.ps.is_some() {
            Some("--ps (workers exchange values with the servers, not by allreduce)")
        } else if self.pipeline.is_some() {
            Some("--pipeline-stages (not built: a stage's replicas exchange after its step)")
        } else if self.zero > 0 {
            Some("--zero (its exchange is a reduce-scatter in buckets of its own)")
        } else if self.grad_accum.is_some_and(|k| k > 1) {
            Some("--grad-accum (a step's gradients are exchanged on its last backward only)")
        } else if self.elastic.is_none() && self.dist.as_ref().is_none_or(|d| d.world < 2) {
            Some(
                "a one-process run: it exchanges no gradients (add --nproc N, or launch it as \
                 a job)",
            )
        } else {
            None
        };
        match why {
            Some(why) => Err(HearthError::InvalidArgument(format!(
                "--overlap does not work with {why}"
            ))),
            None => Ok(()),
        }
    }

    /// `--zero`: data parallel over two ranks or more, and what is not built yet refused by
    /// name.
    fn validate_zero(&self) -> Result<()> {
        if self.zero == 0 {
            return Ok(());
        }
        let bad = |m: String| Err(HearthError::InvalidArgument(m));
        if self.zero > 2 {
            return bad(format!(
                "--zero {}: the stages are 0 (off), 1 (optimizer state sharded) and 2 (gradients \
                 too); stage 3 (parameters) is not built",
                self.zero
            ));
        }
        let mode = if self.ps.is_some() {
            Some("--ps: its servers already hold the optimizer state, sharded")
        } else if let Some(p) = &self.pipeline {
            // A stage's replicas shard its state: P stages x D replicas, D at least 2.
            let world = self.dist.as_ref().map_or(1, |d| d.world);
            (world / p.stages.max(1) < 2).then_some(
                "--pipeline-stages and one replica per stage: --zero shards a stage's state over \
                 its replicas (--nproc P x D with D of 2 or more)",
            )
        } else if self.elastic.is_some() && self.freeze_backbone && self.unfreeze_after.is_some() {
            Some(
                "--elastic and --unfreeze-after: not built yet (the fine-tuning switch would \
                 re-shard the state over the tensors it adds)",
            )
        } else {
            None
        };
        if let Some(why) = mode {
            return bad(format!("--zero does not work with {why}"));
        }
        // An elastic job's workers come and go (a joiner has no launch world at all).
        if self.elastic.is_none() && self.dist.as_ref().is_none_or(|d| d.world < 2) {
            return bad(format!(
                "--zero {} shards the optimizer over data-parallel ranks, and a one-process run \
                 has one: add --nproc N (or launch it as a job)",
                self.zero
            ));
        }
        Ok(())
    }

    /// `--compression` and `--bucket-mb` shape the gradients ranks exchange by allreduce: an
    /// error where a run exchanges none (one process, a pipeline of one replica) or exchanges
    /// them otherwise (parameter servers).
    fn validate_exchange(&self) -> Result<()> {
        let (allreduce, why) = self.allreduce_exchange();
        if allreduce {
            return Ok(());
        }
        if self.compression != burn_dist::Compression::None && self.ps.is_none() {
            return Err(HearthError::InvalidArgument(format!(
                "--compression {} does not apply: {why}",
                self.compression.name()
            )));
        }
        if self.bucket_bytes != burn_dist::bucket::DEFAULT_BUCKET_BYTES {
            return Err(HearthError::InvalidArgument(format!(
                "--bucket-mb does not apply: {why}"
            )));
        }
        Ok(())
    }

    /// Whether this run averages gradients by allreduce (so `--compression` applies), and if
    /// not, why.
    pub fn exchanges_by_allreduce(&self) -> bool {
        self.allreduce_exchange().0
    }

    fn allreduce_exchange(&self) -> (bool, &'static str) {
        let ranks = self.dist.as_ref().map_or(1, |d| d.world);
        match (&self.pipeline, &self.ps, &self.elastic) {
            (_, Some(_), _) => (
                false,
                "--ps exchanges values with the servers, not by allreduce",
            ),
            (_, _, Some(_)) => (true, ""),
            (Some(p), _, _) => (
                ranks > p.stages,
                "a pipeline of one replica has no gradients to average (add replicas: --nproc \
                 a multiple of --pipeline-stages)",
            ),
            (None, None, None) => (ranks > 1, "a one-process run exchanges no gradients"),
        }
    }

    fn validate_ps(&self, p: &super::PsOptions) -> Result<()> {
        let bad = |m: String| Err(HearthError::InvalidArgument(m));
        if p.window == Some(0) {
            return bad("--window must be at least 1".into());
        }
        // A setting the mode does not read is refused, not ignored.
        let mode = p.mode.name();
        if let Some(rho) = p.rho {
            if !(rho.is_finite() && rho > 0.0) {
                return bad(format!("--rho {rho} must be positive"));
            }
            if p.mode != burn_dist::ps::Mode::Easgd {
                return bad(format!(
                    "--rho {rho} is EASGD's elastic force; --mode {mode} does not use it (--mode \
                     easgd does)"
                ));
            }
            // α = rate · ρ above 1 moves a worker past the centre at each exchange.
            let peak = self
                .scaled_lr(&mut |_| {})?
                .max(self.finetune_lr.unwrap_or(0.0));
            if rho * peak > 1.0 {
                return bad(format!(
                    "--rho {rho} with a peak rate of {peak} makes EASGD's elastic force α = rate x \
                     rho {} (above 1 a worker overshoots the centre at each exchange); give \
                     --rho at most {} or leave it out (α = {} at the peak)",
                    rho * peak,
                    1.0 / peak,
                    super::EASGD_PEAK_ALPHA
                ));
            }
        }
        if p.mode == burn_dist::ps::Mode::Sync {
            if let Some(w) = p.window {
                return bad(format!(
                    "--window {w} sets how often an asynchronous worker exchanges; --mode sync \
                     exchanges every step"
                ));
            }
            if let Some(s) = p.staleness {
                return bad(format!(
                    "--staleness {s} bounds how far asynchronous workers run ahead; --mode sync \
                     waits for every worker at every step"
                ));
            }
        }
        if let Some(d) = &self.dist {
            let roles = super::ps::Roles::new(p.servers, d.world)?;
            if !self.batch_size.is_multiple_of(roles.workers) {
                return bad(format!(
                    "--batch-size {} (the global batch) must divide evenly over {} workers",
                    self.batch_size, roles.workers
                ));
            }
        }
        let unsupported = [
            (self.pipeline.is_some(), "--pipeline-stages"),
            (self.elastic.is_some(), "--elastic"),
        ];
        if let Some((_, what)) = unsupported.iter().find(|(on, _)| *on) {
            return bad(format!("{what} does not work with --ps yet"));
        }
        // Combinations without a meaning here, refused for good.
        if self.optimizer == OptimizerKind::Lars {
            return bad(
                "--optimizer lars does not work with --ps: a server holds slices of layers, and \
                 LARS's trust ratio needs each layer's whole norm"
                    .into(),
            );
        }
        if self.compression != burn_dist::Compression::None {
            return bad(format!(
                "--compression {} does not apply to --ps: workers and servers exchange exact \
                 f32 values (it compresses allreduce traffic)",
                self.compression.name()
            ));
        }
        Ok(())
    }

    /// Settings that run but are probably not what was meant, each a sentence.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.freeze_backbone && self.weights.is_none() {
            out.push(
                "--freeze-backbone without --weights freezes a randomly initialised backbone: \
                 only the head learns, on random features (give --weights to fine-tune a \
                 pretrained network)"
                    .into(),
            );
        }
        out
    }

    /// Optimizer steps per epoch for `batches` loader batches: with gradient accumulation K the
    /// optimizer (and so burn-train's scheduler) steps on every K-th batch and on the last one.
    pub fn optimizer_steps(&self, batches: usize) -> usize {
        batches.div_ceil(self.grad_accum.unwrap_or(1).max(1)).max(1)
    }

    /// SGD's and LARS's momentum for this run: `momentum` where set, else [`DEFAULT_MOMENTUM`],
    /// except none where workers of parameter servers add up each other's local steps
    /// (`downpour`, `dynsgd`). Each worker's momentum there compounds the sum of several
    /// workers' changes: DOWNPOUR with 0.9 fell to chance level with the other flags at their
    /// defaults (docs/benchmarks/parameter-servers.md, issue 55). ADAG keeps 0.9: 0.5 came
    /// nearer sync from scratch but cost seed 000's fine-tuning recipe 7.5 points.
    pub fn momentum(&self) -> f64 {
        use burn_dist::ps::Mode;
        self.momentum.unwrap_or_else(|| match &self.ps {
            Some(p) if matches!(p.mode, Mode::Downpour | Mode::DynSgd) => 0.0,
            _ => DEFAULT_MOMENTUM,
        })
    }

    /// `lr` after the large-batch scaling `scale_lr` asks for (said in `log` when it applies).
    pub fn scaled_lr(&self, log: &mut dyn FnMut(&str)) -> Result<f64> {
        let Some((rule, base)) = self.scale_lr else {
            return Ok(self.lr);
        };
        let scaled = crate::schedule::scale_lr(self.lr, rule, self.batch_size, base)?;
        log(&format!(
            "learning rate {} scaled ({rule:?}, batch {} / base {base}) to {scaled}",
            self.lr, self.batch_size
        ));
        Ok(scaled)
    }

    /// The learning-rate schedule from `lr` over the whole run, in optimizer steps for
    /// `batches` loader batches per epoch (a step decay steps at each third of the run).
    pub fn lr_schedule(&self, lr: f64, batches: usize) -> Result<crate::schedule::Schedule> {
        use crate::schedule::Decay;
        let steps = self.optimizer_steps(batches);
        let decay = match self.schedule {
            Decay::Step { gamma, .. } => Decay::Step {
                step_size: (steps * self.epochs / 3).max(1),
                gamma,
            },
            d => d,
        };
        crate::schedule::Schedule::new(lr, self.warmup_epochs * steps, self.epochs * steps, decay)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipeline_splits_parse_and_bad_ones_say_why() {
        assert_eq!(
            PipelineOptions::parse_split("0:2, 2:5").unwrap(),
            vec![0..2, 2..5]
        );
        for (text, why) in [
            ("1:3", "must start at unit 0"),
            ("0:2,3:5", "must start at unit 2"),
            ("0:0", "empty"),
            ("0-2", "START:END"),
            ("0:x", "not a unit index"),
        ] {
            let e = PipelineOptions::parse_split(text).unwrap_err().to_string();
            assert!(e.contains(why), "{text}: {e}");
        }
    }
}
