//! In-memory transport: N ranks as threads of one process, for tests.

use std::sync::Arc;
use std::time::Instant;

use super::{Inbox, Transport, check_peer};
use crate::wire::Kind;
use crate::{DistError, Result};

/// One rank of an in-memory mesh.
pub struct MemoryTransport {
    rank: usize,
    inboxes: Arc<Vec<Inbox>>,
}

impl MemoryTransport {
    /// `world` connected ranks; element `r` is rank `r`.
    pub fn mesh(world: usize) -> Vec<MemoryTransport> {
        let inboxes: Arc<Vec<Inbox>> = Arc::new((0..world).map(|_| Inbox::default()).collect());
        (0..world)
            .map(|rank| MemoryTransport {
                rank,
                inboxes: inboxes.clone(),
            })
            .collect()
    }

    /// Simulates this rank dying: every other rank's operations with it fail.
    pub fn kill(&self, reason: &str) {
        for (r, inbox) in self.inboxes.iter().enumerate() {
            if r != self.rank {
                inbox.fail(self.rank, reason.to_string());
            }
        }
    }
}

impl Transport for MemoryTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.inboxes.len()
    }
    fn send(&self, to: usize, kind: Kind, tag: u64, payload: Vec<u8>) -> Result<()> {
        check_peer(self, to, "send")?;
        if let Some(reason) = self.inboxes[self.rank].failure(to) {
            return Err(DistError::PeerFailed { rank: to, reason });
        }
        self.inboxes[to].deliver(self.rank, kind, tag, payload);
        Ok(())
    }
    fn recv(&self, from: usize, kind: Kind, tag: u64, deadline: Instant) -> Result<Vec<u8>> {
        check_peer(self, from, "recv")?;
        self.inboxes[self.rank].take(from, kind, tag, deadline, "recv")
    }
    fn recv_any(
        &self,
        from: &[usize],
        kind: Kind,
        tag: u64,
        deadline: Instant,
    ) -> Result<(usize, Vec<u8>)> {
        super::check_peers(self, from, "recv_any")?;
        self.inboxes[self.rank].take_any(from, kind, tag, deadline, "recv_any")
    }
    fn accept_losses(&self) {
        self.inboxes[self.rank].accept_losses();
    }
}
