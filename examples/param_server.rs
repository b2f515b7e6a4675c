//! Parameter-server training from Rust: a program that embeds Hearth's trainer with ADAG on
//! one dedicated server. Start it as a job of 5 ranks (4 workers, 1 server):
//!
//!   cargo build --release --example param_server
//!   cargo run --release -- data synth --out /tmp/shapes --classes 6 --per-class 100 \
//!       --size 32 --val-per-class 30
//!   cargo run --release -- launch -n 5 -- target/release/examples/param_server /tmp/shapes
//!
//! The run directory is `runs/ps-example`: `metrics.csv` with every worker's training
//! accuracy and the servers' model's validation accuracy per epoch, `metrics.png`,
//! `checkpoint/ps.state`, and `model.bpk` from the best epoch.

use std::path::PathBuf;

use anyhow::{Context, Result};
use burn::prelude::*;
use hearth::dist::rendezvous::RankInfo;
use hearth::train::{PsMode, PsOptions, PsServers, TrainConfig, TrainingMode, train};

fn main() -> Result<()> {
    // As the `hearth` binary does: Burn's default device pinned to the run's backend, the CPU
    // (where a resume loads optimizer state), freed memory kept for the next step, this thread
    // one of the kernels' threads. SAFETY: first thing in main, before any thread starts.
    unsafe { hearth::process::start("flex") }?;
    let data: PathBuf = std::env::args()
        .nth(1)
        .context("usage: param_server DATA_FOLDER (under `hearth launch -n 5`)")?
        .into();
    let mut cfg = TrainConfig::new(PathBuf::from("runs/ps-example"));
    cfg.data.folder = Some(data);
    cfg.epochs = 8;
    cfg.batch_size = 32;
    cfg.optim.lr = 0.05;
    cfg.optim.schedule = hearth::schedule::Decay::Constant;
    cfg.optim.warmup_epochs = 0;
    cfg.data.workers = 1;
    cfg.dist = RankInfo::detect()?;
    cfg.mode = TrainingMode::ParameterServers(PsOptions {
        servers: PsServers::Dedicated(1),
        mode: PsMode::Adag,
        window: Some(4),
        ..Default::default()
    });
    let report = train(&cfg, &Device::flex(), &mut |line| eprintln!("{line}"))?;
    if report.rank == 0 {
        println!(
            "best epoch {} of {}: the servers' model scores {:.1}% on validation",
            report.best_epoch,
            report.epochs_run,
            report.best_val_accuracy.unwrap_or(f64::NAN)
        );
    }
    Ok(())
}
