//! Data pipeline throughput and memory, Hearth vs torchvision in the same run.
//!
//! Generates a synthetic JPEG image folder (default 1,500 images of 320x320, ~0.46 GB decoded,
//! far beyond the prefetch window), then streams training batches (decode, RandomResizedCrop
//! 224, flip, normalise, batch to a tensor) with Hearth's loader and with torchvision's
//! ImageFolder + DataLoader at the same worker count. Each policy runs `HEARTH_BENCH_ROUNDS`
//! rounds (default 3) of Hearth then torchvision, so that a drift of the machine's speed
//! reaches both sides; it prints each round, then the medians, their ratio, the range of the
//! rounds' ratios and the peak RSS.
//!
//!   cargo bench --bench loader
//!   HEARTH_BENCH_WORKERS=2 HEARTH_BENCH_BATCHES=20 HEARTH_BENCH_ROUNDS=5 cargo bench --bench loader
//!   HEARTH_BENCH_AUTO_AUGMENT=none,rand-m9-n2,trivialaugment,augmix cargo bench --bench loader
//!
//! `HEARTH_BENCH_AUTO_AUGMENT` is a comma-separated list of policies applied after the crop and
//! flip on both sides (`none`: the recipe alone, the default).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{cpu, env_list, env_usize, median, torch_python};

use hearth::datasets::AutoAugment;
use hearth::datasets::synth::{SynthConfig, generate};
use hearth_cli::bench::loader::LoaderBench;

/// One side's rounds: images/s of each, and the largest peak RSS (MB) any of them reported.
#[derive(Default)]
struct Side {
    rates: Vec<f64>,
    peak_rss_mb: f64,
}

impl Side {
    fn add(&mut self, rate: f64, rss: f64) {
        self.rates.push(rate);
        self.peak_rss_mb = self.peak_rss_mb.max(rss);
    }

    /// `median (lowest-highest)` of the rounds' images/s.
    fn describe(&self) -> String {
        let lo = self.rates.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = self.rates.iter().copied().fold(0.0, f64::max);
        format!(
            "{:.1} ({lo:.1}-{hi:.1})",
            median(self.rates.iter().copied())
        )
    }
}

fn main() {
    let smoke = !std::env::args().any(|a| a == "--bench");
    let per_class = env_usize("HEARTH_BENCH_PER_CLASS", if smoke { 4 } else { 150 });
    let side = env_usize("HEARTH_BENCH_IMAGE", if smoke { 64 } else { 320 }) as u32;
    let workers = env_usize("HEARTH_BENCH_WORKERS", 2);
    let batch = env_usize("HEARTH_BENCH_BATCH", if smoke { 8 } else { 64 });
    let batches = env_usize("HEARTH_BENCH_BATCHES", if smoke { 2 } else { 20 });
    let rounds = env_usize("HEARTH_BENCH_ROUNDS", if smoke { 1 } else { 3 }).max(1);
    let size = if smoke { 32 } else { 224 };
    // RandAugment, TrivialAugmentWide or AugMix after the crop and flip, on both sides.
    let mut policies: Vec<Option<AutoAugment>> = Vec::new();
    for name in env_list("HEARTH_BENCH_AUTO_AUGMENT", "none") {
        policies.push(match name.as_str() {
            "none" => None,
            other => match other.parse() {
                Ok(p) => Some(p),
                Err(e) => {
                    eprintln!("bench: HEARTH_BENCH_AUTO_AUGMENT: {e}");
                    std::process::exit(1);
                }
            },
        });
    }
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
    let python = if smoke { None } else { torch_python() };
    println!(
        "loader bench on {}: batch {batch}, {workers} workers, prefetch 4, {size}x{size}, {batches} timed batches, {} images ({:.0} MB decoded), {rounds} round(s) per policy",
        cpu(),
        10 * per_class,
        (10 * per_class) as f64 * (side * side * 3) as f64 / 1e6,
    );
    if python.is_none() && !smoke {
        println!("peer: torchvision not found (scripts/setup_pytorch.sh); Hearth figures only");
    }
    let device = burn::prelude::Device::flex();
    let mut summary = Vec::new();
    for policy in policies {
        let name = policy.map_or("none".to_string(), |p| p.to_string());
        let bench = LoaderBench {
            batch_size: batch,
            workers,
            prefetch: 4,
            size,
            batches,
            auto_augment: policy,
        };
        let (mut hearth, mut peer) = (Side::default(), Side::default());
        let mut ratios = Vec::new();
        for round in 1..=rounds {
            let report = match bench.run(&data, &device, |_, _| {}) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("bench: {name}: {e}");
                    std::process::exit(1);
                }
            };
            hearth.add(report.images_per_sec, report.peak_rss_mb);
            let mut line = format!(
                "{name:<20} round {round}: hearth {:.1} images/s",
                report.images_per_sec
            );
            if let Some(python) = &python {
                match run_peer(python, &data, &bench) {
                    Ok((rate, rss)) => {
                        peer.add(rate, rss);
                        ratios.push(report.images_per_sec / rate);
                        line += &format!(
                            ", torchvision {rate:.1}, ratio {:.2}x",
                            report.images_per_sec / rate
                        );
                    }
                    Err(e) => line += &format!(", torchvision failed: {e}"),
                }
            }
            println!("{line}");
        }
        summary.push((name, hearth, peer, ratios));
    }
    println!(
        "\n{:<20} {:>22} {:>22} {:>8} {:>14} {:>18}",
        "policy",
        "hearth img/s med",
        "torchvision med",
        "ratio",
        "rounds' ratio",
        "peak RSS h/tv MB"
    );
    for (name, hearth, peer, ratios) in &summary {
        let ratio = median(hearth.rates.iter().copied()) / median(peer.rates.iter().copied());
        let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = ratios.iter().copied().fold(0.0, f64::max);
        let (peer_text, ratio_text, range_text, peer_rss) = if peer.rates.is_empty() {
            (
                "-".to_string(),
                "-".to_string(),
                "-".to_string(),
                "-".to_string(),
            )
        } else {
            (
                peer.describe(),
                format!("{ratio:.2}x"),
                format!("{lo:.2}-{hi:.2}x"),
                format!("{:.0}", peer.peak_rss_mb),
            )
        };
        println!(
            "{name:<20} {:>22} {peer_text:>22} {ratio_text:>8} {range_text:>14} {:>8.0} / {peer_rss}",
            hearth.describe(),
            hearth.peak_rss_mb,
        );
    }
}

/// torchvision's `DataLoader` on the same folder and settings: (images/s, peak RSS in MB).
fn run_peer(python: &Path, data: &Path, bench: &LoaderBench) -> Result<(f64, f64), String> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/peer/torch_loader.py");
    let mut cmd = Command::new(python);
    cmd.arg(script).arg("--data").arg(data);
    for (flag, value) in [
        ("--batch-size", bench.batch_size),
        ("--workers", bench.workers),
        ("--size", bench.size as usize),
        ("--batches", bench.batches),
    ] {
        cmd.args([flag.to_string(), value.to_string()]);
    }
    if let Some(p) = bench.auto_augment {
        cmd.args(["--auto-augment".to_string(), p.to_string()]);
    }
    let out = cmd.output().map_err(|e| format!("did not start: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
    }
    let field = |key: &str| -> Option<f64> {
        text.split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .and_then(|v| v.parse().ok())
    };
    match (field("images_per_s="), field("peak_rss_mb=")) {
        (Some(rate), Some(rss)) => Ok((rate, rss)),
        _ => Err(format!("no figures in its output: {text:?}")),
    }
}
