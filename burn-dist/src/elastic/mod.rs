//! Elastic data parallelism (issue 12, started): the global batch stays fixed while the workers
//! change, so each worker's share of it follows the membership.
//!
//! Built so far: the shares themselves ([`shares`]: even with the remainder spread, or
//! proportional to each worker's measured throughput so that a slow CPU worker and a fast GPU
//! worker finish their steps together), the gradient average weighted by each worker's sample
//! count ([`crate::ddp::allreduce_grads_weighted`]), and, in hearth-datasets, the per-step
//! slicing of an epoch's order that keeps "no sample skipped, none seen twice" across changes
//! (`Loader::step_slices`), and the membership protocol's core without its I/O
//! ([`membership`]: epochs, joins at step boundaries, the lowest survivor as the next rank 0,
//! minimum/maximum workers with a rejoin timeout, a blacklist for failing hosts), and
//! [`broadcast_bytes`] for sending the committed state (module and optimizer records) to a new
//! epoch's members. `burn-dist/tests/elastic.rs` runs the whole cycle in memory: a worker killed
//! inside an allreduce, the survivors abandoning the step and rolling back to their last
//! commit, a new epoch, a joiner receiving the state, and the result equal to one process on
//! the same global batches. A collective is not atomic: when a loss is announced, one survivor
//! may have finished the step another abandons, so their last commits can differ by a step;
//! every new epoch therefore starts from its rank 0's commit, sent to all members, which makes
//! every member's state identical again. Over QUIC ([`reform`]): the lowest survivor announces the
//! next epoch over the links that survived (`Transport::accept_losses` lets them carry it), and
//! the members form the new world by rendezvous stamped with the epoch; joiners reach the
//! coordinator through the members' [`join`] services. The training loop that drives all this
//! (`hearth train --elastic`) lives in hearth's `src/train/elastic/`.

pub mod join;
pub mod membership;
pub mod reform;

use crate::collective::Communicator;
use crate::{DistError, Result};

/// Rank 0's `bytes` on every rank (the committed training state sent to the members of a new
/// epoch: module and optimizer records, step, data position). Other ranks pass anything (it is
/// replaced). The length travels first; the bytes go as `f32` bit patterns, exactly. No rank
/// takes more than `limit` bytes (what the state can hold, by the caller's model): a longer
/// announcement is an error naming both, before anything is allocated for it.
pub fn broadcast_bytes(comm: &Communicator, bytes: Vec<u8>, limit: usize) -> Result<Vec<u8>> {
    if comm.world() == 1 {
        return Ok(bytes);
    }
    let too_many = |n: u64| {
        DistError::Config(format!(
            "rank 0 announced {n} bytes of state, more than the {limit} this rank takes for it"
        ))
    };
    // The length as two exact 24-bit halves (f32 holds integers below 2^24 exactly).
    let n = bytes.len() as u64;
    if comm.rank() == 0 && (n >= 1 << 48 || n > limit as u64) {
        return Err(too_many(n));
    }
    let mut len = [(n >> 24) as f32, (n & 0xFF_FFFF) as f32];
    comm.broadcast(&mut len, 0)?;
    // Whatever arrived: two halves, each a whole number below 2^24, or an error.
    let half = |x: f32| {
        (x.is_finite() && x >= 0.0 && x < (1u32 << 24) as f32 && x.fract() == 0.0)
            .then_some(x as u64)
    };
    let (Some(hi), Some(lo)) = (half(len[0]), half(len[1])) else {
        return Err(DistError::Config(format!(
            "rank 0 announced a malformed state length ({}, {})",
            len[0], len[1]
        )));
    };
    let n = hi << 24 | lo;
    if n > limit as u64 {
        return Err(too_many(n));
    }
    let n = n as usize;
    let mut words: Vec<f32> = if comm.rank() == 0 {
        bytes
            .chunks(4)
            .map(|c| {
                let mut w = [0u8; 4];
                w[..c.len()].copy_from_slice(c);
                f32::from_bits(u32::from_le_bytes(w))
            })
            .collect()
    } else {
        vec![0.0; n.div_ceil(4)]
    };
    comm.broadcast(&mut words, 0)?;
    let mut out: Vec<u8> = words
        .iter()
        .flat_map(|w| w.to_bits().to_le_bytes())
        .collect();
    out.truncate(n);
    Ok(out)
}

/// How a global batch of `global` samples is divided between workers of the given `weights`
/// (1.0 each for an even split, or samples per second measured on each): the largest-remainder
/// apportionment of `global` in proportion to the weights: the shares add up to `global`
/// exactly and differ from the exact proportion by less than one sample, except that every
/// worker gets at least one (a worker with nothing to do would still hold up the step).
pub fn shares(global: usize, weights: &[f64]) -> Result<Vec<usize>> {
    let n = weights.len();
    if n == 0 {
        return Err(DistError::Config(
            "no worker to share the batch with".into(),
        ));
    }
    if global < n {
        return Err(DistError::Config(format!(
            "a global batch of {global} cannot give each of {n} workers a sample"
        )));
    }
    if let Some(w) = weights.iter().find(|w| !(w.is_finite() && **w > 0.0)) {
        return Err(DistError::Config(format!(
            "worker weight {w} must be positive and finite"
        )));
    }
    let total: f64 = weights.iter().sum();
    let exact: Vec<f64> = weights.iter().map(|w| global as f64 * w / total).collect();
    let mut out: Vec<usize> = exact.iter().map(|e| (e.floor() as usize).max(1)).collect();
    // Too many (a slow worker lifted to one sample): take from the largest shares.
    while out.iter().sum::<usize>() > global {
        let i = (0..n)
            .max_by_key(|&i| (out[i], usize::MAX - i))
            .unwrap_or(0);
        out[i] -= 1;
    }
    // Too few: the remainder to the largest fractional parts (ties: the lower rank).
    let mut left = global - out.iter().sum::<usize>();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| {
        let fa = exact[a] - exact[a].floor();
        let fb = exact[b] - exact[b].floor();
        fb.partial_cmp(&fa)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.cmp(&b))
    });
    for &i in order.iter().cycle() {
        if left == 0 {
            break;
        }
        out[i] += 1;
        left -= 1;
    }
    Ok(out)
}

/// Where each worker's share starts within a step's slice of the epoch order.
pub fn offsets(shares: &[usize]) -> Vec<usize> {
    shares
        .iter()
        .scan(0, |at, &s| {
            let start = *at;
            *at += s;
            Some(start)
        })
        .collect()
}

/// The samples a step takes: the next `min(global, n - at)` positions of the epoch's order,
/// from position `at` of `n`.
pub fn step_len(n: usize, at: usize, global: usize) -> usize {
    n.saturating_sub(at).min(global.max(1))
}

/// The positions in the epoch's order (of `n` samples) that worker `rank` of the workers with
/// `weights` takes in the step starting at position `at`: its [`shares`] of the step's samples,
/// in rank order. Only when an epoch's last step has fewer samples than there are workers is
/// anything padded: each worker then takes one sample, the step's samples repeated in turn.
/// Hence, while the workers change only between steps, every sample of an epoch is taken once
/// and only once apart from that padding.
pub fn step_positions(
    n: usize,
    at: usize,
    global: usize,
    weights: &[f64],
    rank: usize,
) -> Result<Vec<usize>> {
    let r = step_len(n, at, global);
    if r == 0 || rank >= weights.len() {
        return Err(DistError::Config(format!(
            "no step at position {at} of {n}, or worker {rank} of {}",
            weights.len()
        )));
    }
    if r < weights.len() {
        return Ok(vec![at + rank % r]);
    }
    let s = shares(r, weights)?;
    let start = at + offsets(&s)[rank];
    Ok((start..start + s[rank]).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_cover_an_epoch_once_across_changes_of_world_and_weights() {
        let n = 103;
        let mut seen = vec![0usize; n];
        let mut at = 0;
        let worlds: [&[f64]; 4] = [&[1.0; 3], &[1.0; 2], &[4.0, 1.0, 1.0, 2.0], &[1.0; 5]];
        let mut step = 0;
        while at < n {
            let w = worlds[step % worlds.len()];
            let len = step_len(n, at, 16);
            for rank in 0..w.len() {
                for p in step_positions(n, at, 16, w, rank).unwrap() {
                    assert!((at..at + len).contains(&p));
                    seen[p] += 1;
                }
            }
            at += len;
            step += 1;
        }
        assert!(seen.iter().all(|&c| c == 1), "{seen:?}");
        // A tail shorter than the world is padded, one sample each.
        let tail: Vec<Vec<usize>> = (0..4)
            .map(|r| step_positions(10, 8, 4, &[1.0; 4], r).unwrap())
            .collect();
        assert_eq!(tail, vec![vec![8], vec![9], vec![8], vec![9]]);
        assert!(step_positions(10, 10, 4, &[1.0], 0).is_err());
    }

    #[test]
    fn even_shares_spread_the_remainder_over_the_first_workers() {
        assert_eq!(shares(32, &[1.0; 4]).unwrap(), vec![8, 8, 8, 8]);
        assert_eq!(shares(10, &[1.0; 4]).unwrap(), vec![3, 3, 2, 2]);
        assert_eq!(shares(3, &[1.0; 3]).unwrap(), vec![1, 1, 1]);
        assert_eq!(offsets(&[3, 3, 2, 2]), vec![0, 3, 6, 8]);
    }

    #[test]
    fn throughput_shares_follow_the_measured_speeds_and_add_up() {
        // A GPU worker 7 times as fast as a CPU worker.
        let s = shares(64, &[700.0, 100.0]).unwrap();
        assert_eq!(s.iter().sum::<usize>(), 64);
        assert_eq!(s, vec![56, 8]);
        // Every worker keeps one sample, however slow.
        let s = shares(16, &[1000.0, 1.0, 1.0]).unwrap();
        assert_eq!(s.iter().sum::<usize>(), 16);
        assert!(s[1] >= 1 && s[2] >= 1, "{s:?}");
        for global in 14..60 {
            let w = [3.0, 1.0, 2.5, 0.5];
            let s = shares(global, &w).unwrap();
            assert_eq!(s.iter().sum::<usize>(), global);
            for (i, &x) in s.iter().enumerate() {
                let exact = global as f64 * w[i] / 7.0;
                assert!((x as f64 - exact).abs() < 1.0, "{global}: {s:?}");
            }
        }
    }

    #[test]
    fn impossible_shares_are_errors() {
        assert!(shares(2, &[1.0; 3]).is_err());
        assert!(shares(8, &[]).is_err());
        assert!(shares(8, &[1.0, 0.0]).is_err());
        assert!(shares(8, &[1.0, f64::NAN]).is_err());
    }
}
