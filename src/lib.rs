//! # Hearth
//!
//! Image models and distributed training on [Burn](https://burn.dev). This crate is the glue and
//! the `hearth` command line; the parts are separate crates re-exported here:
//!
//! - [`models`] (`hearth-models`): torchvision-exact ResNet, VGG and DenseNet, weight import.
//! - [`datasets`] (`hearth-datasets`): image decoding, preprocessing, loaders.
//! - [`dist`] (`burn-dist`): collectives and distributed training over QUIC.
//!
//! ```no_run
//! use hearth::models::{Architecture, HeadConfig, LoadOptions, load_torchvision};
//!
//! # fn main() -> anyhow::Result<()> {
//! let device = hearth::device::select("flex")?;
//! let mut model = Architecture::ResNet18.init(1000, &device)?;
//! load_torchvision(&mut model, "resnet18.pth".as_ref(), &LoadOptions::default())?;
//! let model = model.replace_head(HeadConfig::new(10), &device)?.freeze_backbone();
//! # let _ = model; Ok(()) }
//! ```

pub mod bench;
pub mod device;
mod error;
pub mod loader_bench;
pub mod npy;
pub mod optim;
pub mod plot;
pub mod predict;
pub mod schedule;
pub mod train;

pub use burn_dist as dist;
pub use error::{HearthError, Result};
pub use hearth_datasets as datasets;
pub use hearth_models as models;
