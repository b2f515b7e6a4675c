//! Shared memory between the ranks of one host.
//!
//! Ranks that share a host talk through a segment in `/dev/shm` instead of QUIC: framed
//! messages through byte rings behind the [`Transport`](crate::Transport) trait (an
//! [`Endpoint`](crate::transport::Endpoint)) ([`pipe`]), and allreduce computed in place in the segment ([`reduce`]). No byte is encrypted
//! or split into datagrams, and each rank reduces its `1/n` of the buffer where it lies. A
//! caller that fills buffers the host's ranks all map (`shared`, through
//! `Communicator::reduce_buffer`) skips the segment's slots altogether: each rank sums its
//! `1/n` of every rank's buffer and writes the sum into each.
//!
//! How ranks find out ([`setup::negotiate`], run by the rendezvous once the QUIC links exist):
//! every rank tells every other one its host identity (boot id and network namespace, never
//! launcher variables); the lowest rank of each host creates a segment with owner-only
//! permissions and sends its name and a random nonce over the job's authenticated QUIC
//! connections; the others map it and check the nonce; once all have, the creator removes the
//! file, so a process outside the job can no longer open it and a killed job leaves nothing
//! behind. A host whose segment cannot be made (no `/dev/shm`, too small, `HEARTH_SHM=0`) stays
//! on QUIC, with a warning. Every rank then learns which ranks share a segment ([`Topology`]),
//! which chooses between a ring, an in-place allreduce, and a hierarchical one.
//!
//! Settings: `HEARTH_SHM=0` (off), `HEARTH_SHM_RING_MB` (each pipe, default 4),
//! `HEARTH_SHM_SLOT_MB` or `HEARTH_SHM_SLOT_KB` (each rank's reduction slot; default 1 MiB,
//! 256 KiB when the host's ranks outnumber its cores), `HEARTH_SHM_CHAIN` (1 or 0: the
//! allreduce as a chain or not; by default a chain when the host's ranks outnumber its cores),
//! `HEARTH_SHM_STALE` (seconds
//! without a heartbeat before a rank in another pid namespace counts as dead, default 8).

mod options;
pub mod pipe;
pub mod reduce;
pub mod segment;
pub mod setup;
pub(crate) mod shared;

use std::sync::Arc;

pub use options::ShmOptions;
pub use pipe::Pipes;
pub use reduce::LocalGroup;
pub use segment::{Segment, remove_stale};

use crate::transport::{Inbox, Topology};
use crate::wire::Kind;
use crate::{DistError, Result};

/// A world of ranks that all share one segment: the shared-memory transport alone (tests; a job
/// on several hosts routes per peer between QUIC and [`Pipes`] in [`crate::routed`]).
pub struct ShmTransport {
    rank: usize,
    inbox: Arc<Inbox>,
    pipes: Pipes,
    topology: Topology,
}

impl ShmTransport {
    /// `world` ranks in this process on one new segment (element `r` is rank `r`); the file is
    /// removed before this returns.
    pub fn group(world: usize, options: &ShmOptions) -> Result<Vec<ShmTransport>> {
        let seg = Arc::new(Segment::create(
            world,
            options.ring_bytes,
            options.slot_bytes_for(world),
        )?);
        seg.set_chain(options.chain_for(world));
        let mut segs = vec![seg.clone()];
        for _ in 1..world {
            segs.push(Arc::new(Segment::attach(&seg.name(), seg.nonce(), world)?));
        }
        seg.unlink()?;
        segs.into_iter()
            .enumerate()
            .map(|(r, s)| {
                s.register(r);
                Self::on(s, r, (0..world).collect(), options)
            })
            .collect()
    }

    /// Rank `me` (local index) of `members` on a mapped segment.
    pub fn on(
        seg: Arc<Segment>,
        me: usize,
        members: Vec<usize>,
        options: &ShmOptions,
    ) -> Result<Self> {
        let inbox = Arc::new(Inbox::default());
        let pipes = Pipes::start(
            seg.clone(),
            me,
            members.clone(),
            inbox.clone(),
            options.clone(),
        )?;
        let world = members.len();
        let local = LocalGroup::new(seg, me, members.clone(), options.stale);
        Ok(ShmTransport {
            rank: members[me],
            inbox,
            pipes,
            topology: Topology::new(vec![members[0]; world], Some(Arc::new(local))),
        })
    }

    /// Leaves the group as a finished rank does.
    pub fn close(&self) {
        self.pipes.close();
    }
}

impl crate::transport::Endpoint for ShmTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.topology.leaders.len()
    }

    fn transmit(&self, to: usize, kind: Kind, tag: u64, payload: Vec<u8>) -> Result<()> {
        let local = self
            .pipes
            .local_index(to)
            .ok_or_else(|| DistError::PeerFailed {
                rank: to,
                reason: "not on this segment".into(),
            })?;
        self.pipes.send(local, kind, tag, &payload)
    }

    fn inbox(&self) -> &Inbox {
        &self.inbox
    }

    fn topology(&self) -> Option<&Topology> {
        Some(&self.topology)
    }
}

#[cfg(test)]
mod tests;
