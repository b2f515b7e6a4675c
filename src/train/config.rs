//! What a training run takes: [`TrainConfig`] and its choices, checked before anything starts.

use std::path::PathBuf;

use hearth_datasets::Augmentation;

use crate::Result;
use crate::schedule::{Decay, LrScaling};
use crate::settings::{
    AugmentPreset, DEFAULT_MOMENTUM, FinetuneBn, Monitor, OptimizerKind, Precision, TrainingMode,
};

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

/// Everything `hearth train` takes.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// Image folder; `None` generates the synthetic default set into the run directory.
    pub data: Option<PathBuf>,
    /// Multi-label CSV (`path,label1|label2`), paths relative to `data` (default: the CSV's
    /// folder). Trains with one sigmoid per class and binary cross-entropy.
    pub labels: Option<PathBuf>,
    pub val_fraction: f64,
    /// torchvision name, [`super::DEFAULT_MODEL`] or [`super::MINI_VGG`].
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
    /// see [`Precision`]), in every mode. A custom module trains in it when its
    /// [`super::Net::MIXED_PRECISION`] says it computes in it; wgpu devices refuse bf16.
    pub precision: Precision,
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
    /// How the processes share the training, with the chosen mode's own options: data
    /// parallel (the default; one process on one rank), elastic, parameter servers or a
    /// pipeline.
    pub mode: TrainingMode,
}

impl TrainConfig {
    pub fn new(run_dir: PathBuf) -> Self {
        Self {
            data: None,
            labels: None,
            val_fraction: 0.2,
            model: super::catalog::DEFAULT_MODEL.into(),
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
            precision: Precision::Fp32,
            zero: 0,
            recompute: false,
            overlap: false,
            mode: TrainingMode::DataParallel,
        }
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
        self.momentum.unwrap_or_else(|| match self.mode.ps() {
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
