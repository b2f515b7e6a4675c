//! The named choices of a run (`--optimizer`, `--monitor`, `--precision`, ...): each with the
//! name the command line and `hparams.json` spell it by ([`crate::names`]).

use burn::tensor::FloatDType;
use hearth_datasets::Augmentation;

/// How batch norm normalises in the fine-tuning phase after `--unfreeze-after`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
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
/// that default to another ([`crate::train::TrainConfig::momentum`]).
pub const DEFAULT_MOMENTUM: f64 = 0.9;

/// ADAG workers' local momentum unless set, training from scratch (no `model.weights`):
/// measured nearer sync than 0.9 ([`crate::train::TrainConfig::momentum`]).
pub const ADAG_SCRATCH_MOMENTUM: f64 = 0.5;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum OptimizerKind {
    Sgd,
    Adam,
    #[cfg_attr(feature = "clap", value(name = "adamw"))]
    AdamW,
    Lars,
}

crate::names::named_settings!(OptimizerKind { Sgd => "sgd", Adam => "adam", AdamW => "adamw", Lars => "lars" });

/// Which validation metric early stopping and best-epoch selection follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Monitor {
    #[cfg_attr(feature = "clap", value(name = "val_loss"))]
    ValLoss,
    #[cfg_attr(feature = "clap", value(name = "val_accuracy"))]
    ValAccuracy,
    /// Mean per-class AUROC (multi-label sets).
    #[cfg_attr(feature = "clap", value(name = "val_auroc"))]
    ValAuroc,
    /// The weight average's (`optim.model_ema`) validation loss: the best epoch is the
    /// average's, and `model.bpk` holds the average.
    #[cfg_attr(feature = "clap", value(name = "val_ema_loss"))]
    ValEmaLoss,
    /// The weight average's validation accuracy (as [`Monitor::ValEmaLoss`]).
    #[cfg_attr(feature = "clap", value(name = "val_ema_accuracy"))]
    ValEmaAccuracy,
    /// The weight average's mean per-class AUROC (multi-label sets).
    #[cfg_attr(feature = "clap", value(name = "val_ema_auroc"))]
    ValEmaAuroc,
}

crate::names::named_settings!(Monitor { ValLoss => "val_loss", ValAccuracy => "val_accuracy", ValAuroc => "val_auroc", ValEmaLoss => "val_ema_loss", ValEmaAccuracy => "val_ema_accuracy", ValEmaAuroc => "val_ema_auroc" });

impl Monitor {
    /// The `metrics.csv` column it reads.
    pub fn column(self) -> &'static str {
        self.name()
    }

    pub fn higher_is_better(self) -> bool {
        !matches!(self, Monitor::ValLoss | Monitor::ValEmaLoss)
    }

    /// Whether it reads the weight average's scores (`optim.model_ema`): then the average of
    /// the best epoch is what the run exports as its model.
    pub fn averaged(self) -> bool {
        matches!(
            self,
            Monitor::ValEmaLoss | Monitor::ValEmaAccuracy | Monitor::ValEmaAuroc
        )
    }

    /// Whether it reads an AUROC (multi-label sets only).
    pub fn auroc(self) -> bool {
        matches!(self, Monitor::ValAuroc | Monitor::ValEmaAuroc)
    }
}

/// Named augmentation recipes (`--augment`); the per-transform flags adjust them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
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
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
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

/// The type a training step computes in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Precision {
    /// Everything in f32.
    #[default]
    Fp32,
    /// bfloat16 compute (f32's range, 8 bits of mantissa), f32 master weights.
    Bf16,
    /// float16 compute (11 bits of mantissa, range up to 65504), f32 master weights, dynamic
    /// loss scaling.
    Fp16,
}

crate::names::named_settings!(Precision { Fp32 => "fp32", Bf16 => "bf16", Fp16 => "fp16" });

impl Precision {
    /// The float type activations take.
    pub fn dtype(self) -> FloatDType {
        match self {
            Precision::Fp32 => FloatDType::F32,
            Precision::Bf16 => FloatDType::BF16,
            Precision::Fp16 => FloatDType::F16,
        }
    }

    /// Whether the step computes below f32.
    pub fn is_low(self) -> bool {
        self != Precision::Fp32
    }

    /// The wire format gradients take by default in a distributed run of this precision:
    /// nothing is gained by sending more bits than the gradients were computed with (the
    /// reduction itself adds in f32).
    pub fn wire(self) -> burn_dist::Compression {
        match self {
            Precision::Fp32 => burn_dist::Compression::None,
            Precision::Bf16 => burn_dist::Compression::Bf16,
            Precision::Fp16 => burn_dist::Compression::Fp16,
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
