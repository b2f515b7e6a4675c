//! # hearth-datasets
//!
//! Image data for Hearth: decoding and torchvision's preprocessing today; image folders,
//! augmentation, a streaming sharded loader and synthetic data sets are being built (issue 3).
//!
//! ```no_run
//! use hearth_datasets::preprocess::{eval_preprocess, load_rgb};
//! # fn main() -> Result<(), hearth_datasets::DataError> {
//! let img = load_rgb("cat.jpg".as_ref())?;
//! let chw = eval_preprocess(&img, 256, 224)?; // 3 * 224 * 224 normalised floats
//! assert_eq!(chw.len(), 3 * 224 * 224);
//! # Ok(()) }
//! ```

mod error;
pub mod preprocess;

pub use error::{DataError, Result};
