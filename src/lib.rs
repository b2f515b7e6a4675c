//! # Hearth
//!
//! Image models and distributed training on [Burn](https://burn.dev). This crate is the library
//! (the `hearth` command line and the benches' helpers are the `hearth-cli` crate); the parts
//! are separate crates re-exported here:
//!
//! - [`models`] (`hearth-models`): torchvision-exact ResNet, VGG and DenseNet, weight import.
//! - [`datasets`] (`hearth-datasets`): image folders, augmentation, streaming sharded loader.
//! - [`train`]: training and transfer learning on one epoch loop for every mode; [`optim`] adds LARS,
//!   [`schedule`] warmup schedules and large-batch LR scaling.
//! - [`dist`] (`burn-dist`): collectives and distributed training over QUIC.
//!
//! Fine-tuning a torchvision network on your own folder of images:
//!
//! ```no_run
//! use hearth::prelude::*;
//!
//! # fn main() -> anyhow::Result<()> {
//! // First in main, before any thread starts: Burn's default device on the run's backend,
//! // memory and threads as the `hearth` binary sets them.
//! let spec = unsafe { hearth::process::start("flex") }?; // or "vulkan", "cuda", ...
//! let device = spec.device()?;
//! let mut cfg = TrainConfig::new("runs/flowers".into());
//! cfg.data.folder = Some("data/flowers".into()); // train/ + val/ class folders, or one folder
//! cfg.model.name = "resnet50".into();
//! cfg.model.weights = Some("resnet50.pth".into()); // torchvision ImageNet weights
//! cfg.model.freeze_backbone = true; // train only the new head
//! cfg.data.image_size = 224;
//! cfg.epochs = 5;
//! cfg.checkpoint.patience = Some(2); // early stopping; the best epoch's weights are kept
//! let report = train(&cfg, &device, &mut |line| eprintln!("{line}"))?;
//! println!(
//!     "validation accuracy {:.2}% at epoch {}, model in {}",
//!     report.best_val_accuracy.unwrap_or(0.0),
//!     report.best_epoch,
//!     report.model_path.display()
//! );
//! # Ok(()) }
//! ```

mod names;

pub mod alloc;
pub mod device;
mod error;
pub mod eval;
pub mod gpu;
#[cfg(feature = "hub")]
pub mod hub;
pub mod metrics;
pub mod npy;
pub mod onnx;
pub mod optim;
pub mod pipeline;
#[cfg(feature = "plots")]
pub mod plot;
pub mod predict;
pub mod prelude;
pub mod process;
mod proto;
pub mod schedule;
pub mod settings;
pub mod tensorboard;
pub mod train;

pub use burn_dist as dist;
pub use error::{HearthError, Result};
pub use hearth_datasets as datasets;
/// The precision-aware layers a custom [`train::Net`] computes with in mixed precision.
pub use hearth_kernels as kernels;
pub use hearth_models as models;
