//! Elastic training from Rust: a worker program that embeds Hearth's elastic trainer. Start a
//! few with `hearth launch --elastic`, then take workers away and add new ones while it trains;
//! the global batch stays 32, nobody restarts, and the last survivors export the model:
//!
//!   cargo build --release --example elastic
//!   cargo run --release -- data synth --out /tmp/shapes --classes 4 --per-class 100 \
//!       --size 32 --val-per-class 20
//!   cargo run --release -- launch --elastic -n 3 --min 2 --max 4 \
//!       --churn t=5s:-1,t=10s:+2,t=15s:-1! -- target/release/examples/elastic /tmp/shapes
//!
//! (`-1` stops the newest worker gracefully with SIGTERM, `-1!` kills it, `+2` starts two
//! joiners.) The run directory is `runs/elastic-example`: `metrics.csv` with the mean world
//! size of each epoch, `world.csv` with the world size of every step, `world.png`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use burn::prelude::*;
use hearth::HearthError;
use hearth::dist::rendezvous::RankInfo;
use hearth::train::{Balance, ElasticOptions, TrainConfig, TrainingMode, train};

fn main() -> Result<()> {
    // As the `hearth` binary does: Burn's default device pinned to the run's backend, the CPU
    // (where a resume loads optimizer state), freed memory kept for the next step, this thread
    // one of the kernels' threads. SAFETY: first thing in main, before any thread starts.
    unsafe { hearth::process::start("flex") }?;
    let data: PathBuf = std::env::args()
        .nth(1)
        .context("usage: elastic DATA_FOLDER (under `hearth launch --elastic`)")?
        .into();
    let mut cfg = TrainConfig::new(PathBuf::from("runs/elastic-example"));
    cfg.data.folder = Some(data);
    cfg.epochs = 20;
    cfg.batch_size = 32;
    cfg.optim.lr = 0.05;
    cfg.data.workers = 1;
    // The first workers are a job (HEARTH_RANK...); joiners are not.
    cfg.dist = RankInfo::detect()?;
    cfg.mode = TrainingMode::Elastic(
        ElasticOptions {
            min_workers: 2,
            max_workers: 4,
            rejoin_timeout: Duration::from_secs(60),
            balance: Balance::Even,
            ..Default::default()
        }
        .with_env()?,
    );
    match train(&cfg, &Device::flex(), &mut |line| eprintln!("{line}")) {
        Ok(report) if report.rank == 0 => {
            println!(
                "best epoch {} of {}: validation accuracy {:.1}% on {} workers at the end",
                report.best_epoch,
                report.epochs_run,
                report.best_val_accuracy.unwrap_or(f64::NAN),
                report.world
            );
            Ok(())
        }
        Ok(_) => Ok(()),
        Err(HearthError::LeftJob { id, step }) => {
            eprintln!("{id} left after step {step}");
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}
