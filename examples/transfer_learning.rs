//! Fine-tune a torchvision model on your own folder of images.
//!
//!   cargo run --release --example transfer_learning -- DATA_DIR MODEL [WEIGHTS.pth]
//!   cargo run --release --example transfer_learning -- data/flowers resnet50 resnet50.pth
//!
//! DATA_DIR holds train/ and val/ class folders, or one folder (20% goes to validation).
//! With weights, the backbone is frozen and only the new head trains for 3 epochs; then the
//! whole network fine-tunes at a tenth of the learning rate (the Keras recipe).

use anyhow::{Result, bail};
use hearth::train::{TrainConfig, train};

fn main() -> Result<()> {
    let device_name = std::env::var("HEARTH_DEVICE").unwrap_or("flex".into());
    // Burn's default device on the run's backend: burn-optim builds loaded optimizer state there
    // (the switch from the frozen phase to fine-tuning loads a checkpoint).
    let spec: hearth::device::DeviceSpec = device_name.parse()?;
    // SAFETY: in main, before any thread starts.
    unsafe { hearth::device::pin_burn_default(spec.choice) }
    // Freed tensors stay in the process for the next step, as in the `hearth` binary
    // (`HEARTH_MALLOC=system` keeps the C allocator's defaults).
    hearth::alloc::apply_freed_memory_policy()?;
    // This thread computes as one of the kernels' threads, as in the `hearth` binary.
    hearth::kernels::join_global_pool();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(data), Some(model)) = (args.first(), args.get(1)) else {
        bail!("usage: transfer_learning DATA_DIR MODEL [WEIGHTS]");
    };
    let device = hearth::device::select(&device_name)?;
    let mut cfg = TrainConfig::new("runs/transfer_learning".into());
    cfg.data = Some(data.into());
    cfg.model = model.clone();
    cfg.image_size = 224;
    cfg.batch_size = 16;
    cfg.epochs = 6;
    cfg.lr = 0.01;
    if let Some(weights) = args.get(2) {
        cfg.weights = Some(weights.into());
        cfg.freeze_backbone = true;
        cfg.unfreeze_after = Some(3);
        cfg.finetune_lr = Some(cfg.lr / 10.0);
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
