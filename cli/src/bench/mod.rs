//! The benches' helpers: [`model`] times a model's inference or training steps, [`dist`] sweeps
//! allreduce sizes among local ranks and measures the host's memory bandwidth, [`loader`]
//! streams training batches and measures images/s and peak memory.

pub mod dist;
pub mod loader;
pub mod model;

pub use model::{BenchMode, BenchReport, ModelBench, cpu_peak_gflops, measured_fma_gflops};
