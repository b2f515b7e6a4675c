//! Broadcast from a root along the ring, chunk by chunk: rank `root+1` forwards each chunk to
//! `root+2` as soon as it arrives, so the chain's hops overlap. Exact (no compression).

use super::{Communicator, tag};
use crate::wire::{bytes_to_f32, f32_to_bytes};
use crate::{DistError, Result};

impl Communicator {
    /// Copies `root`'s `buf` into every rank's `buf` (all of the same length).
    pub fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()> {
        let n = self.world();
        if root >= n {
            return Err(DistError::Config(format!(
                "broadcast root {root} is outside a world of {n}"
            )));
        }
        let op = self.next_op();
        if n == 1 {
            return Ok(());
        }
        let r = self.rank();
        let next = (r + 1) % n;
        let prev = (r + n - 1) % n;
        let forward = next != root;
        let chunk = self.chunk_elems;
        let chunks = buf.len().div_ceil(chunk);
        for c in 0..chunks {
            let (a, b) = (c * chunk, ((c + 1) * chunk).min(buf.len()));
            if r != root {
                let bytes = self.recv(prev, tag(op, 0, c), "broadcast")?;
                let v = bytes_to_f32(&bytes, b - a).map_err(|e| DistError::Mismatch {
                    op: "broadcast".into(),
                    reason: format!("rank {prev} sent a chunk that does not fit: {e}"),
                })?;
                buf[a..b].copy_from_slice(&v);
            }
            if r == root || forward {
                self.send(next, tag(op, 0, c), f32_to_bytes(&buf[a..b]))?;
            }
        }
        Ok(())
    }
}
