//! Data-parallel training from Rust. Each process is one rank; start them with any launcher:
//!
//!   cargo build --release --example distributed
//!   cargo run --release -- launch -n 2 -- target/release/examples/distributed
//!
//! (or under torchrun, Slurm or mpirun: the rank comes from their variables, see deploy/). The
//! global batch of 32 is split over the ranks; rank 0 writes the run directory and prints the
//! result.

use anyhow::{Context, Result};
use hearth::dist::rendezvous::RankInfo;
use hearth::train::{TrainConfig, train};

fn main() -> Result<()> {
    // As the `hearth` binary does: Burn's default device pinned to the run's backend (where
    // a resume loads optimizer state), freed memory kept for the next step, this thread one of
    // the kernels' threads. SAFETY: first thing in main, before any thread starts.
    let spec = unsafe { hearth::process::start_from_env() }?;
    let info = RankInfo::detect()?.context(
        "start this example under `hearth launch -n 2 -- ...` (or torchrun, Slurm, mpirun)",
    )?;
    // Each rank of a multi-GPU machine takes the GPU of its local rank.
    let spec = spec.for_local_rank(info.local_rank);
    let device = spec.device()?;
    eprintln!("rank {} of {}: device {spec}", info.rank, info.world);
    let mut cfg = TrainConfig::new("runs/distributed_example".into());
    cfg.epochs = 4;
    cfg.batch_size = 32;
    cfg.dist = Some(info);
    let report = train(&cfg, &device, &mut |line| eprintln!("{line}"))?;
    if report.rank == 0 {
        println!(
            "{} ranks: validation accuracy {:.2}% (epoch {}), model at {}",
            report.world,
            report.best_val_accuracy.unwrap_or(f64::NAN),
            report.best_epoch,
            report.model_path.display()
        );
    }
    Ok(())
}
