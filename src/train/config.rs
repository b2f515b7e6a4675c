//! What a training run takes: [`TrainConfig`] and its choices, checked before anything starts.

use std::path::PathBuf;

use hearth_datasets::Augmentation;
use serde::{Deserialize, Serialize};

use crate::Result;
use crate::names::by_name;
use crate::schedule::{Decay, LrScaling};
use crate::settings::{
    ADAG_SCRATCH_MOMENTUM, AugmentPreset, DEFAULT_MOMENTUM, FinetuneBn, Monitor, OptimizerKind,
    Precision, TrainingMode,
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

/// Everything a training run takes (`hearth train`'s flags, or a program's own settings), in
/// sections: where the images come from ([`DataSettings`]), the network ([`ModelSettings`]),
/// how it learns ([`OptimSettings`]), what is kept and when the run stops
/// ([`CheckpointSettings`]), how steps compute ([`ComputeSettings`]), how ranks exchange
/// gradients ([`ExchangeSettings`]), and the training mode with its own options
/// ([`TrainingMode`]). Start from [`TrainConfig::new`] (every default) and set what differs;
/// [`TrainConfig::validate`] (which `train` calls first) refuses a combination that cannot run,
/// naming the setting.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// Where the run writes (metrics, checkpoints, `model.bpk`, `hparams.json`).
    pub run_dir: PathBuf,
    pub epochs: usize,
    /// The global batch: images per optimizer step over all ranks together.
    pub batch_size: usize,
    pub seed: u64,
    /// The machine's price, for the summary's cost line.
    pub price_per_hour: Option<f64>,
    pub data: DataSettings,
    pub model: ModelSettings,
    pub optim: OptimSettings,
    pub checkpoint: CheckpointSettings,
    pub compute: ComputeSettings,
    pub exchange: ExchangeSettings,
    /// Distributed runs: this process's place in the job (from `hearth launch`, torchrun, Slurm
    /// or mpirun variables). `batch_size` stays the global batch, split over the ranks.
    pub dist: Option<burn_dist::rendezvous::RankInfo>,
    /// How the processes share the training, with the chosen mode's own options: data
    /// parallel (the default; one process on one rank), elastic, parameter servers or a
    /// pipeline.
    pub mode: TrainingMode,
}

/// Where the images come from and how they are prepared.
///
/// Each section reads and writes itself in `hparams.json` (serde, under the file's names);
/// what does not change the training (threads, the run's own bookkeeping) is not recorded.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DataSettings {
    /// Image folder; `None` generates the synthetic default set into the run directory.
    #[serde(rename = "data", with = "path_text")]
    pub folder: Option<PathBuf>,
    /// Multi-label CSV (`path,label1|label2`), paths relative to `folder` (default: the CSV's
    /// folder). Trains with one sigmoid per class and binary cross-entropy.
    #[serde(with = "path_text")]
    pub labels: Option<PathBuf>,
    /// Share held out for validation when the folder has no `val/`.
    pub val_fraction: f64,
    /// Input side in pixels.
    pub image_size: u32,
    /// Training augmentation (validation is always resize + center crop).
    #[serde(with = "AugmentationDef")]
    pub augmentation: Augmentation,
    /// Threads that decode images.
    #[serde(skip)]
    pub workers: usize,
    /// Mixup's Beta(alpha, alpha) on training batches (timm's `--mixup`; 0: off). Runs
    /// recorded before mixing existed had none.
    #[serde(default)]
    pub mixup: f64,
    /// CutMix's Beta(alpha, alpha) (timm's `--cutmix`; 0: off).
    #[serde(default)]
    pub cutmix: f64,
    /// Probability that a training batch is mixed (timm's `--mixup-prob`).
    #[serde(default = "one")]
    pub mixup_prob: f64,
    /// With mixup and cutmix both on, the probability of cutmix (timm's `--mixup-switch-prob`).
    #[serde(default = "half")]
    pub mixup_switch_prob: f64,
    /// Mixing stops after this epoch (timm's `--mixup-off-epoch`); 0: never.
    #[serde(default)]
    pub mixup_off_epoch: usize,
}

fn one() -> f64 {
    1.0
}

fn half() -> f64 {
    0.5
}

impl Default for DataSettings {
    fn default() -> Self {
        Self {
            folder: None,
            labels: None,
            val_fraction: 0.2,
            image_size: 32,
            augmentation: AugmentPreset::Light.augmentation(),
            workers: 2,
            mixup: 0.0,
            cutmix: 0.0,
            mixup_prob: 1.0,
            mixup_switch_prob: 0.5,
            mixup_off_epoch: 0,
        }
    }
}

impl DataSettings {
    /// Mixup and cutmix as hearth-datasets takes them.
    pub fn mixing(&self) -> hearth_datasets::Mixing {
        hearth_datasets::Mixing {
            mixup: self.mixup,
            cutmix: self.cutmix,
            prob: self.mixup_prob,
            switch_prob: self.mixup_switch_prob,
            off_epoch: self.mixup_off_epoch as u64,
        }
    }
}

/// The network: which one, the weights it starts from, and transfer learning.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelSettings {
    /// torchvision name, [`super::DEFAULT_MODEL`] or [`super::MINI_VGG`].
    #[serde(rename = "model")]
    pub name: String,
    /// torchvision weights (or an earlier run's `.bpk`) to start from; the head is replaced to
    /// fit the data's classes.
    #[serde(with = "path_text")]
    pub weights: Option<PathBuf>,
    pub freeze_backbone: bool,
    /// With `freeze_backbone`: after this many epochs, unfreeze everything and fine-tune at
    /// `finetune_lr`.
    pub unfreeze_after: Option<usize>,
    /// Learning rate of the fine-tuning phase (default: a tenth of the scaled `lr`).
    pub finetune_lr: Option<f64>,
    /// Batch norm in the fine-tuning phase: frozen statistics (default) or batch statistics.
    #[serde(with = "by_name")]
    pub finetune_bn: FinetuneBn,
}

impl Default for ModelSettings {
    fn default() -> Self {
        Self {
            name: super::catalog::DEFAULT_MODEL.into(),
            weights: None,
            freeze_backbone: false,
            unfreeze_after: None,
            finetune_lr: None,
            finetune_bn: FinetuneBn::default(),
        }
    }
}

/// How the network learns: the optimizer, its rate and schedule, the loss's smoothing and
/// gradient accumulation.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OptimSettings {
    #[serde(with = "by_name")]
    pub optimizer: OptimizerKind,
    /// Peak learning rate (after `scale_lr`), reached after `warmup_epochs`.
    pub lr: f64,
    /// SGD's and LARS's momentum; `None`: the mode's default ([`TrainConfig::momentum`]).
    pub momentum: Option<f64>,
    pub nesterov: bool,
    pub weight_decay: f64,
    pub schedule: Decay,
    pub warmup_epochs: usize,
    /// Scale `lr` by the batch ratio to the batch it was tuned for.
    #[serde(with = "scale_lr_record")]
    pub scale_lr: Option<(LrScaling, usize)>,
    /// As typed in `hparams.json` (0.1, not the f32's 0.10000000149...).
    #[serde(with = "shortest_f32")]
    pub label_smoothing: f32,
    /// Accumulate gradients over this many micro-batches per optimizer step.
    pub grad_accum: Option<usize>,
    /// Each step's gradients scaled down to at most this global L2 norm, taken over every
    /// parameter (PyTorch's `clip_grad_norm_`; across ranks and pipeline stages, after fp16's
    /// unscaling). `None`: no clipping.
    #[serde(default)]
    pub clip_grad: Option<f64>,
    /// An exponential moving average of the weights with this decay, updated after every
    /// optimizer step (timm's `--model-ema-decay`), validated every epoch and exported as
    /// `model_ema.bpk`. `None`: none kept.
    #[serde(default)]
    pub model_ema: Option<f64>,
}

impl Default for OptimSettings {
    fn default() -> Self {
        Self {
            optimizer: OptimizerKind::Sgd,
            lr: 0.05,
            momentum: None,
            nesterov: false,
            weight_decay: 5e-4,
            schedule: Decay::Cosine { min_lr: 0.0 },
            warmup_epochs: 1,
            scale_lr: None,
            label_smoothing: 0.0,
            grad_accum: None,
            clip_grad: None,
            model_ema: None,
        }
    }
}

/// What the run keeps and when it stops: resuming, replacing, the best-epoch rule and early
/// stopping.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CheckpointSettings {
    /// Continue the run in `run_dir` after its last complete epoch.
    #[serde(skip)]
    pub resume: bool,
    /// Replace the run already in `run_dir` (its metrics, checkpoints and model files); without
    /// it, a `run_dir` holding a run is an error (`resume` continues one).
    #[serde(skip)]
    pub overwrite: bool,
    /// End the run after this epoch (checkpoint written), e.g. before a time limit; `resume`
    /// continues it exactly.
    #[serde(skip)]
    pub stop_after_epoch: Option<usize>,
    /// The metric that picks the exported (best) epoch and drives early stopping.
    #[serde(with = "by_name")]
    pub monitor: Monitor,
    /// Stop after this many epochs without an improvement of `monitor` by more than `min_delta`.
    pub patience: Option<usize>,
    /// Smallest change of `monitor` that counts as an improvement, for early stopping and for
    /// picking the exported epoch alike.
    pub min_delta: f64,
    /// TensorBoard scalars of the training loss, accuracy and rate every this many optimizer
    /// steps (`events.out.tfevents.hearth.steps`), beside the per-epoch ones; `None`: per
    /// epoch only. A log: not recorded in `hparams.json`, free to change on resume.
    #[serde(skip)]
    pub log_every: Option<usize>,
}

impl Default for CheckpointSettings {
    fn default() -> Self {
        Self {
            resume: false,
            overwrite: false,
            stop_after_epoch: None,
            monitor: Monitor::ValAccuracy,
            patience: None,
            min_delta: 0.0,
            log_every: None,
        }
    }
}

/// How steps compute: the number type and activation recomputation.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ComputeSettings {
    /// The type steps compute in: f32, or bf16/f16 with f32 master weights (mixed precision,
    /// see [`Precision`]), in every mode. A custom module trains in it when its
    /// [`super::Net::MIXED_PRECISION`] says it computes in it; wgpu devices refuse bf16.
    #[serde(with = "by_name")]
    pub precision: Precision,
    /// Activation recomputation (`--recompute`), every mode of Hearth's image models: the
    /// forward keeps only each unit's input (pipelines: each stage's), and the backward runs
    /// each unit's forward again with its graph. Less memory, one more forward per step.
    pub recompute: bool,
}

/// How ranks exchange gradients (distributed runs).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExchangeSettings {
    /// Gradient fusion bucket size in bytes (the same arithmetic at any size: not recorded);
    /// `None`: the default ([`ExchangeSettings::bucket_size`]), and set only where a run
    /// exchanges gradients by allreduce (refused by name elsewhere).
    #[serde(skip)]
    pub bucket_bytes: Option<usize>,
    /// Wire format of gradient averaging; parameters always travel exact.
    #[serde(with = "by_name")]
    pub compression: burn_dist::Compression,
    /// Data parallel's sharded optimizer (ZeRO): 0 off, 1 the optimizer state sharded over the
    /// ranks, 2 the gradients too (see `train::zero`).
    pub zero: u8,
    /// `--overlap`: data parallel's (and elastic's) gradient exchange overlapped with the
    /// backward pass (the model runs unit by unit and each unit's gradients are reduced,
    /// bucket by bucket, while the units before it run). The same arithmetic as without it
    /// (the buckets are cut in another order), so not a hyperparameter: a resumed run may turn
    /// it on or off.
    #[serde(skip)]
    pub overlap: bool,
}

impl Default for ExchangeSettings {
    fn default() -> Self {
        Self {
            bucket_bytes: None,
            compression: burn_dist::Compression::None,
            zero: 0,
            overlap: false,
        }
    }
}

/// ZeRO stage 3's default bucket size, 1 MiB ([`ExchangeSettings::bucket_size`]).
pub const STAGE_3_BUCKET_BYTES: usize = 1024 * 1024;

impl ExchangeSettings {
    /// The buckets' size in bytes: `bucket_bytes`, else PyTorch DDP's 25 MiB
    /// ([`burn_dist::bucket::DEFAULT_BUCKET_BYTES`]), and for ZeRO stage 3 1 MiB
    /// (`STAGE_3_BUCKET_BYTES`): its buckets are also what a step gathers and holds at a time,
    /// and with 25 MiB ones a step held up to 141% of 1/N of the parameters, gradients and
    /// state (ResNet-50 at 4 ranks; VGG-16 112%), where 1 MiB ones keep it within 10% and
    /// cost ResNet-50's and VGG-16's steps little, with `--overlap` even between hosts
    /// (docs/benchmarks/memory.md).
    pub fn bucket_size(&self) -> usize {
        match (self.bucket_bytes, self.zero) {
            (Some(bytes), _) => bytes,
            (None, 3) => STAGE_3_BUCKET_BYTES,
            (None, _) => burn_dist::bucket::DEFAULT_BUCKET_BYTES,
        }
    }
}

/// serde's view of [`hearth_datasets::Augmentation`] (a crate without serde).
#[derive(Serialize, Deserialize)]
#[serde(remote = "hearth_datasets::Augmentation")]
struct AugmentationDef {
    crop_scale: Option<(f64, f64)>,
    flip: bool,
    rotate: f64,
    shear: f64,
    color_jitter: f64,
    /// Runs recorded before random erasing existed had none.
    #[serde(default)]
    random_erasing: f64,
    /// As its spelling (`rand-m9-n2`, `trivialaugment`); runs recorded before it had none.
    #[serde(default, with = "policy_text")]
    auto_augment: Option<hearth_datasets::AutoAugment>,
}

/// An optional augmentation policy as the text `--auto-augment` reads.
mod policy_text {
    use hearth_datasets::AutoAugment;
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub(super) fn serialize<S: Serializer>(
        p: &Option<AutoAugment>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        match p {
            Some(p) => s.serialize_some(&p.to_string()),
            None => s.serialize_none(),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<AutoAugment>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|p| p.parse().map_err(D::Error::custom))
            .transpose()
    }
}

/// An optional path as text (lossy where it is not UTF-8, as it is shown).
mod path_text {
    use std::path::PathBuf;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(p: &Option<PathBuf>, s: S) -> Result<S::Ok, S::Error> {
        match p {
            Some(p) => s.serialize_some(&p.display().to_string()),
            None => s.serialize_none(),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<PathBuf>, D::Error> {
        Option::<String>::deserialize(d).map(|p| p.map(PathBuf::from))
    }
}

/// An f32 written as the shortest decimal that reads back to it.
mod shortest_f32 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(v: &f32, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(v.to_string().parse().unwrap_or(f64::from(*v)))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f32, D::Error> {
        f64::deserialize(d).map(|v| v as f32)
    }
}

/// `scale_lr` as the file writes it: `{"rule": .., "base_batch": ..}` or `null`.
mod scale_lr_record {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use crate::names::by_name;
    use crate::schedule::LrScaling;

    #[derive(Serialize, Deserialize)]
    struct ScaleLr {
        #[serde(with = "by_name")]
        rule: LrScaling,
        base_batch: usize,
    }

    pub(super) fn serialize<S: Serializer>(
        v: &Option<(LrScaling, usize)>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        v.as_ref()
            .map(|&(rule, base_batch)| ScaleLr { rule, base_batch })
            .serialize(s)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<(LrScaling, usize)>, D::Error> {
        Option::<ScaleLr>::deserialize(d).map(|v| v.map(|r| (r.rule, r.base_batch)))
    }
}

impl TrainConfig {
    pub fn new(run_dir: PathBuf) -> Self {
        Self {
            run_dir,
            epochs: 12,
            batch_size: 32,
            seed: 0,
            price_per_hour: None,
            data: DataSettings::default(),
            model: ModelSettings::default(),
            optim: OptimSettings::default(),
            checkpoint: CheckpointSettings::default(),
            compute: ComputeSettings::default(),
            exchange: ExchangeSettings::default(),
            dist: None,
            mode: TrainingMode::DataParallel,
        }
    }

    /// Optimizer steps per epoch for `batches` loader batches: with gradient accumulation K the
    /// optimizer (and so burn-train's scheduler) steps on every K-th batch and on the last one.
    pub fn optimizer_steps(&self, batches: usize) -> usize {
        batches
            .div_ceil(self.optim.grad_accum.unwrap_or(1).max(1))
            .max(1)
    }

    /// SGD's and LARS's momentum for this run: `momentum` where set, else [`DEFAULT_MOMENTUM`],
    /// except where workers of parameter servers add up each other's local steps. Each
    /// worker's momentum there compounds the sum of several workers' stale changes: DOWNPOUR
    /// with 0.9 fell to chance level with the other flags at their defaults, so `downpour` and
    /// `dynsgd` take none. ADAG, which divides each change by the window, takes
    /// [`ADAG_SCRATCH_MOMENTUM`] when training from scratch (2.8 points under sync over 9 seeds
    /// with 0.9, 1.4 with 0.5) and 0.9 from `model.weights` (seed 000's fine-tuning recipe, at
    /// a tenth of the rate after the switch, reached 94.4% with 0.9 and 86.9% with 0.5); both
    /// measured in docs/benchmarks/parameter-servers.md (issue 55).
    pub fn momentum(&self) -> f64 {
        use burn_dist::ps::Mode;
        self.optim.momentum.unwrap_or_else(|| match self.mode.ps() {
            Some(p) if matches!(p.mode, Mode::Downpour | Mode::DynSgd) => 0.0,
            Some(p) if p.mode == Mode::Adag && self.model.weights.is_none() => {
                ADAG_SCRATCH_MOMENTUM
            }
            _ => DEFAULT_MOMENTUM,
        })
    }

    /// `lr` after the large-batch scaling `scale_lr` asks for (said in `log` when it applies).
    pub fn scaled_lr(&self, log: &mut dyn FnMut(&str)) -> Result<f64> {
        let Some((rule, base)) = self.optim.scale_lr else {
            return Ok(self.optim.lr);
        };
        let scaled = crate::schedule::scale_lr(self.optim.lr, rule, self.batch_size, base)?;
        log(&format!(
            "learning rate {} scaled ({rule:?}, batch {} / base {base}) to {scaled}",
            self.optim.lr, self.batch_size
        ));
        Ok(scaled)
    }

    /// The learning-rate schedule from `lr` over the whole run, in optimizer steps for
    /// `batches` loader batches per epoch (a step decay steps at each third of the run).
    pub fn lr_schedule(&self, lr: f64, batches: usize) -> Result<crate::schedule::Schedule> {
        use crate::schedule::Decay;
        let steps = self.optimizer_steps(batches);
        let decay = match self.optim.schedule {
            Decay::Step { gamma, .. } => Decay::Step {
                step_size: (steps * self.epochs / 3).max(1),
                gamma,
            },
            d => d,
        };
        crate::schedule::Schedule::new(
            lr,
            self.optim.warmup_epochs * steps,
            self.epochs * steps,
            decay,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ZeRO stage 3 defaults to 1 MiB buckets, every other exchange to PyTorch DDP's 25 MiB,
    /// and `--bucket-mb` wins over both.
    #[test]
    fn stage_3_defaults_to_1_mib_buckets_the_others_to_25_and_a_set_size_wins() {
        let mut x = ExchangeSettings::default();
        assert_eq!(x.bucket_size(), 25 * 1024 * 1024);
        for (zero, want) in [(1, 25 << 20), (2, 25 << 20), (3, 1 << 20)] {
            x.zero = zero;
            assert_eq!(x.bucket_size(), want, "stage {zero}");
        }
        x.bucket_bytes = Some(4096);
        assert_eq!(x.bucket_size(), 4096);
    }
}
