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
    let info =
        RankInfo::from_env().context("start this example under `hearth launch -n 2 -- ...`")?;
    let device = hearth::device::select(&std::env::var("HEARTH_DEVICE").unwrap_or("flex".into()))?;
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
