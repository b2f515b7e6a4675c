//! The names most programs that embed Hearth use: `use hearth::prelude::*;`.

pub use crate::device::{DeviceSpec, select};
pub use crate::models::{Architecture, LoadOptions, ModelConfig, load_torchvision};
pub use crate::train::{
    CheckpointSettings, ComputeSettings, DataSettings, ElasticOptions, ExchangeSettings,
    ModelSettings, Net, OptimSettings, OptimizerKind, PipelineOptions, Precision, PsMode,
    PsOptions, PsServers, TrainConfig, TrainConfigBuilder, TrainReport, TrainingMode, train,
    train_custom,
};
pub use crate::{HearthError, Result};
pub use burn::prelude::Device;
