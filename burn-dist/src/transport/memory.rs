//! In-memory transport: N ranks as threads of one process, for tests.

use super::Inbox;
use crate::Result;
use crate::wire::Kind;
use std::sync::Arc;

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

impl super::Endpoint for MemoryTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.inboxes.len()
    }
    fn transmit(&self, to: usize, kind: Kind, tag: u64, payload: Vec<u8>) -> Result<()> {
        self.inboxes[to].deliver(self.rank, kind, tag, payload);
        Ok(())
    }
    fn inbox(&self) -> &Inbox {
        &self.inboxes[self.rank]
    }
}
