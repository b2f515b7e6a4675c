//! The gradient exchange overlapped with the backward pass: gradients are handed over as the
//! backward pass produces them (the last layers' first), packed into buckets and each bucket
//! reduced on a thread of its own while the backward pass goes on, as PyTorch DDP and Horovod
//! do. [`crate::collective::cost::StepCost::step_s`] models what that is worth.
//!
//! The buckets are cut by the tensors' sizes alone, with [`BucketPlan`]'s rule (a bucket closes
//! when the next tensor would take it past the bucket size), never by when tensors arrive: so
//! every rank cuts the same buckets and calls the same collectives in the same order, however
//! its backward pass is timed. The result equals [`BucketPlan`]'s packing of the whole list
//! reduced at once.
//!
//! Not yet used by a training loop: Hearth's data-parallel step still exchanges after the whole
//! backward pass (issue 30).
//!
//! ```
//! use std::sync::Arc;
//! use burn_dist::collective::{Communicator, ReduceOp};
//! use burn_dist::overlap::OverlappedExchange;
//! use burn_dist::transport::memory::MemoryTransport;
//!
//! let handles: Vec<_> = MemoryTransport::mesh(2)
//!     .into_iter()
//!     .map(|t| std::thread::spawn(move || {
//!         let comm = Arc::new(Communicator::new(Arc::new(t)));
//!         let r = comm.rank() as f32;
//!         let exchange = OverlappedExchange::start(comm, 8, ReduceOp::Mean).unwrap();
//!         // As a backward pass would: the head's gradient first, then the layer before it.
//!         exchange.submit(vec![vec![r; 3]]);
//!         exchange.submit(vec![vec![10.0 + r; 2]]);
//!         exchange.finish().unwrap()
//!     }))
//!     .collect();
//! for h in handles {
//!     assert_eq!(h.join().unwrap(), vec![vec![0.5; 3], vec![10.5; 2]]);
//! }
//! ```
//!
//! [`BucketPlan`]: crate::bucket::BucketPlan

use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;

use crate::collective::{Communicator, ReduceOp};
use crate::{DistError, Result};

/// An exchange under way: [`submit`](Self::submit) gradients as they exist, then
/// [`finish`](Self::finish) for all of them reduced. While it runs, nothing else may call a
/// collective on its communicator (the exchange's collectives are numbered in call order).
pub struct OverlappedExchange {
    tx: Option<Sender<Vec<Vec<f32>>>>,
    worker: Option<JoinHandle<Result<Vec<Vec<f32>>>>>,
}

impl OverlappedExchange {
    /// Starts the exchange thread: buckets of up to `bucket_bytes` (of `f32`), each reduced
    /// with `op` over `comm`.
    pub fn start(comm: Arc<Communicator>, bucket_bytes: usize, op: ReduceOp) -> Result<Self> {
        let (tx, rx) = channel();
        let worker = std::thread::Builder::new()
            .name("burn-dist-exchange".into())
            .spawn(move || exchange(&comm, (bucket_bytes / 4).max(1), op, rx))
            .map_err(|e| DistError::Config(format!("starting the exchange thread: {e}")))?;
        Ok(Self {
            tx: Some(tx),
            worker: Some(worker),
        })
    }

    /// Hands over `tensors`, in the order every rank hands them over; their buckets start to
    /// move as soon as they are full. If the exchange has failed, the tensors are dropped and
    /// [`finish`](Self::finish) returns the failure.
    pub fn submit(&self, tensors: Vec<Vec<f32>>) {
        if let Some(tx) = &self.tx {
            // A closed channel means the thread has stopped on an error: finish reports it.
            let _ = tx.send(tensors);
        }
    }

    /// Reduces what is left and returns every submitted tensor reduced, in submission order.
    pub fn finish(mut self) -> Result<Vec<Vec<f32>>> {
        self.tx.take();
        let worker = self
            .worker
            .take()
            .ok_or_else(|| DistError::Config("the gradient exchange was finished twice".into()))?;
        worker.join().unwrap_or_else(|_| {
            Err(DistError::Config(
                "the gradient exchange thread panicked".into(),
            ))
        })
    }
}

impl Drop for OverlappedExchange {
    fn drop(&mut self) {
        // Dropped without finish (the step failed): let the thread end, reduce what it has
        // and stop; its result is not wanted. This waits at most for the bucket under way,
        // which its collective's timeout bounds.
        self.tx.take();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// The exchange thread: packs the tensors as they come into buckets of at most `cap` values
/// (a larger tensor alone) and reduces each full bucket at once, the last when the sender is
/// done.
fn exchange(
    comm: &Communicator,
    cap: usize,
    op: ReduceOp,
    rx: Receiver<Vec<Vec<f32>>>,
) -> Result<Vec<Vec<f32>>> {
    let mut all: Vec<Vec<f32>> = Vec::new();
    let (mut start, mut fill) = (0usize, 0usize);
    let mut flat = Vec::new();
    for tensors in rx {
        for t in tensors {
            if fill > 0 && fill + t.len() > cap {
                reduce(comm, op, &mut all[start..], &mut flat)?;
                start = all.len();
                fill = 0;
            }
            fill += t.len();
            all.push(t);
        }
    }
    if start < all.len() {
        reduce(comm, op, &mut all[start..], &mut flat)?;
    }
    Ok(all)
}

/// One bucket: the tensors concatenated, reduced, and copied back.
fn reduce(
    comm: &Communicator,
    op: ReduceOp,
    bucket: &mut [Vec<f32>],
    flat: &mut Vec<f32>,
) -> Result<()> {
    flat.clear();
    for t in bucket.iter() {
        flat.extend_from_slice(t);
    }
    comm.allreduce(flat, op)?;
    let mut at = 0;
    for t in bucket.iter_mut() {
        let n = t.len();
        t.copy_from_slice(&flat[at..at + n]);
        at += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::Compression;
    use crate::bucket::BucketPlan;

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
        // The buckets it cuts are BucketPlan's (its greedy rule), so the collectives match a
        // non-overlapped exchange's one for one.
        let plan = BucketPlan::new(&SIZES, 40);
        assert_eq!(plan.buckets, vec![0..2, 2..5, 5..6, 6..7]);
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
}
