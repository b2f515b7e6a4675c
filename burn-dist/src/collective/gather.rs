//! All-gather and reduce-scatter: the two halves of the ring allreduce on their own.

use super::ring::{Phases, ring};
use super::{Communicator, Compression, ReduceOp, tag};
use crate::split::segment;
use crate::wire::{bytes_to_f32, f32_to_bytes};
use crate::{DistError, Result};

/// `bounds` cut a vector among `n` ranks: `n + 1` non-decreasing values from 0.
fn check_bounds(op: &str, root: usize, n: usize, bounds: &[usize]) -> Result<()> {
    if root >= n {
        return Err(DistError::Config(format!(
            "{op} root {root} is outside a world of {n}"
        )));
    }
    if bounds.len() != n + 1 || bounds[0] != 0 || bounds.windows(2).any(|w| w[0] > w[1]) {
        return Err(DistError::Config(format!(
            "{op}: {bounds:?} does not cut a vector among {n} ranks"
        )));
    }
    Ok(())
}

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
        if let Some(local) = self.whole_world_in_memory() {
            // One host: through the shared segment, no pipes.
            self.next_op();
            local.all_gather(&mut out, self.deadline())?;
            return Ok(out);
        }
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
    ///
    /// With every rank on one host it runs in the shared segment (each rank sums its segment
    /// from the others' copies); with several hosts sharing memory the whole buffer goes
    /// through [`Communicator::allreduce`]'s hierarchical path and this rank keeps its segment;
    /// elsewhere the ring's first half sends each rank `(n-1)/n` of the buffer.
    pub fn reduce_scatter(&self, mut buf: Vec<f32>, op: ReduceOp) -> Result<Vec<f32>> {
        if let Some(local) = self.whole_world_in_memory() {
            self.next_op();
            self.compression.round(&mut buf);
            local.reduce_scatter(&mut buf, self.deadline())?;
            let (a, b) = segment(buf.len(), self.world(), self.rank());
            let mut mine = buf[a..b].to_vec();
            drop(buf);
            self.compression.round(&mut mine);
            if op == ReduceOp::Mean && self.world() > 1 {
                let inv = 1.0 / self.world() as f32;
                mine.iter_mut().for_each(|x| *x *= inv);
            }
            return Ok(mine);
        }
        if !self.allreduce_by_host(&mut buf, self.compression)? {
            ring(
                self,
                &mut buf,
                Phases::ReduceScatter,
                self.compression,
                "reduce_scatter",
            )?;
        }
        let (a, b) = segment(buf.len(), self.world(), self.rank());
        let mut mine = buf[a..b].to_vec();
        if op == ReduceOp::Mean && self.world() > 1 {
            let inv = 1.0 / self.world() as f32;
            mine.iter_mut().for_each(|x| *x *= inv);
        }
        Ok(mine)
    }

    /// Every rank's `mine` on `root`, concatenated in rank order (`None` on the other ranks):
    /// rank `r` holds values `bounds[r]..bounds[r + 1]` of the whole (every rank passes the same
    /// `bounds`, `world + 1` of them). Point to point, chunked; exact. Only `root` ever holds
    /// the whole vector.
    pub fn gather_to(
        &self,
        root: usize,
        mine: &[f32],
        bounds: &[usize],
    ) -> Result<Option<Vec<f32>>> {
        let (n, r) = (self.world(), self.rank());
        check_bounds("gather", root, n, bounds)?;
        let op = self.next_op();
        if mine.len() != bounds[r + 1] - bounds[r] {
            return Err(DistError::Mismatch {
                op: "gather".into(),
                reason: format!(
                    "rank {r} holds {} values where its part is {}",
                    mine.len(),
                    bounds[r + 1] - bounds[r]
                ),
            });
        }
        let chunk = self.chunk_elems;
        if r != root {
            for (c, part) in mine.chunks(chunk).enumerate() {
                self.send(root, tag(op, r, c), f32_to_bytes(part))?;
            }
            return Ok(None);
        }
        let mut whole = vec![0f32; bounds[n]];
        for from in 0..n {
            let part = &mut whole[bounds[from]..bounds[from + 1]];
            if from == r {
                part.copy_from_slice(mine);
                continue;
            }
            for (c, out) in part.chunks_mut(chunk).enumerate() {
                let bytes = self.recv(from, tag(op, from, c), "gather")?;
                let v = bytes_to_f32(&bytes, out.len()).map_err(|e| DistError::Mismatch {
                    op: "gather".into(),
                    reason: format!("rank {from} sent a chunk that does not fit: {e}"),
                })?;
                out.copy_from_slice(&v);
            }
        }
        Ok(Some(whole))
    }

    /// The inverse of [`Self::gather_to`]: `root`'s `whole` (ignored elsewhere) cut by
    /// `bounds`, each rank receiving its part.
    pub fn scatter_from(
        &self,
        root: usize,
        whole: Option<&[f32]>,
        bounds: &[usize],
    ) -> Result<Vec<f32>> {
        let (n, r) = (self.world(), self.rank());
        check_bounds("scatter", root, n, bounds)?;
        let op = self.next_op();
        let chunk = self.chunk_elems;
        if r == root {
            let whole = whole.ok_or_else(|| {
                DistError::Config("scatter: the root has no values to send".into())
            })?;
            if whole.len() != bounds[n] {
                return Err(DistError::Mismatch {
                    op: "scatter".into(),
                    reason: format!(
                        "{} values to cut by bounds ending at {}",
                        whole.len(),
                        bounds[n]
                    ),
                });
            }
            for to in (0..n).filter(|t| *t != r) {
                for (c, part) in whole[bounds[to]..bounds[to + 1]].chunks(chunk).enumerate() {
                    self.send(to, tag(op, to, c), f32_to_bytes(part))?;
                }
            }
            return Ok(whole[bounds[r]..bounds[r + 1]].to_vec());
        }
        let mut mine = vec![0f32; bounds[r + 1] - bounds[r]];
        for (c, out) in mine.chunks_mut(chunk).enumerate() {
            let bytes = self.recv(root, tag(op, r, c), "scatter")?;
            let v = bytes_to_f32(&bytes, out.len()).map_err(|e| DistError::Mismatch {
                op: "scatter".into(),
                reason: format!("rank {root} sent a chunk that does not fit: {e}"),
            })?;
            out.copy_from_slice(&v);
        }
        Ok(mine)
    }

    /// Each rank's `mine` to the rank before it (rank `r` sends to `r - 1`, rank 0 to the
    /// last) and what the rank after it sent, `len` values: a replica of the next rank's
    /// segment (the elastic sharded optimizer's). Point to point, chunked; exact.
    pub fn shift_down(&self, mine: &[f32], len: usize) -> Result<Vec<f32>> {
        let (n, r) = (self.world(), self.rank());
        let op = self.next_op();
        if n == 1 {
            return Ok(mine.to_vec());
        }
        let (to, from) = ((r + n - 1) % n, (r + 1) % n);
        let chunk = self.chunk_elems;
        let chunks = mine.len().div_ceil(chunk).max(1);
        for c in 0..chunks {
            let part = &mine[(c * chunk).min(mine.len())..((c + 1) * chunk).min(mine.len())];
            self.send(to, tag(op, r, c), f32_to_bytes(part))?;
        }
        let mut out = vec![0f32; len];
        let expect = len.div_ceil(chunk).max(1);
        for c in 0..expect {
            let (lo, hi) = ((c * chunk).min(len), ((c + 1) * chunk).min(len));
            let bytes = self.recv(from, tag(op, from, c), "shift")?;
            let v = bytes_to_f32(&bytes, hi - lo).map_err(|e| DistError::Mismatch {
                op: "shift".into(),
                reason: format!("rank {from} sent a chunk that does not fit: {e}"),
            })?;
            out[lo..hi].copy_from_slice(&v);
        }
        Ok(out)
    }

    /// `[start, end)` of rank `rank`'s segment of a `len`-value buffer in
    /// [`Communicator::reduce_scatter`]: `rank * len / n .. (rank + 1) * len / n`.
    pub fn segment_of(&self, len: usize, rank: usize) -> (usize, usize) {
        segment(len, self.world(), rank)
    }
}
