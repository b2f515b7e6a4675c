//! # hearth-models
//!
//! torchvision's image classifiers as Burn modules: ResNet-18/34/50/101/152, VGG-11/13/16/19
//! (with and without batch norm) and DenseNet-121/161/169/201. Architectures, parameter counts
//! and (after a documented key remapping) parameter names are torchvision's, so torchvision
//! weights load and give the same outputs.
//!
//! ```no_run
//! use burn::prelude::*;
//! use hearth_models::{Architecture, HeadConfig, LoadOptions, load_torchvision};
//!
//! # fn main() -> Result<(), hearth_models::ModelError> {
//! let device = Device::flex();
//! // ImageNet weights from torchvision, then a new 5-class head on a frozen backbone.
//! let mut model = Architecture::ResNet50.init(1000, &device)?;
//! load_torchvision(&mut model, "resnet50.pth".as_ref(), &LoadOptions::default())?;
//! let model = model
//!     .replace_head(HeadConfig::new(5), &device)?
//!     .freeze_backbone();
//! let logits = model.forward(Tensor::zeros([1, 3, 224, 224], &device));
//! assert_eq!(logits.dims(), [1, 5]);
//! # Ok(()) }
//! ```
//!
//! Any input of at least 32x32 works: every network ends in adaptive pooling.

mod error;
mod layers;

pub mod deferred;
pub mod densenet;
pub mod export;
pub mod model_file;
pub mod pack;
pub mod pth;
pub mod resnet;
pub mod stages;
mod stored;
pub mod vgg;
pub mod weights;
pub mod zoo;

pub use deferred::{DeferredReads, FileTensor, load_torchvision_deferred};
pub use densenet::{DenseNet, DenseNetConfig};
pub use error::{ModelError, Result};
pub use export::{export_torchvision, export_torchvision_pth};
pub use layers::{BiasInit, HeadActivation, HeadConfig, keep_batch_norm_statistics};
pub use model_file::{Preprocessing, save_model_from_file};
pub use resnet::{BlockKind, ResNet, ResNetConfig};
pub use vgg::{Vgg, VggConfig, VggLayer};
pub use weights::{
    LoadOptions, LoadReport, SavedModel, WeightsFormat, load_model, load_torchvision, save_model,
    save_model_with,
};
pub use zoo::{Architecture, Classifier, MIN_INPUT_SIZE, ModelConfig};
