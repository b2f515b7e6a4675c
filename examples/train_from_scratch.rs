//! Train a small ResNet from scratch on a generated image folder, from Rust.
//!
//!   cargo run --release --example train_from_scratch [DATA_DIR]
//!
//! Without DATA_DIR a synthetic data set (coloured shapes, 6 classes) is written first.

use anyhow::Result;
use hearth::prelude::*;

fn main() -> Result<()> {
    // As the `hearth` binary does: Burn's default device pinned to the run's backend (where
    // a resume loads optimizer state), freed memory kept for the next step, this thread one of
    // the kernels' threads. SAFETY: first thing in main, before any thread starts.
    let spec = unsafe { hearth::process::start_from_env() }?;
    let device = spec.device()?;
    let mut cfg = TrainConfig::new("runs/train_from_scratch".into());
    cfg.data.folder = std::env::args().nth(1).map(Into::into);
    cfg.epochs = 6;
    let report = train(&cfg, &device, &mut |line| eprintln!("{line}"))?;
    println!(
        "best epoch {}: validation accuracy {:.2}% in {:.0} s; model at {}",
        report.best_epoch,
        report.best_val_accuracy.unwrap_or(f64::NAN),
        report.wall_seconds,
        report.model_path.display()
    );
    Ok(())
}
