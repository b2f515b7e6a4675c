use std::path::PathBuf;

/// Errors of the `hearth` crate (the glue above models, datasets and burn-dist).
#[derive(Debug, thiserror::Error)]
pub enum HearthError {
    #[error(transparent)]
    Model(#[from] hearth_models::ModelError),
    #[error(transparent)]
    Data(#[from] hearth_datasets::DataError),

    #[error("unknown device '{name}'; this build offers: {choices}")]
    UnknownDevice { name: String, choices: String },
    #[error(
        "device '{name}' is not compiled into this build (it offers: {choices}); \
         build with `--features {feature}` to use it"
    )]
    DeviceNotBuilt {
        name: String,
        feature: &'static str,
        choices: String,
    },
    #[error("device '{name}' is not available on this machine: {reason}")]
    DeviceUnavailable { name: String, reason: String },

    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "cannot download {url}: {reason}; fetch it by hand (curl -L -o {path} {url}) and run \
         again, or give the file itself as the weights"
    )]
    Download {
        url: String,
        path: PathBuf,
        reason: String,
    },
    #[error("{path} is not a usable .npy file: {reason}")]
    Npy { path: PathBuf, reason: String },
    #[error("{path}: line {line} is not an autotune decision (JSON): {reason}")]
    AutotuneLog {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("kernel bundle {path}: {reason}")]
    KernelBundle { path: PathBuf, reason: String },
    #[error("training failed: {0}")]
    Training(String),
    #[error(
        "Burn's default device is {default}, not the run's ({run}): burn-optim and burn-train \
         build loaded optimizer state on Burn's default device; set BURN_DEVICE={run} or call \
         hearth::device::pin_burn_default at the start of main"
    )]
    BurnDefaultDevice { run: String, default: String },
    #[error("unusable checkpoint {0}")]
    Checkpoint(String),
    #[error(
        "the training loss became NaN or infinite at epoch {epoch}, step {step}; \
         lower `optim.lr`, add `optim.warmup_epochs` or check the data"
    )]
    NanLoss { epoch: usize, step: usize },
    #[error("cannot write plot {path}: {reason}")]
    Plot { path: PathBuf, reason: String },
    #[error(transparent)]
    Dist(#[from] burn_dist::DistError),
    /// An elastic worker left the job gracefully (SIGTERM); not a failure: exit 0.
    /// An elastic worker that lost the majority of its world (no quorum), or whose membership
    /// epoch the run directory's fence has passed: it stops and writes nothing.
    #[error("cut off from the elastic job: {0}")]
    CutOff(String),
    #[error("{id} left the elastic job gracefully after step {step}")]
    LeftJob { id: String, step: u64 },
}

pub type Result<T> = std::result::Result<T, HearthError>;
