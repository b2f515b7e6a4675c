//! Data-parallel training from Rust. Each process is one rank; start them with any launcher:
//!
//!   cargo build --release --example distributed
//!   cargo run --release -- launch -n 2 -- target/release/examples/distributed
//!
//! (or under torchrun, Slurm or mpirun: the rank comes from their variables, see deploy/). The
//! global batch of 32 is split over the ranks; rank 0 writes the run directory and prints the
//! result.

use anyhow::{Context, Result};
use hearth::device::DeviceSpec;
use hearth::dist::rendezvous::RankInfo;
use hearth::train::{TrainConfig, train};

fn main() -> Result<()> {
    // Freed tensors stay in the process for the next step, as in the `hearth` binary
    // (`HEARTH_MALLOC=system` keeps the C allocator's defaults).
    hearth::alloc::apply_freed_memory_policy()?;
    // This thread computes as one of the kernels' threads, as in the `hearth` binary.
    hearth::kernels::join_global_pool();
    let info = RankInfo::detect()?.context(
        "start this example under `hearth launch -n 2 -- ...` (or torchrun, Slurm, mpirun)",
    )?;
    // Each rank of a multi-GPU machine takes the GPU of its local rank.
    let spec: DeviceSpec = std::env::var("HEARTH_DEVICE")
        .unwrap_or("flex".into())
        .parse()?;
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
