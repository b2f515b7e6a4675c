//! The overlapped exchange against one reduction of everything, on in-memory ranks.
use std::time::Duration;

use super::*;
use crate::Compression;

/// Runs `f(rank, comm)` on `world` ranks as threads (collectives time out after
/// `timeout`), each result within the collective tests' deadline.
fn on_ranks<T: Send + 'static>(
    world: usize,
    timeout: Duration,
    f: impl Fn(usize, Arc<Communicator>) -> T + Send + Sync + 'static,
) -> Vec<T> {
    crate::collective::tests::on_ranks(world, 1 << 16, Compression::None, move |c| {
        let c = c.with_timeout(timeout);
        f(c.rank(), Arc::new(c))
    })
}

const SIZES: [usize; 7] = [5, 3, 7, 0, 2, 30, 9];

/// Rank `r`'s tensor `i`: small integers, so every order of summation is exact.
fn tensor(r: usize, i: usize) -> Vec<f32> {
    (0..SIZES[i])
        .map(|j| ((r * 7 + i * 3 + j) % 11) as f32)
        .collect()
}

#[test]
fn handed_over_in_any_rhythm_the_tensors_come_back_as_one_reduction_of_them_all() {
    for world in [1usize, 2, 3] {
        for bucket_bytes in [4usize, 40, 1 << 20] {
            let got = on_ranks(world, Duration::from_secs(20), move |r, comm| {
                let x = OverlappedExchange::start(comm, bucket_bytes, ReduceOp::Sum).unwrap();
                // Each rank its own rhythm: all at once, one by one with pauses, in pairs.
                let all: Vec<Vec<f32>> = (0..SIZES.len()).map(|i| tensor(r, i)).collect();
                match r % 3 {
                    0 => x.submit(all),
                    1 => {
                        for t in all {
                            std::thread::sleep(Duration::from_millis(2));
                            x.submit(vec![t]);
                        }
                    }
                    _ => {
                        for pair in all.chunks(2) {
                            x.submit(pair.to_vec());
                        }
                    }
                }
                x.finish().unwrap()
            });
            let want: Vec<Vec<f32>> = (0..SIZES.len())
                .map(|i| {
                    (0..SIZES[i])
                        .map(|j| (0..world).map(|r| tensor(r, i)[j]).sum())
                        .collect()
                })
                .collect();
            for g in &got {
                assert_eq!(g, &want, "world {world}, buckets of {bucket_bytes} B");
            }
        }
    }
}

#[test]
fn buckets_close_with_the_tensor_that_fills_them_the_first_one_small() {
    // Buckets of 10 values: each closes with the tensor that brings it to 10 or more.
    let mut c = BucketCutter::new(40);
    let closes: Vec<bool> = SIZES.iter().map(|&n| c.add(n)).collect();
    assert_eq!(
        closes,
        [false, false, true, false, false, true, false],
        "[5, 3, 7] [0, 2, 30] [9]"
    );
    // The first bucket is at most FIRST_BUCKET_BYTES, the later ones the size asked for.
    let mut c = BucketCutter::new(100 * FIRST_BUCKET_BYTES);
    let quarter = FIRST_BUCKET_BYTES / 16;
    let closes: Vec<bool> = (0..6).map(|_| c.add(quarter)).collect();
    assert_eq!(closes, [false, false, false, true, false, false]);
}

#[test]
fn a_failed_bucket_is_an_error_at_finish_on_every_rank_and_nothing_hangs() {
    // Rank 1 hands over a tensor of another length than rank 0's: the bucket's reduction
    // fails (or times out) on both, and each finish says so.
    let got = on_ranks(2, Duration::from_secs(2), |r, comm| {
        let x = OverlappedExchange::start(comm, 1 << 20, ReduceOp::Sum).unwrap();
        x.submit(vec![vec![1.0; 4 + r]]);
        x.finish().map(|_| ())
    });
    for (r, g) in got.iter().enumerate() {
        assert!(g.is_err(), "rank {r}: {g:?}");
    }
}
