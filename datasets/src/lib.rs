//! # hearth-datasets
//!
//! Image data for Hearth: image folders and multi-label CSVs ([`folder`]), seeded augmentation
//! ([`transform`]), a streaming loader that holds only the batches in flight and shards by rank
//! ([`loader`]), an on-disk decode cache ([`cache`]) and a learnable synthetic data set
//! ([`synth`]).
//!
//! ```no_run
//! use burn::prelude::*;
//! use hearth_datasets::{ImageSet, Loader, LoaderConfig, Pipeline};
//!
//! # fn main() -> Result<(), hearth_datasets::DataError> {
//! let set = ImageSet::from_folder("data/train".as_ref())?;
//! if let Some(warning) = set.problems.summary() {
//!     eprintln!("{warning}");
//! }
//! let loader = Loader::new(
//!     set,
//!     Pipeline::train(224),
//!     LoaderConfig::new(32).with_workers(2).with_seed(7).with_shard(0, 1),
//! )?;
//! for batch in loader.epoch(0, &Device::flex()) {
//!     let batch = batch?;
//!     assert_eq!(batch.images.dims()[1..], [3, 224, 224]);
//! }
//! # Ok(()) }
//! ```

pub mod autoaugment;
pub mod cache;
mod error;
pub mod folder;
pub mod loader;
pub mod mix;
pub mod order;
pub mod preprocess;
pub mod rng;
pub mod synth;
pub mod transform;

pub use autoaugment::Policy as AutoAugment;
pub use cache::DiskCache;
pub use error::{DataError, Result};
pub use folder::{
    ImageSet, Problem, ProblemKind, Problems, Sample, Target, has_train_val, train_val,
};
pub use loader::{Batch, BatchStream, Loader, LoaderConfig};
pub use mix::{Mix, Mixing};
pub use transform::{Augmentation, Pipeline, Transform};

/// The largest image side Hearth prepares (a pipeline's output, a synthetic set, a bench's
/// input): one 4096 x 4096 image is 201 MB of f32 values. A larger side is refused by name
/// instead of ending the process in a failed allocation.
pub const MAX_IMAGE_SIZE: u32 = 4096;
