//! Train a small ResNet from scratch on a generated image folder, from Rust.
//!
//!   cargo run --release --example train_from_scratch [DATA_DIR]
//!
//! Without DATA_DIR a synthetic data set (coloured shapes, 6 classes) is written first.

use anyhow::Result;
use hearth::train::{TrainConfig, train};

fn main() -> Result<()> {
    // Freed tensors stay in the process for the next step, as in the `hearth` binary
    // (`HEARTH_MALLOC=system` keeps the C allocator's defaults).
    hearth::alloc::apply_freed_memory_policy()?;
    // This thread computes as one of the kernels' threads, as in the `hearth` binary.
    hearth::kernels::join_global_pool();
    let device = hearth::device::select(&std::env::var("HEARTH_DEVICE").unwrap_or("flex".into()))?;
    let mut cfg = TrainConfig::new("runs/train_from_scratch".into());
    cfg.data = std::env::args().nth(1).map(Into::into);
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
