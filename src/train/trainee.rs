//! What the custom training modes (allreduce, elastic, parameter servers) train, below all of
//! them: a model that maps a batch's input to one logit per class ([`Net`]), and the data that feeds it.
//!
//! Two kinds exist. Hearth's own: a [`Classifier`] from `--model` (optionally torchvision
//! weights with a new head, a frozen backbone) on an image folder or CSV, streamed by
//! hearth-datasets' loader ([`ImageRecipe`]). A Rust user's: any Burn module of theirs that
//! implements [`Net`] in a few lines, on their own data set ([`Examples`]), handed to
//! [`super::train_custom`] ([`Custom`]). The modes see only [`Trainee`], so both train through
//! the same steps, validation, metrics, checkpoints and resume.
//!
//! The order of an epoch and the shard of a rank are the same for both: hearth-datasets'
//! [`epoch_order`] and [`shard_of`].

use std::path::Path;
use std::sync::Arc;

use burn::prelude::*;
use hearth_datasets::loader::{epoch_order, shard_of};
use hearth_models::{Classifier, ModelConfig};

use super::TrainConfig;
use super::targets::{BatchMixing, Targets, train_targets};
use crate::{HearthError, Result};

pub use super::net::Net;

/// The error a user's [`Examples`] returns for a batch it cannot make.
pub type ExampleError = Box<dyn std::error::Error + Send + Sync>;

/// A user's data set for [`super::train_custom`]: examples addressed by index `0..len()`, and
/// how a list of them becomes one batch on a device. Hearth decides which indices (the
/// epoch's shuffled order, each rank's or worker's share).
pub trait Examples: Send + Sync + 'static {
    /// The model's input for a batch (the [`Net::Input`] of the model it feeds).
    type Input: Send + 'static;
    /// How many examples the set holds.
    fn len(&self) -> usize;
    /// Whether the set is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The batch of the examples `indices` (in that order) on `device`: the input and its
    /// targets ([`Targets::Classes`], or [`Targets::MultiHot`] for multi-label data).
    fn batch(
        &self,
        indices: &[usize],
        device: &Device,
    ) -> std::result::Result<(Self::Input, Targets), ExampleError>;
}

/// Batches of one stream: input and targets.
pub(crate) type Stream<I> = Box<dyn Iterator<Item = Result<(I, Targets)>>>;

/// The input type of a trainee's model.
pub(crate) type Input<T> = <<T as Trainee>::Model as Net>::Input;

/// A model and its data, as a mode trains them on one rank.
pub(crate) trait Trainee {
    type Model: Net;

    /// What the model's outputs mean.
    fn outputs(&self) -> &Outputs;
    /// The class (or label) names.
    fn classes(&self) -> &[String] {
        &self.outputs().classes
    }
    /// Whether the targets are multi-hot labels (sigmoid outputs).
    fn multi_label(&self) -> bool {
        self.outputs().multi_label
    }
    /// What `model_config.json` records (a resume must find the same).
    fn describe(&self) -> String;
    /// The model on `device`, freshly initialised from the run's seed (every rank alike).
    fn init(&self, device: &Device, log: &mut dyn FnMut(&str)) -> Result<Self::Model>;
    /// [`Self::init`] with the parameters not made yet, and what must hold until they all are
    /// (the seed lock: made in the model's visiting order, they are `init`'s values) and be
    /// checked after ([`super::model::Drawing::finish`]): ZeRO stage 3's rank 0 makes them a
    /// bucket at a time as it hands them out. By default `init`'s model, made already.
    fn init_drawn_later(
        &self,
        device: &Device,
        log: &mut dyn FnMut(&str),
    ) -> Result<(Self::Model, Option<super::model::Drawing>)> {
        Ok((self.init(device, log)?, None))
    }
    /// The model's structure to load a checkpoint into (the export of the best epoch): by
    /// default [`Self::init`]; a trainee whose parameters initialise lazily leaves them so,
    /// since the checkpoint's values replace them all.
    fn skeleton(&self, device: &Device) -> Result<Self::Model> {
        self.init(device, &mut |_| {})
    }
    /// `model` with the tensors of a phase trainable: `frozen` (`--freeze-backbone` before
    /// `--unfreeze-after`) the head alone, else everything.
    fn phase(&self, model: Self::Model, frozen: bool) -> Self::Model;
    /// Whether the model keeps batch-norm statistics (measured on the servers' values in the
    /// asynchronous parameter-server modes).
    fn has_batch_norm(&self) -> bool;

    /// Training examples (all ranks together).
    fn train_len(&self) -> usize;
    /// Validation examples (all ranks together).
    fn val_len(&self) -> usize;
    /// The training set's order in `epoch` (the same on every rank).
    fn order(&self, epoch: u64) -> Vec<usize>;
    /// The given training batches (indices of the set) of `epoch`, augmented where the data
    /// augments.
    fn train_batches(
        &self,
        epoch: u64,
        batches: Vec<Vec<usize>>,
        device: &Device,
    ) -> Stream<Input<Self>>;
    /// The given validation batches.
    fn val_batches(&self, batches: Vec<Vec<usize>>, device: &Device) -> Stream<Input<Self>>;
    /// This rank's batches of `epoch` (the shard it was prepared for).
    fn shard(&self, epoch: u64, device: &Device) -> Stream<Input<Self>>;
    /// This rank's batches per epoch.
    fn shard_batches(&self) -> usize;
    /// The whole validation set, in order, in batches of this rank's size.
    fn full_val(&self, device: &Device) -> Stream<Input<Self>>;

    /// Examples that failed to load so far on this rank: (training, validation).
    fn decode_failures(&self) -> (usize, usize) {
        (0, 0)
    }
    /// Those examples, `path: reason`, each once.
    fn skipped(&self) -> Vec<String> {
        Vec::new()
    }
    /// Writes the run's `model.bpk` from the best epoch's `model` (a user's module: its
    /// weights as burnpack, to load into the same module).
    fn export(&self, cfg: &TrainConfig, model: &Self::Model, out: &Path) -> Result<()>;
    /// Writes `out` as [`Self::export`] does from the model whose weights are the checkpoint
    /// file `checkpoint` (`checkpoint::save_epoch_weights`'): by default that model loaded
    /// ([`load_checkpoint`]) and exported; Hearth's classifiers copy the file's tensors one at
    /// a time into theirs, no model built.
    fn export_checkpoint(
        &self,
        cfg: &TrainConfig,
        checkpoint: &Path,
        device: &Device,
        out: &Path,
    ) -> Result<()> {
        let model = load_checkpoint(self, checkpoint, device)?;
        self.export(cfg, &model, out)
    }
}

/// The checkpoint file `path` (a burnpack of the trainee's model) loaded into
/// [`Trainee::skeleton`]: the model it holds, its values never drawn first.
pub(crate) fn load_checkpoint<T: Trainee + ?Sized>(
    trainee: &T,
    path: &Path,
    device: &Device,
) -> Result<T::Model> {
    let record = burn::store::ModuleRecord::load(path)
        .map_err(|e| HearthError::Training(format!("the checkpoint {}: {e}", path.display())))?;
    trainee
        .skeleton(device)?
        .try_load_record(record)
        .map_err(|e| {
            HearthError::Training(format!(
                "the checkpoint {} does not fit the model: {e}",
                path.display()
            ))
        })
}

/// What a model's outputs mean: one per class (or label), and whether they are independent
/// labels (multi-hot targets, sigmoid) or one class per example.
#[derive(Clone, Debug)]
pub(crate) struct Outputs {
    pub classes: Vec<String>,
    pub multi_label: bool,
}

/// How a mode gets its [`Trainee`] once it knows which ranks read the data.
pub(crate) trait Recipe: Sync {
    type T: Trainee;
    /// The data and model of `rank` of `world` readers; `comm`, the readers' group when there
    /// is one, lets them agree they read the same data.
    fn prepare(
        &self,
        cfg: &TrainConfig,
        comm: Option<&burn_dist::Communicator>,
        rank: usize,
        world: usize,
        log: &mut dyn FnMut(&str),
    ) -> Result<Self::T>;
}

// ---- Hearth's image classifiers ----

/// `--model` on `--data` (or `--labels`, or the synthetic set).
pub(crate) struct ImageRecipe;

/// A classifier and this rank's image loaders.
pub(crate) struct ImageTrainee {
    cfg: TrainConfig,
    loaders: super::sets::Loaders,
    outputs: Outputs,
    config: ModelConfig,
    /// `data.mixup`, `data.cutmix`: how training batches are mixed (`None`: not at all).
    mixing: Option<BatchMixing>,
}

impl Recipe for ImageRecipe {
    type T = ImageTrainee;
    fn prepare(
        &self,
        cfg: &TrainConfig,
        comm: Option<&burn_dist::Communicator>,
        rank: usize,
        world: usize,
        log: &mut dyn FnMut(&str),
    ) -> Result<ImageTrainee> {
        if rank == 0 {
            log(&format!("augmentation: {}", cfg.data.augmentation));
        }
        let (train_set, val_set) = match comm {
            Some(comm) => super::distributed::load_data(cfg, comm, log)?,
            None => super::sets::load(cfg, log)?,
        };
        let classes = train_set.classes.clone();
        let multi_label = train_set.multi_label;
        let config = super::catalog::model_config(&cfg.model.name, classes.len())?;
        let loaders = super::sets::Loaders::new(cfg, train_set, val_set, rank, world)?;
        Ok(ImageTrainee {
            cfg: cfg.clone(),
            loaders,
            outputs: Outputs {
                classes,
                multi_label,
            },
            config,
            mixing: BatchMixing::new(cfg.data.mixing(), cfg.seed),
        })
    }
}

/// A loader's batches as (images, targets).
fn images(stream: hearth_datasets::BatchStream, multi_label: bool) -> Stream<Tensor<4>> {
    Box::new(stream.map(move |b| super::targets::targets(b?, multi_label)))
}

/// A loader's training batches of epoch `epoch` (from 0) as (images, targets), mixed where the
/// run mixes.
fn train_images(
    stream: hearth_datasets::BatchStream,
    multi_label: bool,
    mixing: Option<BatchMixing>,
    epoch: u64,
) -> Stream<Tensor<4>> {
    Box::new(stream.map(move |b| train_targets(b?, multi_label, mixing.as_ref(), epoch)))
}

impl Trainee for ImageTrainee {
    type Model = Classifier;

    fn outputs(&self) -> &Outputs {
        &self.outputs
    }
    fn describe(&self) -> String {
        self.config.to_json()
    }
    fn init(&self, device: &Device, log: &mut dyn FnMut(&str)) -> Result<Classifier> {
        match self.init_drawn_later(device, log)? {
            (model, Some(drawing)) => drawing.made(model),
            (model, None) => Ok(super::model::materialize(model)),
        }
    }
    fn init_drawn_later(
        &self,
        device: &Device,
        log: &mut dyn FnMut(&str),
    ) -> Result<(Classifier, Option<super::model::Drawing>)> {
        let (model, drawing) = super::model::init_model_drawn_later(
            &self.cfg,
            &self.config,
            self.outputs.classes.len(),
            self.outputs.multi_label,
            device,
            log,
        )?;
        Ok((model, Some(drawing)))
    }
    fn skeleton(&self, device: &Device) -> Result<Classifier> {
        super::model::model_skeleton(
            &self.cfg,
            &self.config,
            self.outputs.classes.len(),
            self.outputs.multi_label,
            device,
        )
    }
    fn phase(&self, model: Classifier, frozen: bool) -> Classifier {
        if frozen {
            model.freeze_backbone()
        } else if self.cfg.model.freeze_backbone {
            super::model::unfrozen(&self.cfg, model)
        } else {
            model
        }
    }
    fn has_batch_norm(&self) -> bool {
        !matches!(&self.config, ModelConfig::Vgg(v) if !v.batch_norm)
    }
    fn train_len(&self) -> usize {
        self.loaders.train.set().len()
    }
    fn val_len(&self) -> usize {
        self.loaders.full_val.set().len()
    }
    fn order(&self, epoch: u64) -> Vec<usize> {
        self.loaders.train.epoch_order(epoch)
    }
    fn train_batches(
        &self,
        epoch: u64,
        batches: Vec<Vec<usize>>,
        device: &Device,
    ) -> Stream<Tensor<4>> {
        train_images(
            self.loaders.train.stream(epoch, batches, device),
            self.outputs.multi_label,
            self.mixing.clone(),
            epoch,
        )
    }
    fn val_batches(&self, batches: Vec<Vec<usize>>, device: &Device) -> Stream<Tensor<4>> {
        images(
            self.loaders.full_val.stream(0, batches, device),
            self.outputs.multi_label,
        )
    }
    fn shard(&self, epoch: u64, device: &Device) -> Stream<Tensor<4>> {
        train_images(
            self.loaders.train.epoch(epoch, device),
            self.outputs.multi_label,
            self.mixing.clone(),
            epoch,
        )
    }
    fn shard_batches(&self) -> usize {
        self.loaders.train.batches_per_epoch()
    }
    fn full_val(&self, device: &Device) -> Stream<Tensor<4>> {
        images(
            self.loaders.full_val.epoch(0, device),
            self.outputs.multi_label,
        )
    }
    fn decode_failures(&self) -> (usize, usize) {
        self.loaders.decode_failures()
    }
    fn skipped(&self) -> Vec<String> {
        self.loaders.skipped()
    }
    fn export(&self, cfg: &TrainConfig, model: &Classifier, out: &Path) -> Result<()> {
        hearth_models::save_model_with(
            model,
            &self.config,
            Some(&self.outputs.classes),
            Some(&hearth_models::Preprocessing::eval(cfg.data.image_size)),
            out,
        )?;
        Ok(())
    }
    fn export_checkpoint(
        &self,
        cfg: &TrainConfig,
        checkpoint: &Path,
        device: &Device,
        out: &Path,
    ) -> Result<()> {
        hearth_models::save_model_from_file(
            checkpoint,
            &self.skeleton(device)?,
            &self.config,
            Some(&self.outputs.classes),
            Some(&hearth_models::Preprocessing::eval(cfg.data.image_size)),
            out,
        )?;
        Ok(())
    }
}

// ---- A user's own module and data ----

/// A user's model and data for [`super::train_custom`]: how to build the model (Hearth seeds
/// the device first, so every rank builds the same one), the training and validation sets,
/// and the class names.
pub struct Custom<N: Net, E: Examples<Input = N::Input>> {
    init: Arc<dyn Fn(&Device) -> N + Send + Sync>,
    train: Arc<E>,
    val: Arc<E>,
    outputs: Outputs,
}

impl<N: Net, E: Examples<Input = N::Input>> Custom<N, E> {
    /// `init` builds the model on a device; `classes` names the model's outputs.
    pub fn new(
        init: impl Fn(&Device) -> N + Send + Sync + 'static,
        train: E,
        val: E,
        classes: Vec<String>,
    ) -> Self {
        Self {
            init: Arc::new(init),
            train: Arc::new(train),
            val: Arc::new(val),
            outputs: Outputs {
                classes,
                multi_label: false,
            },
        }
    }

    /// The targets are multi-hot labels ([`Targets::MultiHot`]): binary cross-entropy per
    /// output, Hamming score, `val_auroc` and `auroc.csv`.
    pub fn multi_label(mut self) -> Self {
        self.outputs.multi_label = true;
        self
    }

    pub(crate) fn is_multi_label(&self) -> bool {
        self.outputs.multi_label
    }
}

/// A user's model and this rank's view of their data.
pub(crate) struct CustomTrainee<N: Net, E: Examples<Input = N::Input>> {
    init: Arc<dyn Fn(&Device) -> N + Send + Sync>,
    train: Arc<E>,
    val: Arc<E>,
    outputs: Outputs,
    seed: u64,
    /// This rank's share of a global batch, its rank and the readers.
    batch: usize,
    rank: usize,
    world: usize,
}

impl<N: Net, E: Examples<Input = N::Input>> Recipe for Custom<N, E> {
    type T = CustomTrainee<N, E>;
    fn prepare(
        &self,
        cfg: &TrainConfig,
        _comm: Option<&burn_dist::Communicator>,
        rank: usize,
        world: usize,
        log: &mut dyn FnMut(&str),
    ) -> Result<Self::T> {
        if self.train.is_empty() || self.val.is_empty() {
            return Err(HearthError::InvalidArgument(format!(
                "the custom data set has {} training and {} validation examples; both need some",
                self.train.len(),
                self.val.len()
            )));
        }
        if self.outputs.classes.len() < 2 {
            return Err(HearthError::InvalidArgument(format!(
                "a custom model needs at least 2 class names, got {}",
                self.outputs.classes.len()
            )));
        }
        log(&format!(
            "data: {} training and {} validation examples, {} {}",
            self.train.len(),
            self.val.len(),
            self.outputs.classes.len(),
            if self.outputs.multi_label {
                "labels (multi-label)"
            } else {
                "classes"
            }
        ));
        Ok(CustomTrainee {
            init: self.init.clone(),
            train: self.train.clone(),
            val: self.val.clone(),
            outputs: self.outputs.clone(),
            seed: cfg.seed,
            batch: (cfg.batch_size / world.max(1)).max(1),
            rank,
            world: world.max(1),
        })
    }
}

/// The batches `batches` of a user's set, made one after another.
fn made<E: Examples>(
    set: &Arc<E>,
    what: &'static str,
    batches: Vec<Vec<usize>>,
    device: &Device,
) -> Stream<E::Input> {
    let set = set.clone();
    let device = device.clone();
    Box::new(batches.into_iter().map(move |indices| {
        set.batch(&indices, &device).map_err(|e| {
            HearthError::Training(format!(
                "the {what} batch of examples {}..: {e}",
                indices.first().copied().unwrap_or(0)
            ))
        })
    }))
}

impl<N: Net, E: Examples<Input = N::Input>> Trainee for CustomTrainee<N, E> {
    type Model = N;

    fn outputs(&self) -> &Outputs {
        &self.outputs
    }
    fn describe(&self) -> String {
        serde_json::json!({
            "custom": std::any::type_name::<N>(),
            "classes": self.outputs.classes,
            "multi_label": self.outputs.multi_label,
        })
        .to_string()
    }
    fn init(&self, device: &Device, _log: &mut dyn FnMut(&str)) -> Result<N> {
        // As Hearth's own models: the process's generator held from seeding until every
        // parameter exists, so every rank starts from the same values.
        let _rng = super::model::seed_lock();
        device.seed(self.seed);
        let model = (self.init)(device);
        Ok(super::model::materialize(model))
    }
    fn phase(&self, model: N, _frozen: bool) -> N {
        // `--freeze-backbone` is refused for custom models before any rank starts.
        model
    }
    fn has_batch_norm(&self) -> bool {
        true
    }
    fn train_len(&self) -> usize {
        self.train.len()
    }
    fn val_len(&self) -> usize {
        self.val.len()
    }
    fn order(&self, epoch: u64) -> Vec<usize> {
        epoch_order(self.train.len(), self.seed, epoch, true)
    }
    fn train_batches(
        &self,
        _epoch: u64,
        batches: Vec<Vec<usize>>,
        device: &Device,
    ) -> Stream<N::Input> {
        made(&self.train, "training", batches, device)
    }
    fn val_batches(&self, batches: Vec<Vec<usize>>, device: &Device) -> Stream<N::Input> {
        made(&self.val, "validation", batches, device)
    }
    fn shard(&self, epoch: u64, device: &Device) -> Stream<N::Input> {
        let order = self.order(epoch);
        let mine = shard_of(&order, self.batch, self.rank, self.world, false, true);
        let batches = mine.chunks(self.batch).map(<[usize]>::to_vec).collect();
        made(&self.train, "training", batches, device)
    }
    fn shard_batches(&self) -> usize {
        let order: Vec<usize> = (0..self.train.len()).collect();
        shard_of(&order, self.batch, self.rank, self.world, false, true)
            .len()
            .div_ceil(self.batch)
    }
    fn full_val(&self, device: &Device) -> Stream<N::Input> {
        let all: Vec<usize> = (0..self.val.len()).collect();
        let batches = all.chunks(self.batch).map(<[usize]>::to_vec).collect();
        made(&self.val, "validation", batches, device)
    }
    fn export(&self, _cfg: &TrainConfig, model: &N, out: &Path) -> Result<()> {
        model
            .clone()
            .into_record()
            .save(out)
            .map_err(|e| HearthError::Training(format!("writing {}: {e}", out.display())))
    }
}
