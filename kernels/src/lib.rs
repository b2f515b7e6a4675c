//! Faster CPU paths for the convolutions of image models on Burn 0.22 Flex, with their
//! autodiff backward passes.
//!
//! Why: on Burn Flex a ResNet-50 training step spent half its time in convolution weight
//! gradients (docs/benchmarks/cpu-models.md, "CPU profile"). Burn's generic `conv2d_weight_backward` runs a
//! convolution with batch and channels swapped, which Flex executes as thin matrix products
//! at 4-65 GFLOP/s. Two paths replace it while training on the CPU:
//!
//! - [`Path::Gemm`] ([`ext`]): a backend-extension op with its own autodiff backward. The
//!   weight gradient is always im2col and one GEMM over images x output pixels
//!   ([`weight_grad`]); the forward and the input gradient are ours ([`conv`]) on the shapes
//!   where they measured faster than Flex's, Flex's elsewhere. Every convolution with one
//!   group on a Flex device, training or not.
//! - [`Path::Pointwise`]: a strided 1x1 convolution while training, as a strided slice and
//!   `W · X` per image, written in tensor ops so autodiff derives both gradients as GEMMs
//!   (also plain 1x1 on NdArray).
//!
//! [`conv2d`] picks the path ([`fast_path`]): only on CPU devices, and never with
//! `HEARTH_FAST_KERNELS=0`, so the reference path stays one variable away.
//!
//! Beside the convolutions: batch norm (+ ReLU) in few passes while training and in one for
//! inference ([`norm`], [`batch_norm`]), max pooling, its backward finding the argmax
//! again ([`pool`]), and linear layers' products: one row on all threads for inference
//! ([`gemv`]), the rest written once into their result ([`product`]).
//!
//! No dependency on any model: the weight gradient could go upstream as Flex's
//! `conv2d_weight_backward` (see the crate README).

mod base;
pub mod batch_norm;
pub mod cast;
pub mod cat;
#[cfg(feature = "cube")]
pub mod col2im;
pub mod conv;
#[cfg(feature = "cube")]
pub mod cube;
#[cfg(feature = "cube")]
pub mod cube_base;
mod epilogue;
pub mod ext;
#[cfg(feature = "cube")]
pub mod fused_reduce;
pub mod gemv;
pub mod infer;
mod input_grad;
pub mod keyed;
mod layer;
pub mod norm;
#[cfg(feature = "cube")]
pub mod per_image;
pub mod pool;
pub mod precision;
pub mod product;
#[cfg(feature = "cube")]
pub mod reduce_rules;
pub mod select;
mod shape;
pub mod warm;
pub mod weight_grad;
pub mod winograd;

pub use base::{
    enabled, file_bytes, is_cpu, is_cube, is_flex, join_global_pool, selects_gpu_kernels,
    winograd_enabled,
};
pub use cast::cast;
pub use layer::{Path, conv2d, fast_path, pointwise, pointwise_strided};
pub use precision::{linear, low_precision};
