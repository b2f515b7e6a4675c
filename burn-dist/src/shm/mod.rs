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

pub mod pipe;
pub mod reduce;
pub mod segment;
pub mod setup;
pub(crate) mod shared;

use std::sync::Arc;
use std::time::Duration;

pub use pipe::Pipes;
pub use reduce::LocalGroup;
pub use segment::{Segment, remove_stale};

use crate::transport::{Inbox, Topology};
use crate::wire::Kind;
use crate::{DistError, Result};

/// Shared-memory settings.
#[derive(Debug, Clone)]
pub struct ShmOptions {
    pub enabled: bool,
    pub ring_bytes: usize,
    /// Each rank's reduction slot in bytes; 0 lets [`ShmOptions::slot_bytes_for`] choose by
    /// the number of ranks on the host.
    pub slot_bytes: usize,
    /// The allreduce as a chain ([`reduce`]): `Some` forces it on or off; `None` lets
    /// [`ShmOptions::chain_for`] choose by the number of ranks on the host.
    pub chain: Option<bool>,
    pub stale: Duration,
    pub max_frame_bytes: usize,
    pub frame_timeout: Duration,
}

impl Default for ShmOptions {
    fn default() -> Self {
        Self {
            enabled: true,
            ring_bytes: 4 << 20,
            slot_bytes: 0,
            chain: None,
            stale: Duration::from_secs(8),
            max_frame_bytes: 256 << 20,
            frame_timeout: Duration::from_secs(120),
        }
    }
}

impl ShmOptions {
    /// The slot size a segment for `ranks` ranks gets: `slot_bytes` when set, else 1 MiB, or
    /// 256 KiB when the ranks outnumber this host's cores. Only the segment's creator calls
    /// it; the others read the size from the segment's header, so the ranks always agree.
    ///
    /// Small pieces stay in cache between the copy in, the reduction and the copy out: 100 MB
    /// over 2 ranks took 10.8 ms with 1 MiB slots, 17 ms with 8 MiB, 32 ms with 64 MiB. With
    /// two ranks per core the two share a cache, and 256 KiB slots took 38.8-39.4 ms for 4
    /// ranks on 2 cores against 1 MiB's 42.5-42.9 (BENCHMARKS.md).
    pub fn slot_bytes_for(&self, ranks: usize) -> usize {
        if self.slot_bytes > 0 {
            return self.slot_bytes;
        }
        if outnumber_cores(ranks) {
            256 << 10
        } else {
            1 << 20
        }
    }

    /// Whether a segment for `ranks` ranks runs its allreduce as a chain: `chain` when set,
    /// else when the ranks outnumber this host's cores. Only the creator calls it and records
    /// the answer in the segment, so the ranks always agree.
    ///
    /// A chain passes each piece from rank to rank without barriers, so a rank that holds a
    /// core works through every piece it can before it sleeps; with more ranks than cores the
    /// two barriers per piece of the other path cost a context switch each.
    pub fn chain_for(&self, ranks: usize) -> bool {
        self.chain.unwrap_or_else(|| outnumber_cores(ranks))
    }
}

/// Whether `ranks` ranks outnumber this host's cores (one core when the count is unknown).
pub(crate) fn outnumber_cores(ranks: usize) -> bool {
    ranks > std::thread::available_parallelism().map_or(1, |c| c.get())
}

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
