//! The one error type of burn-dist.

use std::time::Duration;

use crate::wire::WireError;

/// Errors of burn-dist, each naming the rank, operation or setting involved.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// A malformed frame (from a peer or a fuzzer).
    #[error("malformed frame: {0}")]
    Wire(#[from] WireError),
    /// A peer's connection ended or failed; every operation with it fails from then on.
    #[error("rank {rank} failed: {reason}")]
    PeerFailed { rank: usize, reason: String },
    /// An operation did not complete in time.
    #[error("{op} timed out after {after:?} waiting for rank {rank}")]
    Timeout {
        op: String,
        rank: usize,
        after: Duration,
    },
    /// Ranks that never arrived at the rendezvous.
    #[error(
        "rendezvous timed out after {after:?}: rank(s) {missing:?} of {world} never arrived at {coordinator}{}",
        refused_note(.refused)
    )]
    MissingRanks {
        missing: Vec<usize>,
        world: usize,
        coordinator: String,
        after: Duration,
        /// Hellos the coordinator refused meanwhile (a rank outside the world, a rank taken).
        refused: Vec<String>,
    },
    /// A rank number outside the world, a world of 0, or mismatched settings between ranks.
    #[error("invalid setup: {0}")]
    Config(String),
    /// Buffers of different lengths handed to one collective on different ranks, and similar.
    #[error("{op}: {reason}")]
    Mismatch { op: String, reason: String },
    /// Certificates, keys or the job secret.
    #[error("TLS: {0}")]
    Tls(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// A parameter server died or stopped answering; names the shard it held.
    #[error("parameter server rank {rank}, {shard}, failed: {reason}")]
    ServerFailed {
        rank: usize,
        shard: String,
        reason: String,
    },
    /// A QUIC endpoint or connection error.
    #[error("QUIC ({context}): {reason}")]
    Quic { context: String, reason: String },
}

pub type Result<T> = std::result::Result<T, DistError>;

/// The refused hellos of a rendezvous that timed out, for its error.
fn refused_note(refused: &[String]) -> String {
    if refused.is_empty() {
        String::new()
    } else {
        format!("; refused meanwhile: {}", refused.join("; "))
    }
}
