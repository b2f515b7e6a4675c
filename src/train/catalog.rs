//! The architectures `--model` names: torchvision's, and the small test-size networks Hearth
//! adds. Below the settings and the model code alike, so that checking a name needs no model.

use hearth_models::{
    Architecture, BlockKind, DenseNetConfig, ModelConfig, ResNetConfig, VggConfig, VggLayer,
};

use crate::{HearthError, Result};

/// Name of the small ResNet the default run trains.
pub const DEFAULT_MODEL: &str = "resnet-mini";

/// A small VGG with batch norm and dropout (tests and quick runs of the VGG recipe).
pub const MINI_VGG: &str = "vgg-mini";

/// [`MINI_VGG`] without batch norm or dropout: a model whose training is a pure function of
/// the batches (exact equivalence tests of distributed modes).
pub const MINI_VGG_PLAIN: &str = "vgg-mini-plain";

/// A small DenseNet (growth 8, two layers per block, 16 stem channels): DenseNet-121's
/// architecture at test size (the multi-label recipe of seed 001 on a small machine).
pub const MINI_DENSENET: &str = "densenet-mini";

/// The small ResNet of the default run: torchvision's BasicBlock ResNet, one block per stage,
/// widths 16-128 (0.7 M parameters).
pub fn mini_resnet(num_classes: usize) -> ModelConfig {
    ModelConfig::ResNet(
        ResNetConfig::new(BlockKind::Basic, [1, 1, 1, 1], num_classes)
            .with_stem_width(16)
            .with_stage_widths([16, 32, 64, 128]),
    )
}

/// A small VGG with batch norm and torchvision's classifier (dropout 0.5), 64 hidden units.
pub fn mini_vgg(num_classes: usize) -> ModelConfig {
    use VggLayer::{Conv, Pool};
    ModelConfig::Vgg(
        VggConfig::new(
            vec![Conv(16), Pool, Conv(32), Pool, Conv(64), Pool],
            true,
            num_classes,
        )
        .with_hidden(64)
        .with_pool_size(2),
    )
}

/// The small test-size networks `--model` takes beside torchvision's names (no torchvision
/// weights exist for them; an earlier run's `model.bpk` carries them).
pub const MINI_MODELS: [&str; 4] = [DEFAULT_MODEL, MINI_VGG, MINI_VGG_PLAIN, MINI_DENSENET];

/// The architecture `name` (torchvision's names, [`DEFAULT_MODEL`], [`MINI_VGG`],
/// [`MINI_VGG_PLAIN`], [`MINI_DENSENET`]).
pub fn model_config(name: &str, classes: usize) -> Result<ModelConfig> {
    match name {
        DEFAULT_MODEL => Ok(mini_resnet(classes)),
        MINI_VGG => Ok(mini_vgg(classes)),
        MINI_VGG_PLAIN => {
            let ModelConfig::Vgg(v) = mini_vgg(classes) else {
                unreachable!("mini_vgg is a VGG")
            };
            let mut v = v.with_dropout(0.0);
            v.batch_norm = false;
            Ok(ModelConfig::Vgg(v))
        }
        MINI_DENSENET => Ok(ModelConfig::DenseNet(DenseNetConfig::new(
            8,
            vec![2, 2, 2, 2],
            16,
            classes,
        ))),
        _ => match Architecture::from_name(name) {
            Ok(arch) => Ok(arch.config(classes)),
            Err(hearth_models::ModelError::UnknownModel { name, known }) => {
                Err(HearthError::InvalidArgument(format!(
                    "unknown model '{name}'; known models: {known}; test-size networks: {}",
                    MINI_MODELS.join(", ")
                )))
            }
            Err(e) => Err(e.into()),
        },
    }
}
