//! The one place a transport's receiving side is written.
//!
//! Every transport that moves bytes (memory, QUIC, shared memory, and the routed pair of the
//! last two) delivers each message for this rank into one [`Inbox`]. What differs between them
//! is only how a message leaves. An [`Endpoint`] says that much, and [`Transport`] follows from
//! it: the peer checks, refusing to send to a peer known to have failed, every receive, loss
//! tolerance and failure reports are the inbox's, here once instead of once per transport.
//!
//! [`crate::transport::group::Group`], which renames ranks over another transport, is the one
//! [`Transport`] written by hand.

use std::time::Instant;

use super::{Inbox, Payload, Topology, Transport, check_peer, check_peers};
use crate::wire::Kind;
use crate::{DistError, Result};

/// A transport's own part: who it is, how a message leaves, and the inbox messages arrive in.
///
/// Its methods share names with [`Transport`]'s; code holding a concrete transport uses
/// [`Transport`] (import this trait only where implementing it).
pub trait Endpoint: Send + Sync {
    /// This process's rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world(&self) -> usize;
    /// Sends to `to`, already checked to be another rank of the world and not known to have
    /// failed (see [`Transport::send`]).
    fn transmit(&self, to: usize, kind: Kind, tag: u64, payload: Vec<u8>) -> Result<()>;
    /// Where every message for this rank lands, whichever way it came.
    fn inbox(&self) -> &Inbox;
    /// See [`Transport::topology`].
    fn topology(&self) -> Option<&Topology> {
        None
    }
}

impl<E: Endpoint> Transport for E {
    fn rank(&self) -> usize {
        Endpoint::rank(self)
    }

    fn world(&self) -> usize {
        Endpoint::world(self)
    }

    fn send(&self, to: usize, kind: Kind, tag: u64, payload: Vec<u8>) -> Result<()> {
        check_peer(self, to, "send")?;
        if let Some(reason) = self.inbox().failure(to) {
            return Err(DistError::PeerFailed { rank: to, reason });
        }
        self.transmit(to, kind, tag, payload)
    }

    fn recv(&self, from: usize, kind: Kind, tag: u64, deadline: Instant) -> Result<Vec<u8>> {
        check_peer(self, from, "recv")?;
        self.inbox().take(from, kind, tag, deadline, "recv")
    }

    fn recv_payload(
        &self,
        from: usize,
        kind: Kind,
        tag: u64,
        deadline: Instant,
    ) -> Result<Payload> {
        check_peer(self, from, "recv")?;
        self.inbox().take_payload(from, kind, tag, deadline, "recv")
    }

    fn recv_any(
        &self,
        from: &[usize],
        kind: Kind,
        tag: u64,
        deadline: Instant,
    ) -> Result<(usize, Vec<u8>)> {
        check_peers(self, from, "recv_any")?;
        self.inbox().take_any(from, kind, tag, deadline, "recv_any")
    }

    fn accept_losses(&self) {
        self.inbox().accept_losses();
    }

    fn lost(&self, peer: usize) -> Option<String> {
        self.inbox().failure(peer)
    }

    fn topology(&self) -> Option<&Topology> {
        Endpoint::topology(self)
    }
}
