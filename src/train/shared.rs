//! What the training modes beside the Learner's share, below all of them: the collective
//! timeout, the accuracy count of a batch, and the per-worker test hooks. No mode imports a
//! helper from a sibling mode; what two need lives here (or in [`super::epochs`]).

use std::time::Duration;

use burn::prelude::*;

/// Samples of `logits` whose highest score is the class in `targets`.
pub(super) fn hits(logits: &Tensor<2>, targets: &Tensor<1, Int>) -> f64 {
    logits
        .clone()
        .argmax(1)
        .flatten::<1>(0, 1)
        .equal(targets.clone())
        .int()
        .sum()
        .into_scalar::<i64>() as f64
}

/// How long a rank waits for a peer in a collective or a pipeline neighbour
/// (`HEARTH_COLLECTIVE_TIMEOUT`, default 120 s); a peer that dies is reported sooner by the
/// transport.
pub(super) fn collective_timeout() -> Duration {
    burn_dist::rendezvous::env_secs("HEARTH_COLLECTIVE_TIMEOUT").unwrap_or(Duration::from_secs(120))
}

/// A per-worker number from a test or benchmark hook variable `ID:N[,ID:N...]`
/// (`HEARTH_ELASTIC_LEAVE_AT_STEP`: leave gracefully after step N, as SIGTERM would;
/// `HEARTH_ELASTIC_DIE_AT_STEP`: SIGKILL itself inside step N, between the control and the
/// gradient allreduce; `HEARTH_ELASTIC_FREEZE_AT_STEP`: SIGSTOP itself there, a worker cut
/// off; `HEARTH_ELASTIC_THROTTLE`: N ms of extra compute per step, a slow worker;
/// `HEARTH_PS_DELAY_MS`, `HEARTH_PS_DIE_AT_STEP`: the same for parameter-server workers).
pub(super) fn hook(name: &str, id: &str) -> Option<u64> {
    std::env::var(name).ok()?.split(',').find_map(|part| {
        let (who, n) = part.trim().split_once(':')?;
        (who == id).then(|| n.parse().ok()).flatten()
    })
}
