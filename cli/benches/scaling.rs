//! Scaling to many hosts: measured where it can be, modelled where it cannot.
//!
//!   sudo -E cargo bench --bench scaling          (root: network namespaces)
//!   HEARTH_SCALING_RATES=1gbit HEARTH_SCALING_HOSTS=2,4 cargo bench --bench scaling
//!
//! 1. **Compute**: a training step (forward, backward, SGD) and a forward pass of the model on
//!    this machine (`ModelBench`, median of the timed steps); the backward pass is their
//!    difference (the optimizer update is counted in it).
//! 2. **Exchange**: ring allreduces of 10 MB and of the model's gradient bytes between 2-8
//!    hosts, each a network namespace whose link is shaped by `tc tbf` to each rate
//!    (`scripts/netns_allreduce.sh`); and the shared-memory allreduce of the gradients among
//!    `HEARTH_SCALING_PER_HOST` ranks of this host (the in-host part of a hierarchy).
//! 3. **Model** (`burn_dist::collective::cost`): per rate, the alpha-beta ring cost fitted to
//!    the 2-host runs (each rank has a core of its own, as on separate hosts). The larger host
//!    counts, which share this machine's cores, are predicted with that sharing (one core's
//!    transport speed is the fastest rate's 2-host fit, where the core and not the link is the
//!    limit; the bench warns when that fit is near its shaped rate) and compared with their
//!    measurements. The 2-host fit is then extrapolated to 512 separate hosts: images/s and
//!    scaling efficiency (one-host step / step), one rank per host and hierarchical hosts,
//!    with Hearth's exchange after the backward pass and with it overlapped (bucket by bucket
//!    as the backward pass produces them: what PyTorch DDP and Horovod do; Hearth does not yet),
//!    and with Hearth's transport or links at their shaped rate.
//! 4. The same model for a GPU-class step (`HEARTH_SCALING_GPU_IMG_S`: default PyTorch's
//!    ResNet-50 training rate on an H200 measured in BENCHMARKS.md, scaled by the models'
//!    multiply-adds), against Horovod's published 90% at 512 GPUs for ResNet-101.
//! 5. A PNG (`HEARTH_SCALING_PNG`, default `docs/scaling.png`) and the tables.
//!
//! Settings: `HEARTH_SCALING_MODEL` (resnet101), `_BATCH` (16), `_SIZE` (224), `_STEPS` (3),
//! `_RATES` (1gbit,10gbit,25gbit), `_HOSTS` (2,4,8), `_ITERS` (3), `_PER_HOST` (4),
//! `_BUCKET_MB` (25, `hearth train --bucket-mb`'s default), `_GPU_BATCH` (32).

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use burn_dist::collective::cost::{Hierarchy, LinkCost, StepCost};
use common::{env_f64, env_list, env_usize, parse_times};
use hearth::models::Architecture;
use hearth::plot::{ScalingPanel, plot_scaling};
use hearth_cli::bench::{BenchMode, ModelBench};

const HOSTS_MODELLED: [usize; 9] = [2, 4, 8, 16, 32, 64, 128, 256, 512];
/// Horovod (Sergeev and Del Balso, 2018): ResNet-101 on 128 servers of 4 Pascal GPUs, 25 Gbit/s
/// RoCE, 90% scaling efficiency.
const HOROVOD: (f64, f64) = (512.0, 0.90);
/// PyTorch's ResNet-50 training at batch 32 on one H200 (docs/benchmarks/gpu.md, "GPU: one NVIDIA H200":
/// 1,407 and 1,494 img/s); measured by the peer, not by Hearth.
const H200_RESNET50_IMG_S: f64 = 1_450.0;

/// Bits per second of a tc rate (`1gbit`, `500mbit`).
fn rate_bps(rate: &str) -> Option<f64> {
    let r = rate.to_ascii_lowercase();
    let num = r.strip_suffix("bit")?;
    let (digits, scale) = match num.chars().last()? {
        'k' => (&num[..num.len() - 1], 1e3),
        'm' => (&num[..num.len() - 1], 1e6),
        'g' => (&num[..num.len() - 1], 1e9),
        _ => (num, 1.0),
    };
    digits.parse::<f64>().ok().map(|d| d * scale)
}

fn size_label(mb: f64) -> String {
    if mb.fract() == 0.0 {
        format!("{}", mb as i64)
    } else {
        format!("{mb}")
    }
}

/// Median seconds per step of `mode` at `batch`.
fn step_seconds(
    arch: Architecture,
    mode: BenchMode,
    batch: usize,
    size: usize,
    steps: usize,
) -> f64 {
    let device = hearth::device::select("flex").unwrap_or_else(|e| {
        eprintln!("scaling: {e}");
        std::process::exit(1)
    });
    let bench = ModelBench {
        arch,
        mode,
        batch_size: batch,
        size,
        warmup: 1,
        steps,
        num_classes: 1000,
        precision: hearth::train::Precision::Fp32,
    };
    let report = bench
        .run(&device, |i, total, secs, warm| {
            eprintln!(
                "  {mode:?} step {}/{total}{}: {secs:.2} s",
                i + 1,
                if warm { " (warm-up)" } else { "" }
            )
        })
        .unwrap_or_else(|e| {
            eprintln!("scaling: {e}");
            std::process::exit(1)
        });
    let (median_img_s, _) = report.median_and_best(batch);
    batch as f64 / median_img_s
}

/// Runs `cmd` and reads its `size_mb=S time_ms=T` lines; a failure is printed, named `what`.
fn run_times(cmd: &mut Command, what: &str) -> Option<BTreeMap<String, f64>> {
    let out = cmd.output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        eprintln!(
            "{what} failed:\n{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        return None;
    }
    Some(parse_times(&text))
}

/// Mean ms of allreduces between `ranks` namespace hosts on links of `rate`, per size.
fn netns_allreduce(
    ranks: usize,
    rate: &str,
    sizes: &[f64],
    iters: usize,
) -> Option<BTreeMap<String, f64>> {
    let script = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .join("scripts/netns_allreduce.sh");
    let mut cmd = Command::new("bash");
    cmd.arg(script)
        .args(["--ranks", &ranks.to_string(), "--rate", rate])
        .args([
            "--iters",
            &iters.to_string(),
            "--bin",
            env!("CARGO_BIN_EXE_hearth"),
        ])
        .arg("--size-mb")
        .args(sizes.iter().map(|s| size_label(*s)));
    run_times(
        &mut cmd,
        &format!("netns allreduce ({ranks} hosts, {rate})"),
    )
}

/// Mean ms of the shared-memory allreduce of `mb` among `ranks` local processes.
fn shm_allreduce(ranks: usize, mb: f64, iters: usize) -> Option<f64> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_hearth"));
    cmd.args(["bench", "allreduce", "--ranks", &ranks.to_string()])
        .args(["--size-mb", &size_label(mb), "--iters", &iters.to_string()]);
    run_times(&mut cmd, "shm allreduce")?
        .get(&size_label(mb))
        .copied()
}

struct Scenario {
    name: String,
    step: StepCost,
    batch: usize,
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!(
            "scaling bench: run it with `cargo bench --bench scaling` (as root: network namespaces)"
        );
        return;
    }
    let model = std::env::var("HEARTH_SCALING_MODEL").unwrap_or_else(|_| "resnet101".into());
    let arch = Architecture::from_name(&model).unwrap_or_else(|e| {
        eprintln!("scaling: {e}");
        std::process::exit(2)
    });
    let batch = env_usize("HEARTH_SCALING_BATCH", 16);
    let size = env_usize("HEARTH_SCALING_SIZE", 224);
    let steps = env_usize("HEARTH_SCALING_STEPS", 3);
    let iters = env_usize("HEARTH_SCALING_ITERS", 3);
    let per_host = env_usize("HEARTH_SCALING_PER_HOST", 4);
    let bucket_bytes = env_f64("HEARTH_SCALING_BUCKET_MB", 25.0) * 1024.0 * 1024.0;
    let gpu_batch = env_usize("HEARTH_SCALING_GPU_BATCH", 32);
    let rates = env_list("HEARTH_SCALING_RATES", "1gbit,10gbit,25gbit");
    let mut hosts: Vec<usize> = env_list("HEARTH_SCALING_HOSTS", "2,4,8")
        .iter()
        .filter_map(|h| h.parse().ok())
        .filter(|&h| h >= 2)
        .collect();
    hosts.sort_unstable();
    hosts.dedup();
    let png = std::env::var("HEARTH_SCALING_PNG")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/..")).join("docs/scaling.png")
        });
    let grad_bytes = arch.torchvision_params() as f64 * 4.0;
    let grad_mb = (grad_bytes / 1e6).round();
    let buckets = (grad_bytes / bucket_bytes).ceil().max(1.0) as usize;

    // 1. Compute on this machine.
    println!(
        "scaling: {model} at {size}x{size}, batch {batch} per host, {grad_mb} MB of gradients in {buckets} buckets"
    );
    eprintln!("measuring a training step and a forward pass ...");
    let train_s = step_seconds(arch, BenchMode::Train, batch, size, steps);
    let fwd_s = step_seconds(arch, BenchMode::Infer, batch, size, steps).min(train_s);
    println!(
        "compute (this host, Flex): step {:.3} s, forward {:.3} s, backward and update {:.3} s",
        train_s,
        fwd_s,
        train_s - fwd_s
    );
    let cpu = Scenario {
        name: format!("{model}, this CPU's step ({train_s:.2} s, batch {batch})"),
        step: StepCost::even(fwd_s, train_s - fwd_s, 0.0, grad_bytes, buckets),
        batch,
    };
    // A GPU-class step: PyTorch's H200 rate for ResNet-50, scaled by multiply-adds; the
    // forward pass a third of the step, as in the usual 1:2 forward:backward split.
    let r50 = Architecture::from_name("resnet50")
        .map(|a| a.torchvision_gmacs())
        .unwrap_or(4.09);
    let gpu_img_s = env_f64(
        "HEARTH_SCALING_GPU_IMG_S",
        H200_RESNET50_IMG_S * r50 / arch.torchvision_gmacs(),
    );
    let gpu_step = gpu_batch as f64 / gpu_img_s;
    let gpu = Scenario {
        name: format!(
            "{model}, a GPU-class step ({:.0} ms, batch {gpu_batch}; PyTorch on H200, scaled)",
            gpu_step * 1e3
        ),
        step: StepCost::even(
            gpu_step / 3.0,
            gpu_step * 2.0 / 3.0,
            0.0,
            grad_bytes,
            buckets,
        ),
        batch: gpu_batch,
    };

    // 2. Exchange: shared memory in one host, shaped links between namespace hosts.
    let shm_ms = if per_host > 1 {
        eprintln!(
            "measuring the shared-memory allreduce of {grad_mb} MB among {per_host} ranks ..."
        );
        shm_allreduce(per_host, grad_mb, iters)
    } else {
        None
    };
    if let Some(ms) = shm_ms {
        println!(
            "in-host allreduce ({per_host} ranks, shared memory): {ms:.1} ms for {grad_mb} MB"
        );
    }
    let is_root = Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false);
    if !is_root {
        eprintln!(
            "scaling: the shaped links need network namespaces: run as root (sudo -E cargo bench --bench scaling)"
        );
        std::process::exit(1);
    }
    let sizes = [10.0, grad_mb];
    // rate -> [(hosts, bytes, seconds)]
    let mut measured: BTreeMap<String, Vec<(usize, f64, f64)>> = BTreeMap::new();
    for rate in &rates {
        for &n in &hosts {
            eprintln!("measuring allreduce between {n} namespace hosts at {rate} ...");
            let Some(times) = netns_allreduce(n, rate, &sizes, iters) else {
                continue;
            };
            for s in sizes {
                if let Some(ms) = times.get(&size_label(s)) {
                    measured
                        .entry(rate.clone())
                        .or_default()
                        .push((n, s * 1e6, ms / 1e3));
                }
            }
        }
    }

    // 3. Fit on the 2-host runs (each rank has a core of its own, as on separate hosts),
    // check the larger host counts on this machine (where the ranks share its cores), and
    // extrapolate to separate hosts.
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let fits: BTreeMap<String, LinkCost> = measured
        .iter()
        .filter_map(|(rate, samples)| {
            let own_cores: Vec<_> = samples.iter().copied().filter(|s| s.0 <= cores).collect();
            LinkCost::fit(&own_cores).map(|l| (rate.clone(), l))
        })
        .collect();
    // One core's transport: the fastest 2-host fit (at the high rates the link is not the
    // limit, the core is).
    let core_bps = fits.values().map(|l| l.bandwidth_bps).fold(0.0, f64::max);
    // That holds only where the fastest fit stays well under its shaped rate.
    if let Some((rate, l)) = fits
        .iter()
        .max_by(|a, b| a.1.bandwidth_bps.total_cmp(&b.1.bandwidth_bps))
        && rate_bps(rate).is_some_and(|b| l.bandwidth_bps * 8.0 > 0.5 * b)
    {
        println!(
            "warning: the fastest 2-host fit ({rate}) reaches over half its shaped rate, so the \
             link may be its limit and one core's speed is underestimated; measure a faster rate \
             (HEARTH_SCALING_RATES) for the shared-core predictions"
        );
    }
    println!();
    println!(
        "ring allreduce of {grad_mb} MB between namespace hosts on this machine's {cores} cores: measured, \
         and predicted by the fit on {cores} hosts with the cores shared (one core moves {:.3} GB/s)",
        core_bps / 1e9
    );
    println!(
        "{:<8} {:>6} {:>12} {:>13} {:>9}",
        "rate", "hosts", "measured ms", "predicted ms", "pred/meas"
    );
    for rate in &rates {
        let (Some(samples), Some(fit)) = (measured.get(rate), fits.get(rate)) else {
            continue;
        };
        for &(n, bytes, secs) in samples.iter().filter(|s| s.1 == grad_mb * 1e6) {
            let pred = fit.ring_allreduce_on_cores(n, bytes, cores, core_bps);
            println!(
                "{:<8} {:>6} {:>12.1} {:>13.1} {:>9.2}{}",
                rate,
                n,
                secs * 1e3,
                pred * 1e3,
                pred / secs,
                if n <= cores { "   (fitted here)" } else { "" }
            );
        }
    }
    for (rate, l) in &fits {
        let nominal = rate_bps(rate).map_or(String::new(), |b| {
            format!(
                " ({:.0}% of the shaped rate)",
                100.0 * l.bandwidth_bps * 8.0 / b
            )
        });
        println!(
            "fit on {cores} hosts, {rate}: alpha {:.3} ms per step, {:.3} GB/s per link{nominal}",
            l.alpha_s * 1e3,
            l.bandwidth_bps / 1e9
        );
    }
    // Hearth's transport on separate hosts, and a transport at the shaped rate less the
    // headers (what RDMA and NCCL come near), with the same per-step alpha.
    let line_rate: BTreeMap<String, LinkCost> = fits
        .iter()
        .filter_map(|(rate, l)| {
            rate_bps(rate).map(|b| {
                (
                    rate.clone(),
                    LinkCost {
                        alpha_s: l.alpha_s,
                        bandwidth_bps: b / 8.0 * 0.94,
                    },
                )
            })
        })
        .collect();

    let local_bps = shm_ms.map(|ms| 2.0 * grad_bytes / (ms / 1e3));
    let mut panels = Vec::new();
    let line_name = format!("{}, links at line rate", gpu.name);
    for (panel, (sc, links, name)) in [
        (&cpu, &fits, cpu.name.clone()),
        (&gpu, &fits, gpu.name.clone()),
        (&gpu, &line_rate, line_name),
    ]
    .into_iter()
    .enumerate()
    {
        println!();
        println!("{name}");
        println!(
            "{:<8} {:<22} {}",
            "rate",
            "layout",
            HOSTS_MODELLED.map(|h| format!("{h:>12}")).join("")
        );
        let mut curves = Vec::new();
        let mut points = Vec::new();
        for (rate, link) in links {
            // A layout's allreduce time for (hosts, bytes).
            type Cost<'a> = Box<dyn Fn(usize, f64) -> f64 + 'a>;
            let mut layouts: Vec<(String, Cost<'_>)> = vec![(
                "1 rank/host".into(),
                Box::new(move |n: usize, b: f64| link.ring_allreduce(n, b)),
            )];
            if let Some(local_bps) = local_bps {
                let h = Hierarchy {
                    per_host,
                    local_bps,
                    between: *link,
                };
                layouts.push((
                    format!("{per_host} ranks/host"),
                    Box::new(move |n: usize, b: f64| h.allreduce(n, b)),
                ));
            }
            for (li, (layout, cost)) in layouts.iter().enumerate() {
                for overlap in [false, true] {
                    let eff: Vec<(f64, f64)> = HOSTS_MODELLED
                        .iter()
                        .map(|&n| (n as f64, sc.step.efficiency(overlap, |b| cost(n, b))))
                        .collect();
                    let ranks = |n: usize| if li == 0 { n } else { n * per_host };
                    let img_s: Vec<String> = HOSTS_MODELLED
                        .iter()
                        .map(|&n| {
                            let step = sc.step.step_s(overlap, |b| cost(n, b));
                            format!("{:>12.0}", ranks(n) as f64 * sc.batch as f64 / step)
                        })
                        .collect();
                    let eff_s: Vec<String> = eff
                        .iter()
                        .map(|e| format!("{:>11.1}%", e.1 * 100.0))
                        .collect();
                    let what = format!("{layout}{}", if overlap { ", overlap" } else { "" });
                    println!("{rate:<8} {what:<22} {}   (efficiency)", eff_s.join(""));
                    println!("{:<8} {:<22} {}   (images/s)", "", "", img_s.join(""));
                    if li == 0 || !overlap {
                        let label =
                            format!("{rate}, {layout}{}", if overlap { ", overlap" } else { "" });
                        curves.push((label, eff));
                    }
                }
            }
            // The measured parts: this machine's step with the exchange measured here (its
            // hosts share 2 cores: above 2 hosts, slower than separate hosts would be).
            if let Some(samples) = measured.get(rate).filter(|_| panel == 0) {
                let pts: Vec<(f64, f64)> = samples
                    .iter()
                    .filter(|s| s.1 == grad_mb * 1e6)
                    .map(|&(n, _, secs)| {
                        let per_bucket = secs / sc.step.buckets.len() as f64;
                        (n as f64, sc.step.efficiency(false, |_| per_bucket))
                    })
                    .collect();
                points.push((
                    format!("{rate}, measured exchange (hosts share {cores} cores)"),
                    pts,
                ));
            }
        }
        panels.push(ScalingPanel {
            title: name.clone(),
            curves,
            measured: points,
            references: if model == "resnet101" {
                vec![(
                    "Horovod, ResNet-101, 512 GPUs, 25 Gbit/s RoCE".into(),
                    HOROVOD,
                )]
            } else {
                vec![]
            },
        });
    }
    if let Some(dir) = png.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    match plot_scaling(&panels, &png) {
        Ok(()) => println!("\nplot: {}", png.display()),
        Err(e) => eprintln!("scaling: {e}"),
    }
}
