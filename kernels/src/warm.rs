//! Keeps rayon's global pool awake between kernels, as OpenMP's threads are between PyTorch's
//! ops.
//!
//! Why: every parallel kernel (ours, gemm's, Burn Flex's) forks onto rayon's global pool. A
//! worker that finds nothing to do yields 32 times (tens of microseconds) and then sleeps on a
//! futex; the next kernel's fork wakes it. Between two kernels the main thread runs Burn's own
//! serial work (dispatch, allocation, autodiff's graph), often longer than that, so at batch 1
//! nearly every kernel paid a sleep and a wake-up. On a 2-core AMD EPYC Zen 3 VM, ResNet-50 at
//! batch 1 ran with 16-24% of the CPU idle and 2,400 context switches a second, where PyTorch
//! (libgomp's threads spin between ops) ran at 99% busy with 70.
//!
//! What it does: [`keep_pool_warm`], called at the start of Hearth's CPU layers, hands each
//! other thread of the pool a job that looks for work ([`rayon::yield_now`]) until none has
//! come for [`spin_for`] (`HEARTH_SPIN_US`, default 2,000 microseconds; `0` turns it off), then
//! returns, and the thread sleeps as before. A job that lands on the thread that asked (its
//! own queue, taken while it waits in a join) returns at once, so that thread is never held.
//! While it waits it pauses (`spin_loop`) and every 32nd round yields its core
//! ([`std::thread::yield_now`]), so a busy core's other threads (other ranks on the same host)
//! still get their turn.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How many keep-warm jobs are running or queued.
static WARM: AtomicUsize = AtomicUsize::new(0);

/// How long a thread keeps looking for work after its last piece (`HEARTH_SPIN_US`, read once;
/// default 2 ms, `0`: never, the pool sleeps as rayon has it).
pub fn spin_for() -> Duration {
    static FOR: OnceLock<Duration> = OnceLock::new();
    *FOR.get_or_init(|| {
        let micros = std::env::var("HEARTH_SPIN_US")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(2_000);
        Duration::from_micros(micros)
    })
}

/// Makes sure each other thread of rayon's global pool is looking for work, for the kernels
/// on `device` that follow; does nothing where they already are, where `device` is not Burn
/// Flex (the CPU kernels' device) or is a training (autodiff) device, where the pool has one
/// thread, or where `HEARTH_SPIN_US=0`.
///
/// Inference only: a training step's kernels are long beside the gaps between them, and on the
/// Zen 3 DenseNet-121's training step at batch 16 was 0-13% slower with the pool kept awake
/// (three alternated runs) where ResNet-50's inference at batch 1 was 11-12% faster.
pub fn keep_pool_warm(device: &burn::prelude::Device) {
    let budget = spin_for();
    if !wanted(device, budget) {
        return;
    }
    let others = rayon::current_num_threads().saturating_sub(1);
    let asker = rayon::current_thread_index();
    loop {
        let now = WARM.load(Ordering::Acquire);
        if now >= others {
            return;
        }
        if WARM
            .compare_exchange(now, now + 1, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            rayon::spawn(move || {
                struct Done;
                impl Drop for Done {
                    fn drop(&mut self) {
                        WARM.fetch_sub(1, Ordering::AcqRel);
                    }
                }
                let _done = Done;
                let _ = look_for_work(asker, budget);
            });
        }
    }
}

/// Whether kernels on `device` get the pool kept awake for `budget`: inference on Flex.
fn wanted(device: &burn::prelude::Device, budget: Duration) -> bool {
    !budget.is_zero() && !device.is_autodiff() && crate::base::is_flex(device)
}

/// Runs the pool's pending pieces until none has come for `budget`, and returns how many it
/// ran; returns at once on the thread that asked, which must stay free to go on with its own
/// work.
fn look_for_work(asker: Option<usize>, budget: Duration) -> usize {
    let me = rayon::current_thread_index();
    if me.is_none() || me == asker {
        return 0;
    }
    let mut ran = 0;
    let mut last = Instant::now();
    let mut idle = 0u32;
    loop {
        match rayon::yield_now() {
            Some(rayon::Yield::Executed) => {
                ran += 1;
                last = Instant::now();
            }
            Some(rayon::Yield::Idle) => {
                if last.elapsed() >= budget {
                    return ran;
                }
                idle = idle.wrapping_add(1);
                if idle.is_multiple_of(32) {
                    std::thread::yield_now();
                } else {
                    for _ in 0..64 {
                        std::hint::spin_loop();
                    }
                }
            }
            None => return ran,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;
    use std::sync::mpsc;

    const WAIT: Duration = Duration::from_secs(20);

    fn pool() -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("a 2-thread pool")
    }

    /// On the thread that asked, the job returns at once however long its budget: that thread
    /// goes on with its own work.
    #[test]
    fn never_holds_the_thread_that_asked() {
        let pool = pool();
        let (tx, rx) = mpsc::channel();
        pool.spawn(move || {
            let me = rayon::current_thread_index();
            look_for_work(me, Duration::from_secs(3600));
            let _ = tx.send(());
        });
        rx.recv_timeout(WAIT)
            .expect("the asker's own keep-warm job did not return");
    }

    /// On another thread it runs the pool's work while it waits (here the only free thread:
    /// the other is held, so the sum below can only have run inside it) and returns once no
    /// work has come for its budget.
    #[test]
    fn runs_work_then_returns_when_none_comes() {
        let pool = pool();
        let (held_tx, held_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        pool.spawn(move || {
            let _ = held_tx.send(rayon::current_thread_index());
            let _ = release_rx.recv_timeout(WAIT);
        });
        let held = held_rx
            .recv_timeout(WAIT)
            .expect("a pool thread was not held");
        let (done_tx, done_rx) = mpsc::channel();
        pool.spawn(move || {
            let ran = look_for_work(held, Duration::from_secs(2));
            let _ = done_tx.send((rayon::current_thread_index(), ran));
        });
        let sum: u64 = pool.install(|| (0..100_000u64).into_par_iter().map(|i| i * 2).sum());
        assert_eq!(sum, 99_999 * 100_000);
        let (on, ran) = done_rx
            .recv_timeout(WAIT)
            .expect("the keep-warm job did not return after the work stopped");
        let _ = release_tx.send(());
        assert_ne!(on, held, "the keep-warm job ran on the held thread");
        assert!(ran >= 1, "the keep-warm job ran none of the pool's work");
    }

    /// Inference on Flex is kept warm; training, other devices and a zero budget are not.
    #[test]
    fn warms_for_inference_on_flex_only() {
        let flex = burn::prelude::Device::flex();
        let ms = Duration::from_millis(2);
        assert!(wanted(&flex, ms));
        assert!(!wanted(&flex, Duration::ZERO));
        assert!(!wanted(&flex.clone().autodiff(), ms));
    }
}
