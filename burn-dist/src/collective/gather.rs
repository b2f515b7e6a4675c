//! All-gather and reduce-scatter: the two halves of the ring allreduce on their own.

use super::ring::{Phases, ring};
use super::{Communicator, Compression, ReduceOp};
use crate::split::segment;
use crate::{DistError, Result};

impl Communicator {
    /// Concatenates every rank's `mine` (all of the same length) in rank order, on every rank.
    /// Exact: no compression.
    pub fn all_gather(&self, mine: &[f32]) -> Result<Vec<f32>> {
        let n = self.world();
        let m = mine.len();
        let mut out = vec![0f32; m * n];
        let (a, b) = segment(m * n, n, self.rank());
        if b - a != m {
            return Err(DistError::Mismatch {
                op: "all_gather".into(),
                reason: format!("segment arithmetic: {} vs {m}", b - a),
            });
        }
        out[a..b].copy_from_slice(mine);
        ring(
            self,
            &mut out,
            Phases::AllGather,
            Compression::None,
            "all_gather",
        )?;
        Ok(out)
    }

    /// Reduces `buf` across ranks and returns this rank's segment of the result: segment `r` of
    /// `n` near-equal segments (see [`Communicator::segment_of`]).
    pub fn reduce_scatter(&self, mut buf: Vec<f32>, op: ReduceOp) -> Result<Vec<f32>> {
        ring(
            self,
            &mut buf,
            Phases::ReduceScatter,
            self.compression,
            "reduce_scatter",
        )?;
        let (a, b) = segment(buf.len(), self.world(), self.rank());
        let mut mine = buf[a..b].to_vec();
        if op == ReduceOp::Mean && self.world() > 1 {
            let inv = 1.0 / self.world() as f32;
            mine.iter_mut().for_each(|x| *x *= inv);
        }
        Ok(mine)
    }

    /// `[start, end)` of rank `rank`'s segment of a `len`-value buffer in
    /// [`Communicator::reduce_scatter`]: `rank * len / n .. (rank + 1) * len / n`.
    pub fn segment_of(&self, len: usize, rank: usize) -> (usize, usize) {
        segment(len, self.world(), rank)
    }
}
