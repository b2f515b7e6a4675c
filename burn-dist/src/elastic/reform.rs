//! Re-forming the world after a membership change, over the links that survived: the new
//! rank 0 (the lowest survivor) announces the next epoch (its number, the coordinator address
//! where it waits, and the old ranks of the members in their new order) to every survivor over
//! the old transport, then every member joins the new world by rendezvous
//! ([`crate::rendezvous::connect_epoch`]), TLS included. A joiner, which has no old link, gets
//! the same announcement another way (the join service, not built yet).

use std::time::Instant;

use crate::transport::Transport;
use crate::wire::{Kind, Reader, Writer};
use crate::{DistError, Result};

/// The next epoch as the new rank 0 announces it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Announcement {
    /// The membership epoch number (stamped on every frame of the new world).
    pub epoch: u32,
    /// Where the new rank 0 waits for the members (`host:port`).
    pub coordinator: String,
    /// The members in their new rank order: an old rank for a survivor, `None` for a joiner.
    pub members: Vec<Option<usize>>,
}

/// The tag of epoch `epoch`'s announcement.
fn tag(epoch: u32) -> u64 {
    0xE1A5_0000_0000_0000 | u64::from(epoch)
}

impl Announcement {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default()
            .u64(u64::from(self.epoch))
            .string(&self.coordinator)
            .u64(self.members.len() as u64);
        for m in &self.members {
            w = w.u64(m.map_or(u64::MAX, |r| r as u64));
        }
        w.bytes
    }

    /// Any malformed announcement is an error, never a panic.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let bad = |e: crate::wire::WireError| DistError::Mismatch {
            op: "epoch announcement".into(),
            reason: e.to_string(),
        };
        let mut r = Reader::new(bytes);
        let epoch = r.u64().map_err(bad)?;
        let coordinator = r.string().map_err(bad)?;
        let n = r.u64().map_err(bad)?;
        if n > 1 << 16 || epoch > u64::from(u32::MAX) {
            return Err(DistError::Mismatch {
                op: "epoch announcement".into(),
                reason: format!("epoch {epoch} with {n} members"),
            });
        }
        let members = (0..n)
            .map(|_| {
                r.u64()
                    .map(|v| (v != u64::MAX).then_some(v as usize))
                    .map_err(bad)
            })
            .collect::<Result<Vec<_>>>()?;
        r.finish().map_err(bad)?;
        Ok(Self {
            epoch: epoch as u32,
            coordinator,
            members,
        })
    }

    /// This process's rank in the new epoch, from its old rank; `None` if it is not a member.
    pub fn rank_of(&self, old_rank: usize) -> Option<usize> {
        self.members.iter().position(|&m| m == Some(old_rank))
    }

    /// Sends the announcement over the old world to every surviving member but this one.
    pub fn announce(&self, old: &dyn Transport) -> Result<()> {
        let to: Vec<usize> = self.members.iter().flatten().copied().collect();
        self.send_to(old, &to)
    }

    /// Sends the announcement over the old world to old ranks `to` (but this one), trying
    /// every one; the first error is returned. An announcement with no members tells them the
    /// job gave up: below the minimum when its coordinator is empty, else the coordinator
    /// field says why (no quorum).
    pub fn send_to(&self, old: &dyn Transport, to: &[usize]) -> Result<()> {
        let bytes = self.encode();
        let mut first = None;
        for &r in to {
            if r != old.rank()
                && let Err(e) = old.send(r, Kind::Control, tag(self.epoch), bytes.clone())
            {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Waits on the old world for epoch `epoch`'s announcement from old rank `from`.
    pub fn receive(
        old: &dyn Transport,
        from: usize,
        epoch: u32,
        deadline: Instant,
    ) -> Result<Self> {
        let a = Self::decode(&old.recv(from, Kind::Control, tag(epoch), deadline)?)?;
        if a.epoch != epoch {
            return Err(DistError::Mismatch {
                op: "epoch announcement".into(),
                reason: format!("expected epoch {epoch}, got {}", a.epoch),
            });
        }
        Ok(a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn announcements_round_trip_and_garbage_is_an_error() {
        let a = Announcement {
            epoch: 3,
            coordinator: "127.0.0.1:4000".into(),
            members: vec![Some(1), Some(2), None],
        };
        assert_eq!(Announcement::decode(&a.encode()).unwrap(), a);
        assert_eq!(a.rank_of(2), Some(1));
        assert_eq!(a.rank_of(0), None);
        let good = a.encode();
        for cut in [0, 7, 9, good.len() - 1] {
            assert!(Announcement::decode(&good[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = good.clone();
        long.push(0);
        assert!(Announcement::decode(&long).is_err());
    }
}
