//! [`TrainConfigBuilder`]: a [`TrainConfig`] for programs that embed the library, set by name
//! and checked once at the end ([`TrainConfigBuilder::build`] runs [`TrainConfig::validate`]).

use std::path::PathBuf;

use super::TrainConfig;
use super::config::{
    CheckpointSettings, ComputeSettings, DataSettings, ExchangeSettings, ModelSettings,
    OptimSettings,
};
use crate::Result;
use crate::settings::{OptimizerKind, Precision, TrainingMode};

/// Builds a [`TrainConfig`]: every setting starts at its default ([`TrainConfig::new`]), each
/// call sets one, and [`Self::build`] refuses a combination that cannot run, naming it.
///
/// ```
/// use hearth::train::{OptimizerKind, TrainConfig};
///
/// let cfg = TrainConfig::builder("runs/flowers")
///     .data_folder("data/flowers")
///     .model("resnet50")
///     .weights("resnet50.pth")
///     .freeze_backbone(Some(2)) // the head alone for 2 epochs, then everything
///     .image_size(224)
///     .optimizer(OptimizerKind::Adam, 1e-3)
///     .epochs(8)
///     .patience(3)
///     .build()?;
/// assert_eq!(cfg.model.unfreeze_after, Some(2));
/// # Ok::<(), hearth::HearthError>(())
/// ```
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct TrainConfigBuilder {
    cfg: TrainConfig,
}

impl TrainConfig {
    /// A builder whose run writes to `run_dir`, every other setting at its default.
    pub fn builder(run_dir: impl Into<PathBuf>) -> TrainConfigBuilder {
        TrainConfigBuilder {
            cfg: TrainConfig::new(run_dir.into()),
        }
    }
}

impl TrainConfigBuilder {
    /// The settings as set so far, checked ([`TrainConfig::validate`]): an error names the
    /// setting that does not fit.
    pub fn build(self) -> Result<TrainConfig> {
        self.cfg.validate()?;
        Ok(self.cfg)
    }

    /// Passes over the training set.
    pub fn epochs(mut self, epochs: usize) -> Self {
        self.cfg.epochs = epochs;
        self
    }

    /// The global batch: images per optimizer step over all ranks together.
    pub fn batch_size(mut self, batch_size: usize) -> Self {
        self.cfg.batch_size = batch_size;
        self
    }

    /// The seed of the run's randomness (initial weights, data order, augmentation).
    pub fn seed(mut self, seed: u64) -> Self {
        self.cfg.seed = seed;
        self
    }

    /// An image folder (`train/` and `val/` class folders, or one folder split by
    /// `data.val_fraction`). Without one, a synthetic set is generated into the run.
    pub fn data_folder(mut self, folder: impl Into<PathBuf>) -> Self {
        self.cfg.data.folder = Some(folder.into());
        self
    }

    /// The input side in pixels.
    pub fn image_size(mut self, pixels: u32) -> Self {
        self.cfg.data.image_size = pixels;
        self
    }

    /// A torchvision name (`resnet50`, `densenet121`, `vgg16`, ...) or a test-size network.
    pub fn model(mut self, name: impl Into<String>) -> Self {
        self.cfg.model.name = name.into();
        self
    }

    /// Weights to start from (torchvision `.pth`/`.safetensors`, or a run's `.bpk`); the head
    /// is replaced to fit the data's classes.
    pub fn weights(mut self, path: impl Into<PathBuf>) -> Self {
        self.cfg.model.weights = Some(path.into());
        self
    }

    /// Trains the new head alone; with `unfreeze_after`, everything after that many epochs
    /// (at `model.finetune_lr`).
    pub fn freeze_backbone(mut self, unfreeze_after: Option<usize>) -> Self {
        self.cfg.model.freeze_backbone = true;
        self.cfg.model.unfreeze_after = unfreeze_after;
        self
    }

    /// The optimizer and its peak learning rate.
    pub fn optimizer(mut self, optimizer: OptimizerKind, lr: f64) -> Self {
        self.cfg.optim.optimizer = optimizer;
        self.cfg.optim.lr = lr;
        self
    }

    /// Early stopping after `epochs` epochs without an improvement of `checkpoint.monitor`.
    pub fn patience(mut self, epochs: usize) -> Self {
        self.cfg.checkpoint.patience = Some(epochs);
        self
    }

    /// Continues the run in the run directory after its last complete epoch.
    pub fn resume(mut self) -> Self {
        self.cfg.checkpoint.resume = true;
        self
    }

    /// The type steps compute in (mixed precision keeps f32 master weights).
    pub fn precision(mut self, precision: Precision) -> Self {
        self.cfg.compute.precision = precision;
        self
    }

    /// This process's place in a distributed job (`RankInfo::detect()` reads the launcher's).
    pub fn dist(mut self, dist: Option<burn_dist::rendezvous::RankInfo>) -> Self {
        self.cfg.dist = dist;
        self
    }

    /// The training mode with its own options (default: data parallel).
    pub fn mode(mut self, mode: TrainingMode) -> Self {
        self.cfg.mode = mode;
        self
    }

    /// The whole data section (`DataSettings { .., ..Default::default() }`).
    pub fn data(mut self, data: DataSettings) -> Self {
        self.cfg.data = data;
        self
    }

    /// The whole model section.
    pub fn model_settings(mut self, model: ModelSettings) -> Self {
        self.cfg.model = model;
        self
    }

    /// The whole optimizer section.
    pub fn optim(mut self, optim: OptimSettings) -> Self {
        self.cfg.optim = optim;
        self
    }

    /// The whole checkpoint and early-stopping section.
    pub fn checkpoint(mut self, checkpoint: CheckpointSettings) -> Self {
        self.cfg.checkpoint = checkpoint;
        self
    }

    /// The whole compute section (precision, recomputation).
    pub fn compute(mut self, compute: ComputeSettings) -> Self {
        self.cfg.compute = compute;
        self
    }

    /// The whole gradient-exchange section (buckets, compression, ZeRO, overlap).
    pub fn exchange(mut self, exchange: ExchangeSettings) -> Self {
        self.cfg.exchange = exchange;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_builder_sets_what_it_names_and_build_refuses_what_cannot_run() {
        let cfg = TrainConfig::builder("run")
            .model("resnet18")
            .optimizer(OptimizerKind::AdamW, 2e-3)
            .data(DataSettings {
                image_size: 64,
                ..Default::default()
            })
            .epochs(3)
            .build()
            .unwrap();
        assert_eq!(cfg.model.name, "resnet18");
        assert_eq!(cfg.optim.optimizer, OptimizerKind::AdamW);
        assert_eq!(cfg.optim.lr, 2e-3);
        assert_eq!(cfg.data.image_size, 64);
        assert_eq!(cfg.epochs, 3);
        // The rest stays at TrainConfig::new's defaults.
        let defaults = TrainConfig::new("run".into());
        assert_eq!(cfg.batch_size, defaults.batch_size);
        assert_eq!(cfg.data.val_fraction, defaults.data.val_fraction);
        // What validate refuses, build refuses, naming it.
        let e = TrainConfig::builder("run")
            .model("resnet51")
            .build()
            .unwrap_err()
            .to_string();
        assert!(e.contains("resnet51"), "{e}");
        let e = TrainConfig::builder("run")
            .epochs(0)
            .build()
            .unwrap_err()
            .to_string();
        assert!(e.contains("`epochs` must be at least 1"), "{e}");
    }
}
