//! Data pipeline throughput and memory, Hearth vs torchvision in the same run.
//!
//! Generates a synthetic JPEG image folder (default 1,500 images of 320x320, ~0.46 GB decoded,
//! far beyond the prefetch window), then streams training batches (decode, RandomResizedCrop
//! 224, flip, normalise, batch to a tensor) with Hearth's loader and with torchvision's
//! ImageFolder + DataLoader at the same worker count, and prints images/s, the ratio and peak RSS.
//!
//!   cargo bench --bench loader
//!   HEARTH_BENCH_WORKERS=2 HEARTH_BENCH_BATCHES=20 cargo bench --bench loader
//!   HEARTH_BENCH_AUTO_AUGMENT=rand-m9-n2 cargo bench --bench loader   # RandAugment on both sides

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{env_usize, torch_python};

use hearth::datasets::synth::{SynthConfig, generate};
use hearth_cli::bench::loader::LoaderBench;

fn main() {
    let smoke = !std::env::args().any(|a| a == "--bench");
    let per_class = env_usize("HEARTH_BENCH_PER_CLASS", if smoke { 4 } else { 150 });
    let side = env_usize("HEARTH_BENCH_IMAGE", if smoke { 64 } else { 320 }) as u32;
    let workers = env_usize("HEARTH_BENCH_WORKERS", 2);
    let batch = env_usize("HEARTH_BENCH_BATCH", if smoke { 8 } else { 64 });
    let batches = env_usize("HEARTH_BENCH_BATCHES", if smoke { 2 } else { 20 });
    let size = if smoke { 32 } else { 224 };
    // RandAugment or TrivialAugmentWide after the crop and flip, on both sides.
    let policy = std::env::var("HEARTH_BENCH_AUTO_AUGMENT").ok();
    let auto_augment = match policy.as_deref().map(str::parse) {
        Some(Ok(p)) => Some(p),
        Some(Err(e)) => {
            eprintln!("bench: HEARTH_BENCH_AUTO_AUGMENT: {e}");
            std::process::exit(1);
        }
        None => None,
    };
    let target =
        PathBuf::from(std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into()));
    let data = target.join(format!("bench-data/synth-jpeg-{per_class}x{side}"));
    if !data.join(".complete").exists() {
        eprintln!(
            "generating {} images of {side}x{side} in {}",
            10 * per_class,
            data.display()
        );
        let _ = std::fs::remove_dir_all(&data);
        if let Err(e) = generate(
            &data,
            &SynthConfig::new(10, per_class, side)
                .with_seed(1)
                .with_jpeg(true),
        ) {
            eprintln!("bench: {e}");
            std::process::exit(1);
        }
        let _ = std::fs::write(data.join(".complete"), b"");
    }
    let device = burn::prelude::Device::flex();
    let bench = LoaderBench {
        batch_size: batch,
        workers,
        prefetch: 4,
        size,
        batches,
        auto_augment,
    };
    let report = match bench.run(&data, &device, |_, _| {}) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("bench: {e}");
            std::process::exit(1);
        }
    };
    println!(
        "hearth  images_per_s={:.2} peak_rss_mb={:.1} (batch {batch}, {workers} workers, prefetch 4, {size}x{size}, {} images decoded-size {:.0} MB, auto augment {})",
        report.images_per_sec,
        report.peak_rss_mb,
        10 * per_class,
        (10 * per_class) as f64 * (side * side * 3) as f64 / 1e6,
        policy.as_deref().unwrap_or("none")
    );
    if smoke {
        return;
    }
    let Some(python) = torch_python() else {
        println!("peer: torchvision not found (scripts/setup_pytorch.sh); Hearth figures only");
        return;
    };
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/peer/torch_loader.py");
    let out = Command::new(python)
        .arg(script)
        .arg("--data")
        .arg(&data)
        .args([
            "--batch-size",
            &batch.to_string(),
            "--workers",
            &workers.to_string(),
        ])
        .args([
            "--size",
            &size.to_string(),
            "--batches",
            &batches.to_string(),
        ])
        .args(
            auto_augment
                .map(|p| vec!["--auto-augment".to_string(), p.to_string()])
                .unwrap_or_default(),
        )
        .output();
    let text = match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).to_string(),
        Ok(o) => {
            println!("peer failed: {}", String::from_utf8_lossy(&o.stderr));
            return;
        }
        Err(e) => {
            println!("peer failed to start: {e}");
            return;
        }
    };
    print!("{text}");
    let peer: Option<f64> = text
        .split_whitespace()
        .find_map(|w| w.strip_prefix("images_per_s="))
        .and_then(|v| v.parse().ok());
    if let Some(p) = peer {
        println!(
            "ratio hearth/torchvision: {:.2}x",
            report.images_per_sec / p
        );
    }
}
