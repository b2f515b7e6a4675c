//! The same small ResNet trained with the same recipe in Hearth and in PyTorch, on the same
//! generated image folder, for each augmentation preset: final training accuracy, best
//! validation accuracy and wall time side by side.
//!
//!   cargo bench --bench recipe
//!   HEARTH_BENCH_EPOCHS=12 HEARTH_BENCH_PRESETS=light,imagenet cargo bench --bench recipe
//!   HEARTH_BENCH_PRESETS=timm HEARTH_BENCH_SEEDS=0,1,2 cargo bench --bench recipe
//!
//! `timm` is a modern recipe in timm's `train.py` terms, on ResNet-18 (the other presets train
//! `resnet-mini`): `--aa rand-m9-n2 --reprob 0.25 --remode const --mixup 0.2 --cutmix 1.0
//! --mixup-switch-prob 0.5 --smoothing 0.1 --model-ema --model-ema-decay 0.99 --clip-grad 1.0`
//! over light crops and flips; Hearth with the same flags, the peer with torchvision's
//! `RandAugment`, `RandomErasing`, `MixUp`/`CutMix`, `AveragedModel` (EMA over weights and
//! buffers) and `clip_grad_norm_`. Its rows add the EMA model's best validation accuracy. With
//! several seeds (`HEARTH_BENCH_SEEDS`), each seed is a row and the last row is their mean.
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

/// The run's settings for a preset: an augmentation preset alone, or `timm`'s recipe.
fn recipe(cfg: &mut TrainConfig, name: &str) -> Option<()> {
    if name != "timm" {
        cfg.data.augmentation = AugmentPreset::from_name(name)?.augmentation();
        return Some(());
    }
    cfg.model.name = "resnet18".into();
    let mut aug = AugmentPreset::Light.augmentation();
    aug.auto_augment = Some("rand-m9-n2".parse().ok()?);
    aug.random_erasing = 0.25;
    cfg.data.augmentation = aug;
    cfg.data.mixup = 0.2;
    cfg.data.cutmix = 1.0;
    cfg.data.mixup_prob = 1.0;
    cfg.data.mixup_switch_prob = 0.5;
    cfg.optim.label_smoothing = 0.1;
    cfg.optim.model_ema = Some(0.99);
    cfg.optim.clip_grad = Some(1.0);
    Some(())
}

/// The largest value of `column` in a run's `metrics.csv`, and its last.
fn column(csv: &str, column: &str) -> (f64, f64) {
    let header: Vec<&str> = csv.lines().next().unwrap_or("").split(',').collect();
    let Some(i) = header.iter().position(|c| *c == column) else {
        return (f64::NAN, f64::NAN);
    };
    let values: Vec<f64> = csv
        .lines()
        .skip(1)
        .filter_map(|l| l.split(',').nth(i)?.parse().ok())
        .collect();
    let best = values.iter().copied().fold(f64::NAN, f64::max);
    (best, values.last().copied().unwrap_or(f64::NAN))
}

/// One row's figures: train accuracy (last epoch), best validation accuracy, best EMA
/// validation accuracy, seconds.
type Figures = [f64; 4];

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
    let seeds: Vec<u64> = std::env::var("HEARTH_BENCH_SEEDS")
        .unwrap_or_else(|_| "0".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    println!(
        "{:<9} {:>4} {:>8} {:>8} {:>8} {:>7} | {:>8} {:>8} {:>8} {:>7}",
        "preset", "seed", "train", "val", "val ema", "s", "train", "val", "val ema", "s"
    );
    for name in presets.split(',').map(str::trim) {
        let mut rows: Vec<(Figures, Figures)> = Vec::new();
        for &seed in &seeds {
            let hearth = run_hearth(&target, &data, name, epochs, seed);
            let peer = python
                .as_ref()
                .and_then(|py| run_peer(py, &data, name, epochs, seed))
                .unwrap_or([f64::NAN; 4]);
            print_row(name, &seed.to_string(), &hearth, &peer);
            rows.push((hearth, peer));
        }
        if rows.len() > 1 {
            let mean = |f: &dyn Fn(&(Figures, Figures)) -> Figures| -> Figures {
                std::array::from_fn(|i| {
                    rows.iter().map(|r| f(r)[i]).sum::<f64>() / rows.len() as f64
                })
            };
            print_row(name, "mean", &mean(&|r| r.0), &mean(&|r| r.1));
        }
    }
    println!(
        "({epochs} epochs, SGD 0.05 momentum 0.9, batch 32, 32x32 inputs; resnet-mini, timm: \
         resnet18; val ema: the EMA model, timm only)"
    );
}

fn print_row(name: &str, seed: &str, h: &Figures, p: &Figures) {
    println!(
        "{name:<9} {seed:>4} {:>7.2}% {:>7.2}% {:>7.2}% {:>7.1} | {:>7.2}% {:>7.2}% {:>7.2}% {:>7.1}",
        h[0], h[1], h[2], h[3], p[0], p[1], p[2], p[3]
    );
}

fn run_hearth(
    target: &std::path::Path,
    data: &std::path::Path,
    name: &str,
    epochs: usize,
    seed: u64,
) -> Figures {
    let run_dir = target.join(format!("bench-runs/recipe-{name}-{seed}"));
    let _ = std::fs::remove_dir_all(&run_dir);
    let mut cfg = TrainConfig::new(run_dir.clone());
    cfg.data.folder = Some(data.to_path_buf());
    cfg.epochs = epochs;
    cfg.batch_size = 32;
    cfg.seed = seed;
    cfg.optim.lr = 0.05;
    if recipe(&mut cfg, name).is_none() {
        eprintln!("bench: unknown preset {name}");
        std::process::exit(2);
    }
    let report = match train(&cfg, &burn::prelude::Device::flex(), &mut |_| {}) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("bench: hearth {name}: {e}");
            std::process::exit(1);
        }
    };
    let csv = std::fs::read_to_string(run_dir.join("metrics.csv")).unwrap_or_default();
    [
        column(&csv, "train_accuracy").1,
        report.best_val_accuracy.unwrap_or(f64::NAN),
        column(&csv, "val_ema_accuracy").0,
        report.wall_seconds,
    ]
}

fn run_peer(
    py: &std::path::Path,
    data: &std::path::Path,
    name: &str,
    epochs: usize,
    seed: u64,
) -> Option<Figures> {
    let out = Command::new(py)
        .arg(common::peer_script("torch_recipe.py"))
        .arg("--data")
        .arg(data)
        .args(["--preset", name, "--epochs", &epochs.to_string()])
        .args(["--seed", &seed.to_string()])
        .output()
        .ok()?;
    if !out.status.success() {
        eprintln!(
            "bench: peer {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let field = |k: &str| {
        text.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{k}="))?.parse::<f64>().ok())
    };
    Some([
        field("train_acc")?,
        field("best_val_acc")?,
        field("best_ema_val_acc").unwrap_or(f64::NAN),
        field("seconds")?,
    ])
}
