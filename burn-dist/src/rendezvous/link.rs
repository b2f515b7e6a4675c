//! What the rendezvous' sides share: how connections are made ([`Link`], under a deadline and
//! an [`Abort`]) and how a peer's claimed rank is checked against its certificate.

use std::sync::Arc;
use std::time::{Duration, Instant};

use quinn::Connection;
use rustls::pki_types::CertificateDer;

use crate::{DistError, Result};

/// What [`super::connect_epoch_watched`] asks, about four times a second while the rendezvous waits:
/// an error ends the rendezvous with it (an elastic job's member found dead on the old world's
/// links, which the rendezvous would otherwise wait for until it timed out).
pub type Abort = Arc<dyn Fn() -> Option<DistError> + Send + Sync>;

/// How often the rendezvous asks its [`Abort`].
const ABORT_POLL: Duration = Duration::from_millis(250);

/// The peer of `conn` may be rank `claimed`: its certificate names that rank (see
/// [`crate::tls::check_peer_rank`]).
pub(super) fn check_rank(
    conn: &Connection,
    claimed: usize,
    world: usize,
) -> std::result::Result<(), String> {
    let certs = peer_certs(conn);
    crate::tls::check_peer_rank(certs.as_deref(), claimed, world)
}

/// The certificate chain the peer of `conn` authenticated with.
pub(super) fn peer_certs(conn: &Connection) -> Option<Vec<CertificateDer<'static>>> {
    conn.peer_identity()
        .and_then(|id| id.downcast::<Vec<CertificateDer<'static>>>().ok())
        .map(|chain| *chain)
}

/// How the rendezvous makes its connections.
pub(super) struct Link {
    pub(super) deadline: Instant,
    pub(super) timeout: Duration,
    /// Connections per pair of ranks.
    pub(super) lanes: usize,
    /// Rank 0 issues the members' rank certificates (a job formed with a secret, see
    /// [`crate::tls::RankAuthority`]): the members arrive with certificates they made from the
    /// secret, and use the issued ones with each other.
    pub(super) issues: bool,
    /// Asked while the rendezvous waits (see [`Abort`]).
    pub(super) abort: Option<Abort>,
}

/// `fut`, or the first error `abort` gives while it runs.
pub(super) async fn watched<T>(
    abort: Option<Abort>,
    fut: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    let Some(abort) = abort else {
        return fut.await;
    };
    tokio::pin!(fut);
    loop {
        tokio::select! {
            done = &mut fut => return done,
            _ = tokio::time::sleep(ABORT_POLL) => {
                if let Some(e) = abort() {
                    return Err(e);
                }
            }
        }
    }
}

pub(super) fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}
