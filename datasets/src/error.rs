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
    #[error("cannot write {path}: {reason}")]
    Write { path: PathBuf, reason: String },
    /// Not a decodable image: corrupt, truncated, empty or another kind of file.
    #[error("cannot decode image {path}: {reason}")]
    Decode { path: PathBuf, reason: String },
    #[error("data set root {path} does not exist or is not a directory")]
    MissingRoot { path: PathBuf },
    #[error("data set {path} has no usable images: {reason}")]
    Empty { path: PathBuf, reason: String },
    #[error("data set {path} has {count} class(es) ({names}); classification needs at least 2")]
    TooFewClasses {
        path: PathBuf,
        count: usize,
        names: String,
    },
    /// Strict mode: bad files are errors. The report lists each with its path.
    #[error("{count} bad file(s) in strict mode:\n{report}")]
    BadFiles { count: usize, report: String },
    /// Most images fail to decode: a data problem, not something to train around.
    #[error(
        "most images fail to decode ({failed} files failed, {decoded} images decoded so far); \
         the first:\n{report}"
    )]
    MostlyBad {
        failed: usize,
        decoded: usize,
        report: String,
    },
    #[error("{path}:{line}: {reason}")]
    Labels {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("invalid transform: {0}")]
    InvalidTransform(String),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A decoding worker thread died (a bug: workers catch every per-file error).
    #[error("loader worker failed: {0}")]
    Worker(String),
}

pub type Result<T> = std::result::Result<T, DataError>;
