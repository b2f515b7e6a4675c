//! Model throughput, Hearth vs PyTorch on the same machine in the same run.
//!
//! For ResNet-50, DenseNet-121 and VGG-16 at 224x224 on Flex: forward at batch 1 and 16, and a
//! training step (forward, cross-entropy, backward, SGD with momentum) at batch 16. Each config
//! runs in Hearth, then in PyTorch (benches/peer/torch_models.py), and prints the ratio
//! Hearth/PyTorch of images per second (above 1: Hearth is faster).
//!
//!   cargo bench --bench models
//!   HEARTH_BENCH_STEPS=8 HEARTH_BENCH_MODELS=resnet50 cargo bench --bench models
//!
//! Both sides report images/s at their median step and at their best (fastest) step; the
//! ratios compare medians and bests.
//!
//! PyTorch comes from $HEARTH_TORCH_PYTHON, else ~/.cache/hearth/venv-torch/bin/python
//! (scripts/setup_pytorch.sh); without it only Hearth's numbers are printed.
//!
//! On a GPU: `HEARTH_DEVICE=cuda` (or wgpu, vulkan) runs Hearth there and the peer on CUDA
//! (`HEARTH_PEER_DEVICE` overrides: cpu, cuda:1, ...); `HEARTH_BENCH_BATCH` sets the batch of
//! the batched configurations (default 16).

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{env_usize, torch_python};

use hearth::bench::{BenchMode, ModelBench};
use hearth::models::Architecture;

/// The peer's device: `$HEARTH_PEER_DEVICE`, else CUDA when Hearth runs on a GPU, else CPU.
fn peer_device(hearth_device: &str) -> String {
    if let Ok(d) = std::env::var("HEARTH_PEER_DEVICE") {
        return d;
    }
    let base = hearth_device.split(':').next().unwrap_or("");
    match base {
        "cuda" | "wgpu" | "vulkan" => "cuda".into(),
        _ => "cpu".into(),
    }
}

fn peer(
    python: &PathBuf,
    device: &str,
    model: &str,
    mode: &str,
    batch: usize,
    steps: usize,
    warmup: usize,
) -> Option<(f64, f64)> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/peer/torch_models.py");
    let out = Command::new(python)
        .arg(script)
        .args(["--model", model, "--mode", mode, "--device", device])
        .args(["--batch-size", &batch.to_string(), "--size", "224"])
        .args([
            "--steps",
            &steps.to_string(),
            "--warmup",
            &warmup.to_string(),
        ])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        eprintln!("peer failed: {}", String::from_utf8_lossy(&out.stderr));
        return None;
    }
    let field = |name: &str| -> Option<f64> {
        text.split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .and_then(|v| v.parse().ok())
    };
    Some((field("median_images_per_s=")?, field("best_images_per_s=")?))
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` would pass nothing: do a tiny run.
    let smoke = !std::env::args().any(|a| a == "--bench");
    let steps = env_usize("HEARTH_BENCH_STEPS", if smoke { 1 } else { 5 });
    let warmup = env_usize("HEARTH_BENCH_WARMUP", if smoke { 0 } else { 1 });
    let models = std::env::var("HEARTH_BENCH_MODELS")
        .unwrap_or_else(|_| "resnet50,densenet121,vgg16".into());
    let device_name = std::env::var("HEARTH_DEVICE").unwrap_or_else(|_| "flex".into());
    let device = match hearth::device::select(&device_name) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("bench: {e}");
            std::process::exit(1);
        }
    };
    if smoke {
        println!("models bench: smoke mode (run with `cargo bench --bench models` for figures)");
    }
    let python = if smoke { None } else { torch_python() };
    let peer_device = peer_device(&device_name);
    let batch = env_usize("HEARTH_BENCH_BATCH", 16);
    println!("hearth device: {device_name}");
    match &python {
        Some(p) => println!("peer: PyTorch on {peer_device} via {}", p.display()),
        None if !smoke => println!(
            "peer: PyTorch not found (set HEARTH_TORCH_PYTHON or run scripts/setup_pytorch.sh); Hearth figures only"
        ),
        None => {}
    }
    let peak = hearth::bench::cpu_peak_gflops().filter(|_| hearth_kernels::is_cpu(&device));
    if let Some(p) = peak {
        println!("CPU nominal peak: {p:.0} GFLOP/s (HEARTH_PEAK_GFLOPS overrides)");
    }
    println!(
        "{:<12} {:<6} {:>5} {:>16} {:>16} {:>8} {:>8} {:>14}",
        "model",
        "mode",
        "batch",
        "hearth med/best",
        "pytorch med/best",
        "ratio",
        "best",
        "peak h/pt"
    );
    for name in models.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let arch = match Architecture::from_name(name) {
            Ok(a) => a,
            Err(e) => {
                eprintln!("{e}");
                std::process::exit(1);
            }
        };
        let configs: &[(BenchMode, &str, usize)] = if smoke {
            &[(BenchMode::Infer, "infer", 1)]
        } else {
            &[
                (BenchMode::Infer, "infer", 1),
                (BenchMode::Infer, "infer", batch),
                (BenchMode::Train, "train", batch),
            ]
        };
        for &(mode, mode_name, batch) in configs {
            let bench = ModelBench {
                arch,
                mode,
                batch_size: batch,
                size: if smoke { 32 } else { 224 },
                warmup,
                steps,
                num_classes: 1000,
            };
            let hearth = match bench.run(&device, |_, _, _, _| {}) {
                Ok(r) => r.median_and_best(batch),
                Err(e) => {
                    eprintln!("{name} {mode_name}: {e}");
                    std::process::exit(1);
                }
            };
            let torch = python.as_ref().and_then(|p| {
                peer(
                    p,
                    &peer_device,
                    arch.name(),
                    mode_name,
                    batch,
                    steps,
                    warmup,
                )
            });
            // Fraction of the CPU's peak at the median step, Hearth / PyTorch.
            let share = |images: f64| {
                peak.map(|p| format!("{:.0}%", 100.0 * images * bench.gflop_per_image() / p))
                    .unwrap_or_else(|| "-".into())
            };
            let (t, r, rb, tp) = match torch {
                Some((m, b)) => (
                    format!("{m:.2}/{b:.2}"),
                    format!("{:.2}x", hearth.0 / m),
                    format!("{:.2}x", hearth.1 / b),
                    share(m),
                ),
                None => ("-".into(), "-".into(), "-".into(), "-".into()),
            };
            println!(
                "{:<12} {:<6} {:>5} {:>16} {:>16} {:>8} {:>8} {:>14}",
                arch.name(),
                mode_name,
                batch,
                format!("{:.2}/{:.2}", hearth.0, hearth.1),
                t,
                r,
                rb,
                format!("{}/{tp}", share(hearth.0))
            );
        }
    }
}
