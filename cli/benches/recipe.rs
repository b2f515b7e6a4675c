//! The same small ResNet trained with the same recipe in Hearth and in PyTorch, on the same
//! generated image folder, for each augmentation preset: final training accuracy, best
//! validation accuracy and wall time side by side.
//!
//!   cargo bench --bench recipe
//!   HEARTH_BENCH_EPOCHS=12 HEARTH_BENCH_PRESETS=light,imagenet cargo bench --bench recipe
//!
//! Data: 6 classes of 32x32 shapes over noise (`hearth data synth`), 100 training and 30
//! validation images per class. The PyTorch peer is benches/peer/torch_recipe.py
//! (`bash scripts/setup_pytorch.sh`); without it only Hearth's figures print.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{env_usize, torch_python};
use hearth::datasets::synth::{SynthConfig, generate};
use hearth::train::{AugmentPreset, TrainConfig, train};

fn preset(name: &str) -> Option<AugmentPreset> {
    AugmentPreset::from_name(name)
}

fn main() {
    let smoke = !std::env::args().any(|a| a == "--bench");
    let epochs = env_usize("HEARTH_BENCH_EPOCHS", if smoke { 1 } else { 8 });
    let per_class = env_usize("HEARTH_BENCH_PER_CLASS", if smoke { 8 } else { 100 });
    let presets = std::env::var("HEARTH_BENCH_PRESETS").unwrap_or("none,light,imagenet".into());
    let target =
        PathBuf::from(std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into()));
    let data = target.join(format!("bench-data/recipe-{per_class}"));
    if !data.join(".complete").exists() {
        let _ = std::fs::remove_dir_all(&data);
        let cfg = SynthConfig::new(6, per_class, 32)
            .with_seed(7)
            .with_val(per_class * 3 / 10);
        if let Err(e) = generate(&data, &cfg) {
            eprintln!("bench: {e}");
            std::process::exit(1);
        }
        let _ = std::fs::write(data.join(".complete"), b"");
    }
    let python = torch_python();
    if python.is_none() {
        eprintln!("no PyTorch peer (bash scripts/setup_pytorch.sh): Hearth only");
    }
    println!(
        "{:<9} {:>13} {:>13} {:>9} | {:>13} {:>13} {:>9}",
        "preset", "hearth train", "hearth val", "seconds", "torch train", "torch val", "seconds"
    );
    for name in presets.split(',').map(str::trim) {
        let Some(p) = preset(name) else {
            eprintln!("bench: unknown preset {name}");
            std::process::exit(2);
        };
        let run_dir = target.join(format!("bench-runs/recipe-{name}"));
        let _ = std::fs::remove_dir_all(&run_dir);
        let mut cfg = TrainConfig::new(run_dir.clone());
        cfg.data.folder = Some(data.clone());
        cfg.epochs = epochs;
        cfg.batch_size = 32;
        cfg.optim.lr = 0.05;
        cfg.data.augmentation = p.augmentation();
        let report = match train(&cfg, &burn::prelude::Device::flex(), &mut |_| {}) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("bench: hearth {name}: {e}");
                std::process::exit(1);
            }
        };
        let csv = std::fs::read_to_string(run_dir.join("metrics.csv")).unwrap_or_default();
        let header: Vec<&str> = csv.lines().next().unwrap_or("").split(',').collect();
        let last_train = header
            .iter()
            .position(|c| *c == "train_accuracy")
            .and_then(|i| csv.lines().last()?.split(',').nth(i)?.parse::<f64>().ok())
            .unwrap_or(f64::NAN);
        let peer = python.as_ref().and_then(|py| {
            let out = Command::new(py)
                .arg(common::peer_script("torch_recipe.py"))
                .arg("--data")
                .arg(&data)
                .args(["--preset", name, "--epochs", &epochs.to_string()])
                .output()
                .ok()?;
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            let field = |k: &str| {
                text.split_whitespace()
                    .find_map(|w| w.strip_prefix(&format!("{k}="))?.parse::<f64>().ok())
            };
            Some((
                field("train_acc")?,
                field("best_val_acc")?,
                field("seconds")?,
            ))
        });
        let (pt, pv, ps) = peer.unwrap_or((f64::NAN, f64::NAN, f64::NAN));
        println!(
            "{name:<9} {last_train:>12.2}% {:>12.2}% {:>9.1} | {pt:>12.2}% {pv:>12.2}% {ps:>9.1}",
            report.best_val_accuracy.unwrap_or(f64::NAN),
            report.wall_seconds
        );
    }
    println!("({epochs} epochs, resnet-mini, SGD 0.05 momentum 0.9, batch 32, 32x32 inputs)");
}
