//! The sharded state moved from one world to the next after a change of membership: which new
//! rank holds each old rank's segments, then each bucket put together from them.

use super::*;

impl ZeroOptimizer {
    /// Takes the state of the world before a change of membership: every rank of the new world
    /// (`comm`) calls it on a fresh optimizer of the same tensors, with its shard of the old
    /// world (`old`, the version all agreed on) if it was a member of it, `None` if it joins.
    /// The old world's segments come from their owners where they are still members, from
    /// the rank holding their replica ([`Self::with_replica`]) where not; a segment with
    /// neither is an error on every rank, naming the old ranks whose state is lost. The state
    /// moves one bucket of one slot at a time (each old holder writes its segments into a
    /// buffer of zeros, a sum over the ranks puts the bucket together, each rank keeps its new
    /// segments), so no rank holds more of it than its shards and one bucket. Rank 0 must be
    /// an old member.
    pub fn reshard_from(&mut self, comm: &Communicator, old: Option<&ZeroOptimizer>) -> Result<()> {
        // Rank 0 says the old world's size, whether it kept replicas and the update count;
        // an old world of 0 says rank 0 holds no state.
        let mut head = [0f32; 4];
        if comm.rank() == 0
            && let Some(o) = old
        {
            head = [
                o.world as f32,
                if o.replica.is_some() { 1.0 } else { 0.0 },
                (o.updates >> 24) as f32,
                (o.updates & 0xFF_FFFF) as f32,
            ];
        }
        comm.broadcast(&mut head, 0)?;
        let old_world = head[0] as usize;
        if old_world == 0 {
            return Err(state_mismatch(
                RESHARD,
                "rank 0 of the new world holds no state of the old one".into(),
            ));
        }
        let updates = ((head[2] as u64) << 24) | head[3] as u64;
        let replicas = head[1] != 0.0 && old_world >= 2;
        let holders = self.old_holders(comm, old, old_world, updates, replicas)?;
        self.updates = updates;
        self.applied = updates;
        self.state = vec![Vec::new(); self.buckets.len()];
        if let Some(r) = self.replica.as_mut() {
            r.state = vec![Vec::new(); self.buckets.len()];
        }
        if updates == 0 {
            // Nothing stepped yet: no state anywhere.
            return Ok(());
        }
        for slot in 0..self.whole.state_slots().len() {
            for b in 0..self.buckets.len() {
                self.gather_bucket(comm, old, &holders, slot, b)?;
            }
        }
        Ok(())
    }

    /// Which new rank holds each old rank's segments: the old rank itself where it is still a
    /// member, else the rank holding its replica (the one before it) if `replicas` were kept.
    /// An error on every rank where a member's shard is of another version or model, or where
    /// nobody holds an old rank's segments (naming them).
    fn old_holders(
        &self,
        comm: &Communicator,
        old: Option<&ZeroOptimizer>,
        old_world: usize,
        updates: u64,
        replicas: bool,
    ) -> Result<Vec<usize>> {
        // Who of the old world is here (and whether anyone's shard does not fit this one).
        let mut have = vec![0f32; old_world + 1];
        if let Some(o) = old {
            if o.world != old_world || o.rank >= old_world || o.updates != updates {
                have[old_world] = 1.0;
            } else if o.tensors != self.tensors || o.buckets.len() != self.buckets.len() {
                have[old_world] = 2.0;
            } else {
                have[o.rank] = 1.0;
            }
        }
        comm.allreduce(&mut have, ReduceOp::Sum)?;
        if have[old_world] != 0.0 {
            return Err(state_mismatch(
                RESHARD,
                format!(
                    "the old members' shards disagree (world of {old_world}, {updates} updates, \
                     the same tensors: a member holds another version of the state, or another \
                     model)"
                ),
            ));
        }
        let holder = |s: usize| {
            let before = (s + old_world - 1) % old_world;
            if have[s] > 0.0 {
                Some(s)
            } else if replicas && have[before] > 0.0 {
                Some(before)
            } else {
                None
            }
        };
        let lost: Vec<usize> = (0..old_world).filter(|&s| holder(s).is_none()).collect();
        if !lost.is_empty() {
            return Err(state_mismatch(
                RESHARD,
                format!(
                    "the optimizer state of old rank(s) {lost:?} of {old_world} is lost: {}",
                    if replicas {
                        "each went together with the rank holding its replica (the one before it)"
                    } else {
                        "the shards were kept without replicas"
                    }
                ),
            ));
        }
        Ok((0..old_world).filter_map(holder).collect())
    }

    /// Bucket `b` of state slot `slot` put together from the old holders' segments (each
    /// writes its own into zeros, a sum over the ranks joins them); each rank keeps its new
    /// segment, and its replica's.
    fn gather_bucket(
        &mut self,
        comm: &Communicator,
        old: Option<&ZeroOptimizer>,
        holders: &[usize],
        slot: usize,
        b: usize,
    ) -> Result<()> {
        let range = self.buckets[b].range.clone();
        let mut buf = vec![0f32; range.len()];
        let mut short = 0f32;
        if let Some(o) = old {
            for (s, _) in holders.iter().enumerate().filter(|&(_, &h)| h == o.rank) {
                let seg = o.segment_in(b, s, holders.len());
                let n = seg.len();
                let held = if s == o.rank {
                    Some(&o.state[b])
                } else {
                    o.replica
                        .as_ref()
                        .filter(|r| r.of == s)
                        .map(|r| &r.state[b])
                };
                match held.and_then(|v| v.get(slot * n..(slot + 1) * n)) {
                    Some(v) => {
                        buf[seg.start - range.start..seg.end - range.start].copy_from_slice(v)
                    }
                    None => short = 1.0,
                }
            }
        }
        buf.push(short);
        comm.allreduce(&mut buf, ReduceOp::Sum)?;
        if buf.pop() != Some(0.0) {
            return Err(state_mismatch(
                RESHARD,
                format!(
                    "an old member lacks its segment of bucket {b}'s {}",
                    self.whole.state_slots()[slot]
                ),
            ));
        }
        let mine = self.segment(b, self.rank);
        self.state[b].extend_from_slice(&buf[mine.start - range.start..mine.end - range.start]);
        if let Some(of) = self.replica.as_ref().map(|r| r.of) {
            let seg = self.segment(b, of);
            if let Some(r) = self.replica.as_mut() {
                r.state[b].extend_from_slice(&buf[seg.start - range.start..seg.end - range.start]);
            }
        }
        Ok(())
    }
}
