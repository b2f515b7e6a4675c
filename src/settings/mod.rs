//! What a run is made of, below every module that reads it: the named choices
//! (`choices.rs`) and each distributed mode's options (`modes.rs`). Nothing here knows how a run
//! trains, so the device, the pipeline helpers, the benches and every training mode can name
//! these types without depending on each other (`hearth::train` re-exports them).

mod choices;
pub mod flags;
mod modes;

pub use choices::{
    ADAG_SCRATCH_MOMENTUM, AugmentPreset, DEFAULT_MOMENTUM, FinetuneBn, Monitor, OptimizerKind,
    PipelineBalance, Precision,
};
pub use modes::{
    Balance, EASGD_PEAK_ALPHA, ElasticOptions, PipelineOptions, PsOptions, PsServers, TrainingMode,
};
