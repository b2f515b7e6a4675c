//! Ring allreduce: reduce-scatter then all-gather, chunked and pipelined. Each rank sends and
//! receives `2(n-1)/n` of the buffer, the bandwidth-optimal amount. Ranks that share memory
//! reduce in it instead ([`super::hierarchical`]).

use super::ring::{Phases, ring};
use super::{Communicator, Compression, ReduceOp};
use crate::Result;

impl Communicator {
    /// Reduces `buf` across all ranks in place; every rank ends with the same values. Values
    /// travel in this communicator's [`Compression`].
    pub fn allreduce(&self, buf: &mut [f32], op: ReduceOp) -> Result<()> {
        self.allreduce_with(buf, op, self.compression)
    }

    /// [`Self::allreduce`] in the wire format `compression` (exact counts and sums beside
    /// compressed gradients on one communicator; every rank must pass the same).
    pub fn allreduce_with(
        &self,
        buf: &mut [f32],
        op: ReduceOp,
        compression: Compression,
    ) -> Result<()> {
        if !self.allreduce_by_host(buf, compression)? {
            ring(self, buf, Phases::Both, compression, "allreduce")?;
        }
        if op == ReduceOp::Mean && self.world() > 1 {
            let inv = 1.0 / self.world() as f32;
            buf.iter_mut().for_each(|x| *x *= inv);
        }
        Ok(())
    }
}
