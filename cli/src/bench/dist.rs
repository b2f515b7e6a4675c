//! `hearth bench allreduce`: allreduce among N local ranks on loopback (shared memory between
//! them by default, QUIC only with `HEARTH_SHM=0`).
//!
//! Each size is timed over `iters` allreduces after `warmup` untimed ones; rank 0 prints one line
//! per size in nccl-tests' terms: `size_mb=S time_ms=T algbw_GBps=A busbw_GBps=B`, where
//! algbw = bytes / time and busbw = algbw * 2(n-1)/n. Once the ranks are done, `hearth bench
//! allreduce` measures this host's memory ([`memcpy_gbps`], [`floor_ms`]) and prints per size
//! the most any allreduce could reach there ([`ceiling_busbw_gbps`]), the same measures as
//! `cargo bench --bench allreduce` takes. After each size's timing every rank checks one more
//! allreduce of known values, so a wrong sum fails the bench instead of being timed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use burn_dist::rendezvous::{RankInfo, RendezvousOptions, connect};
use burn_dist::tls::Membership;
use burn_dist::{Communicator, Compression, ReduceOp};

use hearth::Result;

/// One measured size.
#[derive(Debug, Clone, Copy)]
pub struct AllreduceTiming {
    pub size_mb: f64,
    pub time_ms: f64,
    pub algbw_gbps: f64,
    pub busbw_gbps: f64,
}

impl std::fmt::Display for AllreduceTiming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "size_mb={} time_ms={:.3} algbw_GBps={:.3} busbw_GBps={:.3}",
            self.size_mb, self.time_ms, self.algbw_gbps, self.busbw_gbps
        )
    }
}

/// This process's part of the benchmark: joins the job from the environment and times every
/// size. Rank 0 calls `report` with each timing.
///
/// With `shared`, each size's buffer comes from [`Communicator::reduce_buffer`] (memory the
/// host's ranks all map, summed in place) instead of the rank's own vector.
pub fn run_rank(
    sizes_mb: &[f64],
    iters: usize,
    warmup: usize,
    compression: Compression,
    shared: bool,
    report: &mut dyn FnMut(AllreduceTiming),
) -> Result<()> {
    let info = RankInfo::from_env()?;
    let transport = connect(
        &info,
        &Membership::from_env()?,
        &RendezvousOptions {
            timeout: Duration::from_secs(60),
            ..RendezvousOptions::from_env()
        },
    )?;
    let comm = Communicator::from_env(Arc::new(transport)).with_compression(compression);
    let n = comm.world();
    for &mb in sizes_mb {
        let len = ((mb * 1e6) / 4.0).round() as usize;
        let mut owned = Vec::new();
        let mut from_comm = if shared {
            Some(comm.reduce_buffer(len)?)
        } else {
            owned = vec![0.0; len];
            None
        };
        let buf: &mut [f32] = match &mut from_comm {
            Some(b) => b,
            None => &mut owned,
        };
        for (i, v) in buf.iter_mut().enumerate() {
            *v = (i % 97) as f32 + comm.rank() as f32;
        }
        for _ in 0..warmup {
            comm.allreduce(buf, ReduceOp::Sum)?;
        }
        comm.barrier()?;
        let start = Instant::now();
        for _ in 0..iters.max(1) {
            comm.allreduce(buf, ReduceOp::Sum)?;
        }
        let secs = start.elapsed().as_secs_f64() / iters.max(1) as f64;
        check_sum(&comm, buf, compression)?;
        let bytes = (len * 4) as f64;
        let algbw = bytes / secs / 1e9;
        let t = AllreduceTiming {
            size_mb: mb,
            time_ms: secs * 1e3,
            algbw_gbps: algbw,
            busbw_gbps: algbw * 2.0 * (n as f64 - 1.0) / n as f64,
        };
        if comm.rank() == 0 {
            report(t);
        }
    }
    comm.barrier()?;
    Ok(())
}

/// One more allreduce, of known values, checked on every rank: a fast wrong allreduce is no
/// result. Exact without compression; within the wire format's rounding with it.
fn check_sum(comm: &Communicator, buf: &mut [f32], compression: Compression) -> Result<()> {
    let (n, rank) = (comm.world(), comm.rank());
    for (i, v) in buf.iter_mut().enumerate() {
        *v = (i % 97) as f32 + rank as f32;
    }
    comm.allreduce(buf, ReduceOp::Sum)?;
    let tolerance = match compression {
        Compression::None => 0.0,
        // 8 (bf16) or 11 (fp16) significant bits, rounded at every rank's contribution.
        _ => 1.0 / 64.0,
    };
    let ranks = (n * (n - 1) / 2) as f32;
    let wrong = buf.iter().enumerate().find(|&(i, &v)| {
        let want = (i % 97) as f32 * n as f32 + ranks;
        (v - want).abs() > want * tolerance
    });
    match wrong {
        Some((i, &v)) => Err(burn_dist::DistError::Mismatch {
            op: "allreduce benchmark check".into(),
            reason: format!(
                "rank {rank}: value {i} is {v} after the allreduce, the sum is {}",
                (i % 97) as f32 * n as f32 + ranks
            ),
        }
        .into()),
        None => Ok(()),
    }
}

/// Best of five single-thread copies of `mb` megabytes, in GB/s (bytes copied per second).
pub fn memcpy_gbps(mb: f64) -> f64 {
    let len = ((mb * 1e6) / 4.0) as usize;
    let src: Vec<f32> = (0..len).map(|i| i as f32).collect();
    let mut dst = vec![0f32; len];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = std::time::Instant::now();
        dst.copy_from_slice(&src);
        best = best.min(t.elapsed().as_secs_f64());
        std::hint::black_box(&mut dst);
    }
    (len * 4) as f64 / best / 1e9
}

/// The memory floor of an allreduce of `mb` megabytes over `n` ranks of this host, in ms: `n`
/// threads (time-sharing the cores as the ranks' processes do), each reading and writing its
/// own buffer once, started together; best of five.
pub fn floor_ms(n: usize, mb: f64) -> f64 {
    let len = ((mb * 1e6) / 4.0) as usize;
    let mut bufs: Vec<Vec<f32>> = (0..n).map(|r| vec![r as f32; len]).collect();
    let mut best = f64::MAX;
    for _ in 0..5 {
        // From the first thread's start to the last one's end, as each thread sees them (the
        // spawning thread may not get a core until the others are done).
        let start = std::sync::Barrier::new(n);
        let spans: Vec<(std::time::Instant, std::time::Instant)> = std::thread::scope(|s| {
            let handles: Vec<_> = bufs
                .iter_mut()
                .map(|b| {
                    let start = &start;
                    s.spawn(move || {
                        start.wait();
                        let began = std::time::Instant::now();
                        let k = std::hint::black_box(1.0f32);
                        b.iter_mut().for_each(|x| *x *= k);
                        (began, std::time::Instant::now())
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a floor thread panicked"))
                .collect()
        });
        let (Some(first), Some(last)) = (
            spans.iter().map(|s| s.0).min(),
            spans.iter().map(|s| s.1).max(),
        ) else {
            continue;
        };
        best = best.min((last - first).as_secs_f64());
    }
    std::hint::black_box(&bufs);
    best * 1e3
}

/// The most any allreduce of `mb` megabytes over `n` ranks can reach on this host, as busbw in
/// GB/s: the bytes of the allreduce's busbw over [`floor_ms`]'s time (0 for one rank).
pub fn ceiling_busbw_gbps(n: usize, mb: f64, floor_ms: f64) -> f64 {
    if n < 2 || floor_ms <= 0.0 {
        return 0.0;
    }
    mb * 1e6 / (floor_ms / 1e3) / 1e9 * 2.0 * (n as f64 - 1.0) / n as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ceiling_is_the_floors_time_as_busbw() {
        // 100 MB in 10 ms is 10 GB/s of algbw; busbw is 2(n-1)/n of it.
        assert!((ceiling_busbw_gbps(2, 100.0, 10.0) - 10.0).abs() < 1e-9);
        assert!((ceiling_busbw_gbps(4, 100.0, 10.0) - 15.0).abs() < 1e-9);
        // One rank moves nothing; a floor not measured is no ceiling.
        assert_eq!(ceiling_busbw_gbps(1, 100.0, 10.0), 0.0);
        assert_eq!(ceiling_busbw_gbps(4, 100.0, 0.0), 0.0);
    }

    #[test]
    fn the_floor_and_memcpy_measure_something() {
        assert!(memcpy_gbps(1.0) > 0.0);
        let floor = floor_ms(2, 1.0);
        assert!(floor.is_finite() && floor > 0.0, "{floor}");
    }
}
