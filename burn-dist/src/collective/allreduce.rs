//! Ring allreduce: reduce-scatter then all-gather, chunked and pipelined. Each rank sends and
//! receives `2(n-1)/n` of the buffer, the bandwidth-optimal amount. Ranks that share memory
//! reduce in it instead ([`super::hierarchical`]).

use super::ring::{Phases, ring};
use super::{Communicator, ReduceOp};
use crate::Result;

impl Communicator {
    /// Reduces `buf` across all ranks in place; every rank ends with the same values.
    pub fn allreduce(&self, buf: &mut [f32], op: ReduceOp) -> Result<()> {
        if !self.allreduce_by_host(buf)? {
            ring(self, buf, Phases::Both, self.compression, "allreduce")?;
        }
        if op == ReduceOp::Mean && self.world() > 1 {
            let inv = 1.0 / self.world() as f32;
            buf.iter_mut().for_each(|x| *x *= inv);
        }
        Ok(())
    }
}
