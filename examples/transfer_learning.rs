//! Fine-tune a torchvision model on your own folder of images.
//!
//!   cargo run --release --example transfer_learning -- DATA_DIR MODEL [WEIGHTS.pth]
//!   cargo run --release --example transfer_learning -- data/flowers resnet50 resnet50.pth
//!
//! DATA_DIR holds train/ and val/ class folders, or one folder (20% goes to validation).
//! With weights, the backbone is frozen and only the new head trains for 3 epochs; then the
//! whole network fine-tunes at a tenth of the learning rate (the Keras recipe).

use anyhow::{Result, bail};
use hearth::prelude::*;

fn main() -> Result<()> {
    // As the `hearth` binary does: Burn's default device pinned to the run's backend (where
    // a resume loads optimizer state), freed memory kept for the next step, this thread one of
    // the kernels' threads. SAFETY: first thing in main, before any thread starts.
    let spec = unsafe { hearth::process::start_from_env() }?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(data), Some(model)) = (args.first(), args.get(1)) else {
        bail!("usage: transfer_learning DATA_DIR MODEL [WEIGHTS]");
    };
    let device = spec.device()?;
    let mut cfg = TrainConfig::new("runs/transfer_learning".into());
    cfg.data.folder = Some(data.into());
    cfg.model.name = model.clone();
    cfg.data.image_size = 224;
    cfg.batch_size = 16;
    cfg.epochs = 6;
    cfg.optim.lr = 0.01;
    if let Some(weights) = args.get(2) {
        cfg.model.weights = Some(weights.into());
        cfg.model.freeze_backbone = true;
        cfg.model.unfreeze_after = Some(3);
        cfg.model.finetune_lr = Some(cfg.optim.lr / 10.0);
    }
    let report = train(&cfg, &device, &mut |line| eprintln!("{line}"))?;
    println!(
        "validation accuracy {:.2}% (epoch {}); model at {}",
        report.best_val_accuracy.unwrap_or(f64::NAN),
        report.best_epoch,
        report.model_path.display()
    );
    Ok(())
}
