use std::path::PathBuf;

/// Everything that can go wrong in `hearth-datasets`.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Not a decodable image: corrupt, truncated, empty or another kind of file.
    #[error("cannot decode image {path}: {reason}")]
    Decode { path: PathBuf, reason: String },
    #[error("invalid transform: {0}")]
    InvalidTransform(String),
}

pub type Result<T> = std::result::Result<T, DataError>;
