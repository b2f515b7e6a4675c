//! The model and optimizer of a run: architecture by name, seeded initialisation (optionally
//! from torchvision weights with a new head), and the optimizer with its weight-decay rule.

use burn::module::Module;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, LearningRate, ModuleOptimizer, Optimizer, SgdConfig};
use burn::prelude::*;
use hearth_models::{
    BiasInit, Classifier, HeadActivation, HeadConfig, LoadOptions, ModelConfig, WeightsFormat,
    load_model, load_torchvision_deferred,
};

use super::TrainConfig;
use crate::optim::LarsConfig;
use crate::settings::{FinetuneBn, OptimizerKind};
use crate::{HearthError, Result};

/// Serialises seeding and parameter initialisation across threads: Burn keeps one random
/// generator per process and initialises parameters lazily.
static SEED_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Forces Burn's lazy parameter initialisation now.
struct Materialize;

impl burn::module::ModuleVisitor for Materialize {
    fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
        let _ = param.val();
    }
}

/// The run's model on `device` (the autodiff device), from `cfg.seed`: a fresh initialisation,
/// or torchvision weights with a new head. Multi-label runs get CheXNet's head (one sigmoid per
/// class, biases at one).
pub fn init_model(
    cfg: &TrainConfig,
    config: &ModelConfig,
    classes: usize,
    multi_label: bool,
    device: &Device,
    log: &mut dyn FnMut(&str),
) -> Result<Classifier> {
    // Hold the process's generator from seeding until every random parameter exists, so
    // concurrent trainings in one process (tests, embedding programs) start from their seed.
    let (model, drawing) = init_model_drawn_later(cfg, config, classes, multi_label, device, log)?;
    drawing.made(model)
}

/// The seed lock held ([`seed_lock`]): while a model's parameters wait to be drawn.
pub type SeedGuard = std::sync::MutexGuard<'static, ()>;

/// The lock under which Hearth's trainings seed Burn's random generator and make their
/// parameters. Burn keeps one generator per process and makes a parameter's random values on
/// its first use, so code that seeds a device and draws (a model it builds and runs, a random
/// tensor) while a Hearth training may start in another thread of the process holds this
/// meanwhile: neither then takes the other's draws, and each starts from its own seed. Do not
/// call [`crate::train::train`] while holding it: the training waits for it.
pub fn seed_lock() -> SeedGuard {
    SEED_LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A model whose values are not all made yet: the seed lock, held until its random parameters
/// are drawn (in the model's visiting order, they are then [`init_model`]'s), and the reads of
/// the torchvision file it was loaded from, which are made as each parameter is first used.
pub(crate) struct Drawing {
    _rng: SeedGuard,
    reads: Option<hearth_models::DeferredReads>,
}

impl Drawing {
    /// `model` with every value made now, in its visiting order under the seed lock; then
    /// [`Self::finish`].
    pub(crate) fn made<M: Module>(self, model: M) -> Result<M> {
        let model = materialize(model);
        self.finish()?;
        Ok(model)
    }

    /// The torchvision file the model was loaded from and its tensors by parameter, where
    /// every parameter the file gives can be read from them a window at a time
    /// ([`hearth_models::DeferredReads::file_tensors`]).
    pub(crate) fn file_tensors(
        &self,
    ) -> Option<(
        &std::path::Path,
        &std::collections::HashMap<burn::module::ParamId, hearth_models::FileTensor>,
    )> {
        let reads = self.reads.as_ref()?;
        Some((reads.path(), reads.file_tensors()?))
    }

    /// Once every value is made: lets the seed lock go, and says whether a read of the weights
    /// file failed (the file changed under the run; the values made from it are then zeros).
    pub(crate) fn finish(self) -> Result<()> {
        match self.reads.and_then(|r| r.failure()) {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }
}

/// [`init_model`] with the parameters not made yet: the process's generator seeded and held,
/// the model's random parameters left to be drawn and a torchvision file's tensors to be read
/// as they are first used ([`Drawing`]). ZeRO stage 3's rank 0 makes them a bucket at a time
/// as it hands them out, and lets each go, so that it never holds the whole model.
pub(crate) fn init_model_drawn_later(
    cfg: &TrainConfig,
    config: &ModelConfig,
    classes: usize,
    multi_label: bool,
    device: &Device,
    log: &mut dyn FnMut(&str),
) -> Result<(Classifier, Drawing)> {
    let rng = seed_lock();
    device.seed(cfg.seed);
    let head = head_config(classes, multi_label);
    let mut model = config.init(device)?;
    let mut reads = None;
    if let Some(weights) = &cfg.model.weights
        && WeightsFormat::of(weights)? == WeightsFormat::Hearth
    {
        // A Hearth model file (an earlier run's model.bpk): the same architecture, whatever its
        // classes; its head gives way to a new one seeded as the torchvision path seeds it.
        let saved = load_model(weights, device)?;
        let arch = |c: &ModelConfig| serde_json::to_string(&c.clone().with_classes(1)).ok();
        if arch(&saved.config) != arch(config) {
            return Err(HearthError::InvalidArgument(format!(
                "`model.weights` {}: its {} architecture is not the one of `model.name` {} ({})",
                weights.display(),
                saved.model.family(),
                cfg.model.name,
                arch(&saved.config).unwrap_or_default()
            )));
        }
        log(&format!(
            "loaded the {}-class model {}; new {classes}-class head",
            saved.config.num_classes(),
            weights.display(),
        ));
        model = saved.model.replace_head(head, device)?;
    } else if let Some(weights) = &cfg.model.weights {
        let options = LoadOptions {
            skip_head: true,
            ..Default::default()
        };
        // Checked now, read as each tensor is first used.
        let (loaded, report, deferred) = load_torchvision_deferred(model, weights, &options)?;
        model = loaded;
        reads = Some(deferred);
        log(&format!(
            "loaded {} tensors from {}; new {classes}-class head",
            report.applied,
            weights.display(),
        ));
        model = model.replace_head(head, device)?;
    } else if multi_label {
        model = model.replace_head(head, device)?;
    }
    Ok((model, Drawing { _rng: rng, reads }))
}

/// The head [`init_model`] gives a model of `classes` outputs.
fn head_config(classes: usize, multi_label: bool) -> HeadConfig {
    match multi_label {
        true => HeadConfig::new(classes)
            .with_activation(HeadActivation::Sigmoid)
            .with_bias(BiasInit::Constant(1.0)),
        false => HeadConfig::new(classes),
    }
}

/// The model [`init_model`] builds for `cfg`, its parameters left uninitialised (Burn's lazy
/// parameters: nothing allocated, nothing drawn from the seed), to load a checkpoint into: a
/// record's values replace them without their random values ever being made (the export of the
/// best epoch built a seeded model beside the checkpoint's record: twice the model on rank 0,
/// VGG-16's 553 MB among them). The weights of `model.weights` are not loaded: only their head's
/// shape matters, which the new head has.
pub(crate) fn model_skeleton(
    cfg: &TrainConfig,
    config: &ModelConfig,
    classes: usize,
    multi_label: bool,
    device: &Device,
) -> Result<Classifier> {
    let model = config.init(device)?;
    match cfg.model.weights.is_some() || multi_label {
        true => Ok(model.replace_head(head_config(classes, multi_label), device)?),
        false => Ok(model),
    }
}

/// `model` with every parameter initialised now (Burn initialises them lazily, on first use:
/// under the seed lock they are drawn from the seeded generator).
pub(crate) fn materialize<M: Module>(model: M) -> M {
    model.visit(&mut Materialize);
    model
}

/// [`materialize`] under [`SEED_LOCK`], where the values drawn are overwritten anyway (a ZeRO
/// stage 3 skeleton's frozen tensors, which rank 0's replace): the draws keep out of the way
/// of a seeded initialisation elsewhere in the process.
pub(crate) fn materialize_locked<M: Module>(model: M) -> M {
    let _rng = seed_lock();
    materialize(model)
}

/// `model` with every parameter trainable for the fine-tuning phase of `--unfreeze-after`,
/// its batch norms normalising as `--finetune-bn` says (every mode unfreezes through this).
pub(crate) fn unfrozen<M: Module>(cfg: &TrainConfig, model: M) -> M {
    let model = model.unfreeze();
    match cfg.model.finetune_bn {
        FinetuneBn::Frozen => hearth_models::keep_batch_norm_statistics(model),
        FinetuneBn::Batch => model,
    }
}

/// Seeds `device`'s random stream (dropout and other random ops inside the model) with
/// [`epoch_seed`]`(seed, at, rank)`, under [`SEED_LOCK`] so that no training in this process
/// initialises its parameters meanwhile. Every mode seeds each epoch or step this way, so a
/// resumed run draws what the uninterrupted one would.
pub(crate) fn seed_stream(device: &Device, seed: u64, at: u64, rank: usize) {
    let _rng = seed_lock();
    device.seed(epoch_seed(seed, at, rank));
}

/// The seed of the random stream of epoch `epoch` on `rank` (dropout and other random ops
/// inside the model): a function of the run's seed, so a resumed run continues the stream an
/// uninterrupted one would have used.
pub fn epoch_seed(seed: u64, epoch: u64, rank: usize) -> u64 {
    // SplitMix64 finaliser over the three inputs.
    let mut z = seed
        ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (rank as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
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

pub fn optimizer(cfg: &TrainConfig) -> ModuleOptimizer {
    match cfg.optim.optimizer {
        OptimizerKind::Sgd => {
            // PyTorch semantics: no dampening.
            let momentum = (cfg.momentum() > 0.0).then(|| {
                MomentumConfig::new()
                    .with_momentum(cfg.momentum())
                    .with_dampening(0.0)
                    .with_nesterov(cfg.optim.nesterov)
            });
            ModuleOptimizer::from(DecayWeightsOnly {
                inner: SgdConfig::new().with_momentum(momentum).build(),
                weight_decay: cfg.optim.weight_decay,
            })
        }
        OptimizerKind::Adam => ModuleOptimizer::from(DecayWeightsOnly {
            inner: AdamConfig::new().build(),
            weight_decay: cfg.optim.weight_decay,
        }),
        OptimizerKind::AdamW => AdamWConfig::new()
            .with_weight_decay(cfg.optim.weight_decay as f32)
            .init(),
        OptimizerKind::Lars => LarsConfig::new()
            .with_momentum(cfg.momentum())
            .with_weight_decay(cfg.optim.weight_decay)
            .init(),
    }
}
