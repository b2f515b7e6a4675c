//! Allreduce by host: when some ranks share memory (see [`crate::shm`]), each host reduces in
//! its segment to its lowest rank, those leaders run the ring among themselves (one rank per
//! host on the network), and each leader broadcasts the result within its host. With a single
//! host the whole allreduce happens in shared memory. Chosen automatically from the transport's
//! [`Topology`](crate::transport::Topology); without shared memory the ordinary ring runs.
//!
//! Compression: every rank rounds its contribution to the wire format before the host's
//! reduction, the leaders' ring carries that format, and a single host rounds the sum, so
//! training sees the precision `--compression` asks for whichever path the values take (within
//! a host nothing is saved on bytes). Values never differ between ranks: each host's ranks
//! copy their leader's result.

use std::sync::Arc;

use super::ring::{Phases, ring};
use super::{Communicator, Compression};
use crate::Result;
use crate::transport::group::Group;
use crate::wire::Kind;

/// The tag space of the host leaders' ring (a [`Group`] over the job's transport).
pub const LEADERS_TAG_SPACE: u8 = 254;

impl Communicator {
    /// Runs the allreduce through shared memory when the transport has some; `false` when it
    /// does not (the caller runs the ring).
    pub(crate) fn allreduce_by_host(
        &self,
        buf: &mut [f32],
        compression: Compression,
    ) -> Result<bool> {
        // Other kinds (metrics beside gradients, from another thread) keep to the ring: a
        // segment's slots serve one collective at a time.
        if self.kind != Kind::Collective {
            return Ok(false);
        }
        let Some(topology) = self.transport.topology() else {
            return Ok(false);
        };
        if !topology.shares_memory() {
            return Ok(false);
        }
        self.next_op();
        let leaders = topology.group_leaders();
        let me = self.rank();
        compression.round(buf);
        match &topology.local {
            Some(local) if leaders.len() == 1 => {
                local.reduce(buf, true, self.deadline())?;
                compression.round(buf);
            }
            local => {
                if let Some(l) = local {
                    l.reduce(buf, false, self.deadline())?;
                }
                if leaders.contains(&me) {
                    let across = self.leaders_comm(leaders)?;
                    ring(
                        across,
                        buf,
                        Phases::Both,
                        compression,
                        "allreduce across hosts",
                    )?;
                }
                if let Some(l) = local {
                    l.broadcast(buf, 0, self.deadline())?;
                }
            }
        }
        Ok(true)
    }

    /// This world's shared-memory group when it is the whole world (one host, every rank in
    /// it, local index = rank): the reduce-scatter and all-gather then run in the segment.
    pub(crate) fn whole_world_in_memory(&self) -> Option<Arc<dyn crate::transport::HostGroup>> {
        if self.kind != Kind::Collective {
            return None;
        }
        let topology = self.transport.topology()?;
        let local = topology.local.clone()?;
        let whole = topology.group_leaders().len() == 1
            && local.members().len() == self.world()
            && local.members().iter().enumerate().all(|(i, r)| i == *r);
        whole.then_some(local)
    }

    /// The communicator of the host leaders (made on first use; the same leaders every time,
    /// since a transport's topology never changes).
    fn leaders_comm(&self, leaders: &[usize]) -> Result<&Communicator> {
        if let Some(c) = self.leaders.get() {
            return Ok(c);
        }
        let group = Group::new(self.transport.clone(), leaders.to_vec(), LEADERS_TAG_SPACE)?;
        let comm = Communicator {
            transport: Arc::new(group),
            seq: Default::default(),
            timeout: self.timeout,
            chunk_elems: self.chunk_elems,
            compression: self.compression,
            kind: self.kind,
            leaders: Default::default(),
        };
        Ok(self.leaders.get_or_init(|| Box::new(comm)))
    }
}
