//! Which samples an epoch visits in which order, and which of them each rank takes: the one
//! definition the image loader and any other data (a user's own examples) share.

use crate::rng::SplitMix64;

/// The order of `n` samples in `epoch`: a shuffle seeded by `(seed, epoch)`, the same on every
/// rank and in every process (or `0..n` without `shuffle`).
pub fn epoch_order(n: usize, seed: u64, epoch: u64, shuffle: bool) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    if shuffle {
        SplitMix64::new(seed ^ epoch.wrapping_mul(0xA24B_AED4_963E_E407)).shuffle(&mut order);
    }
    order
}

/// `rank`'s samples of `order` dealt over `world` ranks in batches of `batch` each: with
/// `drop_last`, only whole rounds of `world` batches; else with `pad`, the last round padded
/// from the start of `order` so that every rank gets as many samples.
pub fn shard_of(
    order: &[usize],
    batch: usize,
    rank: usize,
    world: usize,
    drop_last: bool,
    pad: bool,
) -> Vec<usize> {
    let world = world.max(1);
    let mut rest: Vec<usize> = order.to_vec();
    if drop_last {
        let keep = rest.len() / (world * batch) * (world * batch);
        rest.truncate(keep);
    } else if pad && !rest.is_empty() {
        let padded = rest.len().div_ceil(world) * world;
        let mut i = 0;
        while rest.len() < padded {
            rest.push(rest[i % rest.len().max(1)]);
            i += 1;
        }
    }
    rest.into_iter().skip(rank).step_by(world).collect()
}
