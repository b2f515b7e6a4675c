//! `hearth bench allreduce`: allreduce among N local ranks on loopback (shared memory between
//! them by default, QUIC only with `HEARTH_SHM=0`).
//!
//! Each size is timed over `iters` allreduces after `warmup` untimed ones; rank 0 prints one line
//! per size in nccl-tests' terms: `size_mb=S time_ms=T algbw_GBps=A busbw_GBps=B`, where
//! algbw = bytes / time and busbw = algbw * 2(n-1)/n.

use std::sync::Arc;
use std::time::{Duration, Instant};

use burn_dist::rendezvous::{RankInfo, RendezvousOptions, connect};
use burn_dist::tls::Membership;
use burn_dist::{Communicator, Compression, ReduceOp};

use crate::Result;

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
pub fn run_rank(
    sizes_mb: &[f64],
    iters: usize,
    warmup: usize,
    compression: Compression,
    report: &mut dyn FnMut(AllreduceTiming),
) -> Result<()> {
    let info = RankInfo::from_env()?;
    let transport = connect(
        &info,
        &Membership::from_env()?,
        &RendezvousOptions {
            timeout: Duration::from_secs(60),
            ..Default::default()
        },
    )?;
    let comm = Communicator::new(Arc::new(transport)).with_compression(compression);
    let n = comm.world();
    for &mb in sizes_mb {
        let len = ((mb * 1e6) / 4.0).round() as usize;
        let mut buf: Vec<f32> = (0..len)
            .map(|i| (i % 97) as f32 + comm.rank() as f32)
            .collect();
        for _ in 0..warmup {
            comm.allreduce(&mut buf, ReduceOp::Sum)?;
        }
        comm.barrier()?;
        let start = Instant::now();
        for _ in 0..iters.max(1) {
            comm.allreduce(&mut buf, ReduceOp::Sum)?;
        }
        let secs = start.elapsed().as_secs_f64() / iters.max(1) as f64;
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
