//! A subgroup of a job's ranks seen as a world of its own: the collectives run unchanged on
//! it, so the replicas of one pipeline stage average that stage's gradients with the ordinary
//! allreduce while other groups do the same beside them (2D parallelism: P stages x D
//! replicas).
//!
//! Messages between two members travel on the parent transport under the members' job ranks,
//! with the group's tag space in the tag's top byte: a collective of the group never meets one
//! of the whole job (tag space 0) or of another group that shares a pair of ranks, as long as
//! the two use different tag spaces and tags below 2^56.

use std::sync::Arc;
use std::time::Instant;

use super::{Payload, Transport};
use crate::wire::Kind;
use crate::{DistError, Result};

pub struct Group {
    parent: Arc<dyn Transport>,
    /// Job ranks of the members, in group-rank order.
    members: Vec<usize>,
    me: usize,
    tag_space: u64,
}

/// Tag bits left to the group's users; the top byte is the tag space.
const SPACE_SHIFT: u32 = 56;

impl Group {
    /// The group of `members` (job ranks, in the order that gives their group ranks) in tag
    /// space `tag_space` (1-255; 0 is the whole job's). This process must be a member; members
    /// must be distinct ranks of the parent's world.
    pub fn new(parent: Arc<dyn Transport>, members: Vec<usize>, tag_space: u8) -> Result<Self> {
        if tag_space == 0 {
            return Err(DistError::Config(
                "tag space 0 belongs to the whole job; give a group 1-255".into(),
            ));
        }
        let rank = parent.rank();
        let me = members.iter().position(|&r| r == rank).ok_or_else(|| {
            DistError::Config(format!(
                "rank {rank} is not a member of the group {members:?}"
            ))
        })?;
        for (i, &r) in members.iter().enumerate() {
            if r >= parent.world() {
                return Err(DistError::Config(format!(
                    "group {members:?}: rank {r} is outside a world of {}",
                    parent.world()
                )));
            }
            if members[..i].contains(&r) {
                return Err(DistError::Config(format!(
                    "group {members:?} names rank {r} twice"
                )));
            }
        }
        Ok(Self {
            parent,
            members,
            me,
            tag_space: u64::from(tag_space) << SPACE_SHIFT,
        })
    }

    /// The job rank of group rank `r`.
    pub fn job_rank(&self, r: usize) -> Result<usize> {
        self.members.get(r).copied().ok_or_else(|| {
            DistError::Config(format!(
                "group rank {r} is outside a group of {}",
                self.members.len()
            ))
        })
    }

    pub fn members(&self) -> &[usize] {
        &self.members
    }

    fn tag(&self, tag: u64) -> Result<u64> {
        if tag >> SPACE_SHIFT != 0 {
            return Err(DistError::Config(format!(
                "tag {tag:#x} of a group message uses the top byte, which holds the tag space"
            )));
        }
        Ok(tag | self.tag_space)
    }
}

impl Transport for Group {
    fn rank(&self) -> usize {
        self.me
    }

    fn world(&self) -> usize {
        self.members.len()
    }

    fn send(&self, to: usize, kind: Kind, tag: u64, payload: Vec<u8>) -> Result<()> {
        self.parent
            .send(self.job_rank(to)?, kind, self.tag(tag)?, payload)
    }

    fn recv(&self, from: usize, kind: Kind, tag: u64, deadline: Instant) -> Result<Vec<u8>> {
        self.parent
            .recv(self.job_rank(from)?, kind, self.tag(tag)?, deadline)
    }

    fn recv_payload(
        &self,
        from: usize,
        kind: Kind,
        tag: u64,
        deadline: Instant,
    ) -> Result<Payload> {
        self.parent
            .recv_payload(self.job_rank(from)?, kind, self.tag(tag)?, deadline)
    }

    fn recv_any(
        &self,
        from: &[usize],
        kind: Kind,
        tag: u64,
        deadline: Instant,
    ) -> Result<(usize, Vec<u8>)> {
        let ranks = from
            .iter()
            .map(|&r| self.job_rank(r))
            .collect::<Result<Vec<_>>>()?;
        let (job, payload) = self
            .parent
            .recv_any(&ranks, kind, self.tag(tag)?, deadline)?;
        let r = self.members.iter().position(|&m| m == job).ok_or_else(|| {
            DistError::Config(format!("rank {job} answered but is not in the group"))
        })?;
        Ok((r, payload))
    }

    fn accept_losses(&self) {
        self.parent.accept_losses();
    }
}

/// The ranks of a P x D grid (`stages` x `replicas`, `world = stages * replicas`): replica d's
/// pipeline is ranks `d*P .. d*P+P`, so consecutive ranks (one host's, under a local launcher)
/// form one pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grid {
    pub stages: usize,
    pub replicas: usize,
}

impl Grid {
    /// The grid of `stages` stages over `world` ranks; `world` must be a multiple of `stages`.
    pub fn new(stages: usize, world: usize) -> Result<Self> {
        if stages == 0 || world == 0 || !world.is_multiple_of(stages) {
            return Err(DistError::Config(format!(
                "{world} ranks cannot hold whole pipelines of {stages} stages (the number of \
                 ranks must be a multiple of the number of stages)"
            )));
        }
        Ok(Self {
            stages,
            replicas: world / stages,
        })
    }

    /// (stage, replica) of a job rank.
    pub fn place(&self, rank: usize) -> (usize, usize) {
        (rank % self.stages, rank / self.stages)
    }

    /// The ranks of replica `replica`'s pipeline, stage 0 first.
    pub fn pipeline(&self, replica: usize) -> Vec<usize> {
        (0..self.stages)
            .map(|s| replica * self.stages + s)
            .collect()
    }

    /// The ranks holding stage `stage`, replica 0 first.
    pub fn stage_replicas(&self, stage: usize) -> Vec<usize> {
        (0..self.replicas)
            .map(|d| d * self.stages + stage)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::memory::MemoryTransport;

    #[test]
    fn grid_places_every_rank_once() {
        let g = Grid::new(2, 6).unwrap();
        assert_eq!(g.replicas, 3);
        assert_eq!(g.pipeline(1), vec![2, 3]);
        assert_eq!(g.stage_replicas(1), vec![1, 3, 5]);
        for r in 0..6 {
            let (s, d) = g.place(r);
            assert_eq!(g.pipeline(d)[s], r);
            assert_eq!(g.stage_replicas(s)[d], r);
        }
        assert!(Grid::new(4, 6).is_err());
        assert!(Grid::new(0, 6).is_err());
    }

    #[test]
    fn a_group_maps_its_ranks_onto_the_job() {
        let ts = MemoryTransport::mesh(4);
        let parent: Vec<Arc<dyn Transport>> = ts
            .into_iter()
            .map(|t| Arc::new(t) as Arc<dyn Transport>)
            .collect();
        let a = Group::new(parent[1].clone(), vec![1, 3], 1).unwrap();
        let b = Group::new(parent[3].clone(), vec![1, 3], 1).unwrap();
        assert_eq!((a.rank(), a.world(), b.rank()), (0, 2, 1));
        // The same kind and tag on the whole job and in the group stay apart.
        parent[1].send(3, Kind::Collective, 7, vec![1]).unwrap();
        a.send(1, Kind::Collective, 7, vec![42]).unwrap();
        let deadline = Instant::now() + std::time::Duration::from_secs(5);
        assert_eq!(b.recv(0, Kind::Collective, 7, deadline).unwrap(), vec![42]);
        assert_eq!(
            parent[3].recv(1, Kind::Collective, 7, deadline).unwrap(),
            vec![1]
        );
        assert!(Group::new(parent[0].clone(), vec![1, 3], 1).is_err());
        assert!(Group::new(parent[1].clone(), vec![1, 1], 1).is_err());
        assert!(Group::new(parent[1].clone(), vec![1, 9], 1).is_err());
        assert!(Group::new(parent[1].clone(), vec![1, 3], 0).is_err());
        assert!(a.send(2, Kind::Collective, 0, vec![]).is_err());
        assert!(a.send(1, Kind::Collective, 1 << 60, vec![]).is_err());
    }
}
