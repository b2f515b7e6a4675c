use std::path::PathBuf;

/// Everything that can go wrong in `hearth-models`.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The model name is not one of [`crate::Architecture::ALL`].
    #[error("unknown model '{name}'; known models: {known}")]
    UnknownModel { name: String, known: String },

    /// A configuration that cannot build a network (zero classes, empty stages, ...).
    #[error("invalid {model} configuration: {reason}")]
    InvalidConfig { model: &'static str, reason: String },

    /// The input tensor cannot go through this network.
    #[error("{model} expects input [batch, 3, H, W] with H, W >= {min_size}; got {shape:?}")]
    BadInput {
        model: String,
        min_size: usize,
        shape: Vec<usize>,
    },

    /// The weights file does not exist or cannot be read.
    #[error("cannot read weights file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The file extension does not say which format to read.
    #[error(
        "cannot tell the format of weights file {path}: expected .pth/.pt (PyTorch), \
         .safetensors or .bpk (Hearth/burnpack)"
    )]
    UnknownFormat { path: PathBuf },

    /// The file exists but is not a readable weights file of that format
    /// (truncated, corrupt, or something else entirely).
    #[error("{path} is not a valid {format} weights file: {reason}")]
    Corrupt {
        path: PathBuf,
        format: &'static str,
        reason: String,
    },

    /// Tensors the model needs are not in the file.
    #[error(
        "{path}: {count} parameter(s) of {model} missing from the file, first: {}{hint}",
        first.join(", ")
    )]
    MissingKeys {
        path: PathBuf,
        model: String,
        count: usize,
        first: Vec<String>,
        hint: String,
    },

    /// Tensors in the file that the model does not have.
    #[error(
        "{path}: {count} tensor(s) in the file are not parameters of {model}, first: {}{hint}",
        first.join(", ")
    )]
    UnexpectedKeys {
        path: PathBuf,
        model: String,
        count: usize,
        first: Vec<String>,
        hint: String,
    },

    /// A tensor has the wrong shape for the parameter it should fill.
    #[error("{path}: shape mismatch for '{key}': model expects {expected:?}, file has {found:?}")]
    ShapeMismatch {
        path: PathBuf,
        key: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },

    /// Any other per-tensor problem reported while applying weights (dtype, decoding).
    #[error("{path}: cannot load '{key}': {reason}")]
    TensorLoad {
        path: PathBuf,
        key: String,
        reason: String,
    },

    /// Writing a model file failed.
    #[error("cannot save model to {path}: {reason}")]
    Save { path: PathBuf, reason: String },
}

pub type Result<T> = std::result::Result<T, ModelError>;
