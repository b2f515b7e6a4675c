//! The ring engine behind reduce-scatter, all-gather and allreduce.
//!
//! `2(n-1)` steps at most. In reduce-scatter step `k` rank `r` sends segment `r-k-1` and
//! receives segment `r-k-2` (adding it in), so after `n-1` steps it holds the full sum of
//! segment `r`. In all-gather step `k` it sends segment `r-k` and receives `r-k-1` (copying).
//! What a rank receives in one step is exactly what it sends in the next, so each chunk is
//! forwarded as soon as it has arrived: the steps overlap chunk by chunk (pipelining).

use super::{Communicator, Compression, tag};
use crate::split::segment;
use crate::{DistError, Result};

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phases {
    ReduceScatter,
    AllGather,
    Both,
}

/// Runs the ring over `buf` split into `n` segments.
pub(crate) fn ring(
    comm: &Communicator,
    buf: &mut [f32],
    phases: Phases,
    compression: Compression,
    op_name: &str,
) -> Result<()> {
    let n = comm.world();
    if n == 1 {
        return Ok(());
    }
    let r = comm.rank();
    let op = comm.next_op();
    let next = (r + 1) % n;
    let prev = (r + n - 1) % n;
    let len = buf.len();
    let seg = |i: isize| {
        let i = i.rem_euclid(n as isize) as usize;
        segment(len, n, i)
    };
    // (segment sent, segment received, reduce?) of each step.
    let mut steps: Vec<(isize, isize, bool)> = Vec::new();
    let ri = r as isize;
    if phases != Phases::AllGather {
        for k in 0..(n as isize - 1) {
            steps.push((ri - k - 1, ri - k - 2, true));
        }
    }
    if phases != Phases::ReduceScatter {
        for k in 0..(n as isize - 1) {
            steps.push((ri - k, ri - k - 1, false));
        }
    }
    let chunk = comm.chunk_elems;
    let chunks = |(a, b): (usize, usize)| (b - a).div_ceil(chunk);
    let chunk_range =
        |(a, b): (usize, usize), c: usize| (a + c * chunk, (a + (c + 1) * chunk).min(b));

    // The values a rank owns in full are rounded to the wire format before they travel, so every
    // rank ends with the same numbers.
    let first_gather = steps.iter().position(|s| !s.2);
    let send_chunk = |buf: &mut [f32], step: usize, c: usize| -> Result<()> {
        let s = seg(steps[step].0);
        let (a, b) = chunk_range(s, c);
        if Some(step) == first_gather {
            compression.round(&mut buf[a..b]);
        }
        comm.send(next, tag(op, step, c), compression.encode(&buf[a..b]))
    };
    for c in 0..chunks(seg(steps[0].0)) {
        send_chunk(buf, 0, c)?;
    }
    for step in 0..steps.len() {
        let (_, recv_seg, reduce) = steps[step];
        let s = seg(recv_seg);
        for c in 0..chunks(s) {
            // Decoded straight from the transport's buffers.
            let bytes = comm.recv_payload(prev, tag(op, step, c), op_name)?;
            let (a, b) = chunk_range(s, c);
            let decoded = if reduce {
                compression.decode_payload_with(&bytes, &mut buf[a..b], |o, w| *o += w)
            } else {
                compression.decode_payload_with(&bytes, &mut buf[a..b], |o, w| *o = w)
            };
            decoded.map_err(|e| DistError::Mismatch {
                op: op_name.to_string(),
                reason: format!(
                    "rank {prev} sent a chunk that does not fit ({e}); do all ranks pass buffers \
                     of the same length ({len} here)?"
                ),
            })?;
            if step + 1 < steps.len() {
                send_chunk(buf, step + 1, c)?;
            }
        }
    }
    Ok(())
}
