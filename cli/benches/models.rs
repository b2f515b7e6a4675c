//! Model throughput, Hearth vs PyTorch on the same machine in the same run.
//!
//! For ResNet-50, DenseNet-121 and VGG-16 at 224x224 on Flex: forward at batch 1 and 16, and a
//! training step (forward, cross-entropy, backward, SGD with momentum) at batch 16. Each config
//! runs in Hearth, then in PyTorch (benches/peer/torch_models.py), and prints the ratio
//! Hearth/PyTorch of images per second (above 1: Hearth is faster).
//!
//!   cargo bench --bench models
//!   HEARTH_BENCH_STEPS=8 HEARTH_BENCH_MODELS=resnet50 cargo bench --bench models
//!   cargo bench --bench models -- --precision bf16     (or HEARTH_BENCH_PRECISION=bf16)
//!
//! With `--precision bf16|fp16` both sides compute in that type: Hearth with f32 master weights
//! (`hearth train --precision`, fp16 with loss scaling), PyTorch under `torch.autocast` (fp16
//! training with `GradScaler`). The table then also runs Hearth in fp32 and prints Hearth's
//! own low-precision speed-up (`vs f32`).
//!
//! Both sides report images/s at their median step and at their best (fastest) step; the
//! ratios compare medians and bests. On the CPU the batch-1 rows run `HEARTH_BENCH_STEPS`
//! times the batch (16) steps, so that every row times about as many images. Each
//! configuration runs `HEARTH_BENCH_ROUNDS` rounds (default 3) of Hearth then the peer; the
//! figures are the median of the rounds' medians and the best of their bests, and the ratio is
//! followed by the range of the rounds' ratios.
//!
//! PyTorch comes from $HEARTH_TORCH_PYTHON, else ~/.cache/hearth/venv-torch/bin/python
//! (scripts/setup_pytorch.sh); without it only Hearth's numbers are printed.
//!
//! On a GPU: `HEARTH_DEVICE=cuda` (or wgpu, vulkan) runs Hearth there and the peer on CUDA
//! (`HEARTH_PEER_DEVICE` overrides: cpu, cuda:1, ...). The configurations there are issue 24's
//! table: inference at batch 1 and 32, training at batch 32 and 64, and the peer also runs
//! in `channels_last` (the `pt CL` columns). The share of the GPU's peak is against its dense
//! TF32 tensor-core peak, looked up from the name the peer reports (H100, H200, A100; else
//! `HEARTH_PEAK_GFLOPS`). Autotune runs in the first steps: keep `HEARTH_BENCH_WARMUP` at 3 or
//! more there. On the CPU, `HEARTH_BENCH_BATCH` sets the batch of the batched configurations
//! (default 16). On either, `HEARTH_BENCH_BATCHES=infer:1,train:16` picks the configurations
//! (on the CPU a batch below `HEARTH_BENCH_BATCH` still runs that many times the steps).

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{env_usize, median, torch_python};

use hearth::models::Architecture;
use hearth_cli::bench::{BenchMode, ModelBench};

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

/// The peer's figures for one configuration: images/s at its median and best step, and the
/// GPU's name (`cpu` on the CPU).
struct PeerRun {
    median: f64,
    best: f64,
    gpu: String,
}

#[allow(clippy::too_many_arguments)]
fn peer(
    python: &PathBuf,
    device: &str,
    model: &str,
    mode: &str,
    batch: usize,
    steps: usize,
    warmup: usize,
    channels_last: bool,
    precision: hearth::train::Precision,
) -> Option<PeerRun> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/peer/torch_models.py");
    let mut cmd = Command::new(python);
    cmd.arg(script)
        .args(["--model", model, "--mode", mode, "--device", device])
        .args(["--batch-size", &batch.to_string(), "--size", "224"])
        .args([
            "--steps",
            &steps.to_string(),
            "--warmup",
            &warmup.to_string(),
        ]);
    if channels_last {
        cmd.arg("--channels-last");
    }
    cmd.args(["--precision", precision.name()]);
    let out = cmd.output().ok()?;
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
    let gpu = text
        .split_whitespace()
        .find_map(|w| w.strip_prefix("gpu="))
        .unwrap_or("cpu")
        .to_string();
    Some(PeerRun {
        median: field("median_images_per_s=")?,
        best: field("best_images_per_s=")?,
        gpu,
    })
}

/// Dense TF32 tensor-core peak in GFLOP/s of a GPU the peer named (SXM figures for H100 and
/// H200, which share the compute die; the PCIe H100 is lower), or `HEARTH_PEAK_GFLOPS`.
fn gpu_peak_gflops(name: &str) -> Option<f64> {
    if let Some(p) = std::env::var("HEARTH_PEAK_GFLOPS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        return Some(p);
    }
    let n = name.to_ascii_uppercase();
    if n.contains("H100") && n.contains("PCIE") {
        Some(378_000.0)
    } else if n.contains("H100") || n.contains("H200") {
        Some(494_700.0)
    } else if n.contains("A100") {
        Some(156_000.0)
    } else {
        None
    }
}

/// The configurations: `HEARTH_BENCH_BATCHES` (`infer:1,train:32`), else `default` (on a GPU
/// issue 24's table, on the CPU batch 1 and the batched inference and training).
fn configs(default: &str) -> Vec<(BenchMode, &'static str, usize)> {
    let spec = std::env::var("HEARTH_BENCH_BATCHES").unwrap_or_else(|_| default.into());
    let mut out = Vec::new();
    for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let parsed = item.split_once(':').and_then(|(mode, b)| {
            let b: usize = b.trim().parse().ok().filter(|&b| b > 0)?;
            match mode.trim() {
                "infer" => Some((BenchMode::Infer, "infer", b)),
                "train" => Some((BenchMode::Train, "train", b)),
                _ => None,
            }
        });
        match parsed {
            Some(c) => out.push(c),
            None => {
                eprintln!("HEARTH_BENCH_BATCHES: '{item}' is not infer:B or train:B");
                std::process::exit(1);
            }
        }
    }
    out
}

fn main() {
    common::freed_memory_policy();
    // As the `hearth` binary: this thread one of the kernels' (`HEARTH_JOIN_POOL=0` opts out).
    println!(
        "main thread in the kernels' pool: {}",
        hearth::kernels::join_global_pool()
    );
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
    let batched = batch;
    let rounds = env_usize("HEARTH_BENCH_ROUNDS", if smoke { 1 } else { 3 }).max(1);
    let precision = bench_precision();
    println!("hearth device: {device_name}; precision {precision}");
    match &python {
        Some(p) => println!("peer: PyTorch on {peer_device} via {}", p.display()),
        None if !smoke => println!(
            "peer: PyTorch not found (set HEARTH_TORCH_PYTHON or run scripts/setup_pytorch.sh); Hearth figures only"
        ),
        None => {}
    }
    let on_cpu = hearth_kernels::is_cpu(&device);
    let cpu_peak = hearth_cli::bench::cpu_peak_gflops().filter(|_| on_cpu);
    if let Some(p) = cpu_peak {
        println!(
            "CPU peak (measured FMA rate, all cores): {p:.0} GFLOP/s (HEARTH_PEAK_GFLOPS overrides)"
        );
    }
    // On a GPU the peer also runs in channels_last, when it runs on CUDA.
    let channels_last = !on_cpu && peer_device.starts_with("cuda");
    let mut gpu_peak: Option<(String, Option<f64>)> = None;
    println!(
        "{:<12} {:<6} {:>5} {:>16} {:>16} {:>20} {:>8} {:>14} {:>16} {:>8}",
        "model",
        "mode",
        "batch",
        "hearth med/best",
        "pytorch med/best",
        "ratio",
        "best",
        "peak h/pt",
        "pt CL med/best",
        "ratio CL"
    );
    for name in models.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let arch = match Architecture::from_name(name) {
            Ok(a) => a,
            Err(e) => {
                eprintln!("{e}");
                std::process::exit(1);
            }
        };
        let configs: Vec<(BenchMode, &str, usize)> = if smoke {
            vec![(BenchMode::Infer, "infer", 1)]
        } else if on_cpu {
            configs(&format!("infer:1,infer:{batch},train:{batch}"))
        } else {
            configs("infer:1,infer:32,train:32,train:64")
        };
        for (mode, mode_name, batch) in configs {
            // On the CPU every configuration times about as many images: a step at batch 1 is
            // ~16x shorter than one at 16, and a handful of them is within the machine's
            // noise, so the batch-1 rows take 16 times the steps (BENCHMARKS.md, 2026-11-26).
            let steps = if on_cpu && !smoke {
                steps * (batched / batch.max(1)).max(1)
            } else {
                steps
            };
            let bench = ModelBench {
                arch,
                mode,
                batch_size: batch,
                size: if smoke { 32 } else { 224 },
                warmup,
                steps,
                num_classes: 1000,
                precision,
            };
            let run_peer = |cl: bool| {
                python.as_ref().and_then(|p| {
                    peer(
                        p,
                        &peer_device,
                        arch.name(),
                        mode_name,
                        batch,
                        steps,
                        warmup,
                        cl,
                        precision,
                    )
                })
            };
            // Rounds of Hearth then the peer, so that a drift of the machine's speed reaches
            // both sides; each round's ratio is kept for the range.
            let mut hearth_runs = Vec::with_capacity(rounds);
            let mut torch_runs: Vec<Option<PeerRun>> = Vec::with_capacity(rounds);
            let mut torch_cl_runs: Vec<Option<PeerRun>> = Vec::with_capacity(rounds);
            for _ in 0..rounds {
                hearth_runs.push(match bench.run(&device, |_, _, _, _| {}) {
                    Ok(r) => r.median_and_best(batch),
                    Err(e) => {
                        eprintln!("{name} {mode_name}: {e}");
                        std::process::exit(1);
                    }
                });
                torch_runs.push(run_peer(false));
                torch_cl_runs.push(if channels_last { run_peer(true) } else { None });
            }
            let hearth = (
                median(hearth_runs.iter().map(|h| h.0)),
                hearth_runs.iter().map(|h| h.1).fold(0.0, f64::max),
            );
            let (torch, torch_range) = combine(&hearth_runs, &torch_runs);
            let (torch_cl, _) = combine(&hearth_runs, &torch_cl_runs);
            // Hearth's own speed-up over f32 in a low-precision run, at the median step.
            let own = if precision.is_low() {
                let f32_bench = ModelBench {
                    precision: hearth::train::Precision::Fp32,
                    ..bench.clone()
                };
                match f32_bench.run(&device, |_, _, _, _| {}) {
                    Ok(r) => format!(" vs f32 {:.2}x", hearth.0 / r.median_and_best(batch).0),
                    Err(e) => format!(" vs f32: {e}"),
                }
            } else {
                String::new()
            };
            if !on_cpu
                && gpu_peak.is_none()
                && let Some(t) = &torch
            {
                let p = gpu_peak_gflops(&t.gpu);
                match p {
                    Some(p) => println!("GPU {}: dense TF32 peak {p:.0} GFLOP/s", t.gpu),
                    None => println!("GPU {}: peak unknown (set HEARTH_PEAK_GFLOPS)", t.gpu),
                }
                gpu_peak = Some((t.gpu.clone(), p));
            }
            let peak = cpu_peak.or(gpu_peak.as_ref().and_then(|g| g.1));
            // Fraction of the device's peak at the median step, Hearth / PyTorch.
            let share = |images: f64| {
                peak.map(|p| format!("{:.1}%", 100.0 * images * bench.gflop_per_image() / p))
                    .unwrap_or_else(|| "-".into())
            };
            let (t, r, rb, tp) = match &torch {
                Some(p) => (
                    format!("{:.2}/{:.2}", p.median, p.best),
                    format!("{:.2}x{torch_range}", hearth.0 / p.median),
                    format!("{:.2}x", hearth.1 / p.best),
                    share(p.median),
                ),
                None => ("-".into(), "-".into(), "-".into(), "-".into()),
            };
            let (tcl, rcl) = match &torch_cl {
                Some(p) => (
                    format!("{:.2}/{:.2}", p.median, p.best),
                    format!("{:.2}x", hearth.0 / p.median),
                ),
                None => ("-".into(), "-".into()),
            };
            println!(
                "{:<12} {:<6} {:>5} {:>16} {:>16} {:>20} {:>8} {:>14} {:>16} {:>8}{own}",
                arch.name(),
                mode_name,
                batch,
                format!("{:.2}/{:.2}", hearth.0, hearth.1),
                t,
                r,
                rb,
                format!("{}/{tp}", share(hearth.0)),
                tcl,
                rcl
            );
        }
    }
}

/// The peer's rounds as one run (the median of its medians, the best of its bests) and, with
/// more than one round, the range of the per-round ratios Hearth / peer at the median step.
fn combine(hearth: &[(f64, f64)], peer: &[Option<PeerRun>]) -> (Option<PeerRun>, String) {
    let runs: Vec<(&(f64, f64), &PeerRun)> = hearth
        .iter()
        .zip(peer)
        .filter_map(|(h, p)| p.as_ref().map(|p| (h, p)))
        .collect();
    let Some(first) = runs.first() else {
        return (None, String::new());
    };
    let ratios: Vec<f64> = runs.iter().map(|(h, p)| h.0 / p.median).collect();
    let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = ratios.iter().copied().fold(0.0, f64::max);
    let combined = PeerRun {
        median: median(runs.iter().map(|r| r.1.median)),
        best: runs.iter().map(|r| r.1.best).fold(0.0, f64::max),
        gpu: first.1.gpu.clone(),
    };
    let range = if runs.len() > 1 {
        format!(" ({lo:.2}-{hi:.2})")
    } else {
        String::new()
    };
    (Some(combined), range)
}

/// `--precision X` after `cargo bench --bench models --`, else `HEARTH_BENCH_PRECISION`, else
/// fp32.
fn bench_precision() -> hearth::train::Precision {
    let args: Vec<String> = std::env::args().collect();
    let named = args
        .windows(2)
        .find(|w| w[0] == "--precision")
        .map(|w| w[1].clone())
        .or_else(|| std::env::var("HEARTH_BENCH_PRECISION").ok());
    match named {
        None => hearth::train::Precision::Fp32,
        Some(p) => p.parse().unwrap_or_else(|_| {
            eprintln!("bench: --precision {p}: expected fp32, bf16 or fp16");
            std::process::exit(2);
        }),
    }
}
