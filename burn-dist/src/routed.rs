//! A job rank's transport: QUIC to every peer, and shared memory to the peers of its own host
//! where the host allows it, chosen per peer.
//!
//! The two transports below it stay apart: [`QuicTransport`] knows nothing of shared memory and
//! [`crate::shm`] nothing of QUIC. This layer, built by the rendezvous once the QUIC links
//! exist, runs the shared-memory negotiation over QUIC ([`crate::shm::setup::negotiate`]),
//! starts the pipes on the same inbox QUIC delivers into (so one receive waits on both, and a
//! server's `recv_any` sees workers of every host), hands the local peers over so their QUIC
//! connection closing no longer counts as their leaving, and tells the collectives the
//! [`Topology`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::Result;
use crate::shm::{LocalGroup, Pipes, ShmOptions};
use crate::transport::quic::QuicTransport;
use crate::transport::{Endpoint, HostGroup, Inbox, Topology};
use crate::wire::Kind;

/// QUIC and shared memory side by side, each message sent the way its peer is reached.
pub struct RoutedTransport {
    quic: QuicTransport,
    /// Pipes to the ranks of this host (none when the host has no other rank of the job, or
    /// its segment could not be made).
    pipes: Option<Pipes>,
    topology: Topology,
}

impl RoutedTransport {
    /// Finds the ranks that share this rank's host (over `quic`, which must reach every rank)
    /// and moves their traffic to shared memory. Every rank of the job calls it at the same
    /// point, right after the rendezvous; a host where shared memory cannot be set up stays on
    /// QUIC, with a warning.
    pub fn over(quic: QuicTransport, options: &ShmOptions, deadline: Instant) -> Result<Self> {
        let negotiated = crate::shm::setup::negotiate(&quic, options, deadline)?;
        let (pipes, local) = match negotiated.segment {
            Some((seg, me, members)) => {
                let pipes = Pipes::start(
                    seg.clone(),
                    me,
                    members.clone(),
                    quic.shared_inbox(),
                    options.clone(),
                )?;
                quic.hand_over(&members);
                let group: Arc<dyn HostGroup> =
                    Arc::new(LocalGroup::new(seg, me, members, options.stale));
                (Some(pipes), Some(group))
            }
            None => (None, None),
        };
        Ok(Self {
            quic,
            pipes,
            topology: Topology::new(negotiated.leaders, local),
        })
    }

    /// The QUIC links underneath (every peer has one, local peers included).
    pub fn quic(&self) -> &QuicTransport {
        &self.quic
    }

    /// Says this rank has left on the pipes (their writes are done when `send` returns), then
    /// waits up to `timeout` for queued QUIC sends and closes every connection.
    pub fn shutdown(&self, timeout: Duration) {
        if let Some(p) = &self.pipes {
            p.close();
        }
        self.quic.shutdown(timeout);
    }

    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.quic.local_addr()
    }

    /// QUIC connections to `peer` (its lanes; 0 for this rank).
    pub fn connections(&self, peer: usize) -> usize {
        self.quic.connections(peer)
    }
}

impl Drop for RoutedTransport {
    fn drop(&mut self) {
        // The pipes first: a local peer learns this rank left from them, not from QUIC.
        if let Some(p) = &self.pipes {
            p.close();
        }
    }
}

impl Endpoint for RoutedTransport {
    fn rank(&self) -> usize {
        self.quic.rank()
    }

    fn world(&self) -> usize {
        self.quic.world()
    }

    fn transmit(&self, to: usize, kind: Kind, tag: u64, payload: Vec<u8>) -> Result<()> {
        match self
            .pipes
            .as_ref()
            .and_then(|p| Some((p, p.local_index(to)?)))
        {
            Some((pipes, local)) => pipes.send(local, kind, tag, &payload),
            None => Endpoint::transmit(&self.quic, to, kind, tag, payload),
        }
    }

    /// QUIC's: the pipes deliver into it too, so one receive waits on both.
    fn inbox(&self) -> &Inbox {
        Endpoint::inbox(&self.quic)
    }

    fn topology(&self) -> Option<&Topology> {
        Some(&self.topology)
    }
}
