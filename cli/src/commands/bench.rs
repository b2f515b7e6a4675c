//! `hearth bench`: model, loader and allreduce throughput.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use hearth::dist::Compression;
use hearth::models::Architecture;
use hearth_cli::bench::{BenchMode, ModelBench};

use crate::commands::exit::exit_with;

#[derive(Subcommand)]
pub(crate) enum BenchCommand {
    /// Images/s of a model's forward pass or training step on random data.
    Model(BenchModelArgs),
    /// Images/s of the training data pipeline (decode, augmentation, batch to a tensor).
    Loader(BenchLoaderArgs),
    /// Allreduce among local ranks (shared memory; QUIC with HEARTH_SHM=0): time, algbw, busbw.
    Allreduce(BenchAllreduceArgs),
    /// One rank of an allreduce benchmark, inside a job (`bench allreduce` starts its own;
    /// `hearth launch -n N -- hearth bench allreduce-rank` or another launcher starts them).
    AllreduceRank(BenchAllreduceArgs),
}

#[derive(Args, Clone)]
pub(crate) struct BenchAllreduceArgs {
    /// Number of ranks (local processes).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Buffer sizes in MB (10^6 bytes).
    #[arg(long, num_args = 1.., default_values_t = [1.0, 10.0, 100.0])]
    size_mb: Vec<f64>,
    /// Timed allreduces per size.
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Untimed allreduces per size.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Wire format of the values.
    #[arg(long, value_enum, default_value_t = Compression::None)]
    compression: Compression,
    /// Whose memory the buffer is: each rank's own vector (as a caller's tensor), or memory
    /// from the communicator that the host's ranks all map (summed in place).
    #[arg(long, value_enum, default_value_t = BenchBuffer::Own)]
    buffer: BenchBuffer,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum BenchBuffer {
    /// Each rank's own vector.
    Own,
    /// `Communicator::reduce_buffer`: shared memory on one host (a vector elsewhere).
    Shared,
}

#[derive(Args)]
pub(crate) struct BenchLoaderArgs {
    /// An image folder (root/<class>/<image>).
    #[arg(long)]
    data: PathBuf,
    /// Images per batch.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Decoding threads.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Batches in flight.
    #[arg(long, default_value_t = 4)]
    prefetch: usize,
    /// Output side in pixels.
    #[arg(long, default_value_t = 224)]
    size: u32,
    /// Timed batches (after one warm-up batch).
    #[arg(long, default_value_t = 20)]
    batches: usize,
    /// RandAugment or TrivialAugmentWide after the crop and flip, as `hearth train
    /// --auto-augment` takes it (rand-mM-nN or trivialaugment).
    #[arg(long, value_name = "POLICY")]
    auto_augment: Option<String>,
}

#[derive(Args)]
pub(crate) struct BenchModelArgs {
    /// A torchvision name (resnet50, densenet121, vgg16, ...); the PyTorch peer runs the same.
    #[arg(long)]
    model: String,
    /// train (forward, backward, SGD step) or infer (forward in evaluation mode).
    #[arg(long, value_enum, default_value_t = BenchMode::Infer)]
    mode: BenchMode,
    /// Images per step.
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Input side in pixels.
    #[arg(long, default_value_t = 224)]
    size: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Untimed warm-up steps.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Classes of the head.
    #[arg(long, default_value_t = 1000)]
    num_classes: usize,
    /// The type steps compute in: fp32, or bf16/fp16 with f32 weights (fp16 training with loss
    /// scaling), as `hearth train --precision` trains.
    #[arg(long, value_enum, default_value_t = hearth::train::Precision::Fp32)]
    precision: hearth::train::Precision,
}

pub(crate) fn bench_allreduce(a: BenchAllreduceArgs) -> Result<()> {
    let mut args = vec![
        "bench".to_string(),
        "allreduce-rank".into(),
        "--iters".into(),
        a.iters.to_string(),
        "--warmup".into(),
        a.warmup.to_string(),
        "--compression".into(),
        a.compression.name().into(),
        "--buffer".into(),
        match a.buffer {
            BenchBuffer::Own => "own",
            BenchBuffer::Shared => "shared",
        }
        .into(),
        "--size-mb".into(),
    ];
    args.extend(a.size_mb.iter().map(|s| s.to_string()));
    let shm = hearth::dist::shm::ShmOptions::from_env();
    eprintln!(
        "allreduce, {} ranks on 127.0.0.1 ({}), {} timed iterations per size",
        a.ranks,
        match (shm.enabled, shm.chain_for(a.ranks), a.buffer) {
            (false, _, BenchBuffer::Own) => "QUIC only: HEARTH_SHM=0",
            (false, _, BenchBuffer::Shared) => {
                "QUIC only: HEARTH_SHM=0, so --buffer shared gives each rank a vector of its own"
            }
            (true, _, BenchBuffer::Shared) => {
                "shared memory between them, each rank's buffer mapped by all (--buffer \
                 shared), summed in place; HEARTH_SHM=0 for QUIC only"
            }
            (true, true, BenchBuffer::Own) => {
                "shared memory between them, the allreduce as a chain (HEARTH_SHM_CHAIN=0: with \
                 barriers); HEARTH_SHM=0 for QUIC only"
            }
            (true, false, BenchBuffer::Own) => {
                "shared memory between them, the allreduce with barriers (HEARTH_SHM_CHAIN=1: as \
                 a chain); HEARTH_SHM=0 for QUIC only"
            }
        },
        a.iters
    );
    let outcome = crate::commands::launch::launch(&crate::commands::launch::LaunchConfig {
        nproc: a.ranks,
        program: std::env::current_exe().context("locating the hearth binary")?,
        args,
        port: 0,
        prefix: false,
    })?;
    if matches!(outcome, crate::commands::launch::LaunchOutcome::Success) && a.ranks > 1 {
        // This host's memory, measured after the ranks are done so it does not compete with
        // them: how close the busbw above comes to what any allreduce could reach here.
        let memcpy =
            hearth_cli::bench::dist::memcpy_gbps(a.size_mb.iter().copied().fold(0.0, f64::max));
        println!(
            "this host's memory: memcpy_GBps={memcpy:.3} (one thread); the least any allreduce \
             over {} ranks moves (each rank's buffer read and written once, all at once):",
            a.ranks
        );
        for &mb in &a.size_mb {
            let floor = hearth_cli::bench::dist::floor_ms(a.ranks, mb);
            let ceiling = hearth_cli::bench::dist::ceiling_busbw_gbps(a.ranks, mb, floor);
            println!(
                "size_mb={mb} floor_ms={floor:.4} ceiling_busbw_GBps={ceiling:.4} \
                 ceiling_vs_memcpy={:.2}x",
                ceiling / memcpy
            );
        }
    }
    exit_with(outcome)
}

pub(crate) fn bench_allreduce_rank(a: BenchAllreduceArgs) -> Result<()> {
    hearth_cli::bench::dist::run_rank(
        &a.size_mb,
        a.iters,
        a.warmup,
        a.compression,
        a.buffer == BenchBuffer::Shared,
        &mut |t| println!("{t}"),
    )?;
    Ok(())
}

pub(crate) fn bench_model(device_name: &str, args: BenchModelArgs) -> Result<()> {
    let device = hearth::device::select(device_name)?;
    if hearth::train::MINI_MODELS.contains(&args.model.as_str()) {
        bail!(
            "bench model compares against torchvision on PyTorch: {} is a Hearth test-size \
             network with no torchvision twin; give a torchvision name (resnet50, densenet121, \
             vgg16, ...)",
            args.model
        );
    }
    let bench = ModelBench {
        arch: Architecture::from_name(&args.model)?,
        mode: args.mode,
        batch_size: args.batch_size,
        size: args.size,
        warmup: args.warmup,
        steps: args.steps,
        num_classes: args.num_classes,
        precision: args.precision,
    };
    if bench.steps == 0 {
        bail!("--steps must be at least 1");
    }
    eprintln!(
        "bench {} {:?} batch {} at {}x{} on {device_name}: {} warm-up + {} timed steps",
        bench.arch, bench.mode, bench.batch_size, bench.size, bench.size, bench.warmup, bench.steps
    );
    // The allocator's new mappings over the timed steps: memory faulted in afresh each step.
    let mut mapped_at_warm = hearth::alloc::blocks::maps();
    let mut recycled_at_warm = hearth::alloc::blocks::recycled();
    let report = bench.run(&device, |i, total, dt, warm| {
        eprintln!(
            "  step {i}/{total}{}: {:.1} ms",
            if warm { " (warm-up)" } else { "" },
            dt * 1e3
        );
        if warm {
            mapped_at_warm = hearth::alloc::blocks::maps();
            recycled_at_warm = hearth::alloc::blocks::recycled();
        }
    })?;
    let (maps, bytes) = hearth::alloc::blocks::maps();
    let steps = bench.steps as f64;
    eprintln!(
        "large blocks per timed step: {:.1} new mappings ({:.0} MB faulted in), {:.1} kept blocks resized",
        (maps - mapped_at_warm.0) as f64 / steps,
        (bytes - mapped_at_warm.1) as f64 / steps / 1e6,
        (hearth::alloc::blocks::recycled() - recycled_at_warm) as f64 / steps
    );
    let mut sorted = report.step_seconds.clone();
    sorted.sort_by(f64::total_cmp);
    println!("median step: {:.1} ms", sorted[sorted.len() / 2] * 1e3);
    println!("best step: {:.1} ms", sorted[0] * 1e3);
    let (median, best) = report.median_and_best(bench.batch_size);
    println!("images/s at the median step: {median:.2}, at the best: {best:.2}");
    let gflops = median * bench.gflop_per_image();
    match hearth_cli::bench::cpu_peak_gflops().filter(|_| hearth_kernels::is_cpu(&device)) {
        Some(peak) => println!(
            "GFLOP/s at the median step: {gflops:.1} ({:.0}% of the CPU's measured FMA peak {peak:.0}; HEARTH_PEAK_GFLOPS overrides)",
            100.0 * gflops / peak
        ),
        None => println!("GFLOP/s at the median step: {gflops:.1}"),
    }
    println!("images/s: {:.2}", report.images_per_sec);
    Ok(())
}

pub(crate) fn bench_loader(device_name: &str, args: BenchLoaderArgs) -> Result<()> {
    let device = hearth::device::select(device_name)?;
    let bench = hearth_cli::bench::loader::LoaderBench {
        batch_size: args.batch_size,
        workers: args.workers,
        prefetch: args.prefetch,
        size: args.size,
        batches: args.batches,
        auto_augment: match &args.auto_augment {
            Some(p) => Some(p.parse().with_context(|| format!("--auto-augment {p}"))?),
            None => None,
        },
    };
    // Refused settings are said before the line that describes the run.
    bench.validate()?;
    eprintln!(
        "bench loader {}: batch {}, {} workers, prefetch {}, {}x{}, {} batches, {}",
        args.data.display(),
        args.batch_size,
        args.workers,
        args.prefetch,
        args.size,
        args.size,
        args.batches,
        args.auto_augment
            .as_deref()
            .map_or("no auto augment".into(), |p| format!("auto augment {p}"))
    );
    let report = bench.run(&args.data, &device, |i, n| {
        if i % 5 == 0 || i == n {
            eprintln!("  batch {i}/{n}");
        }
    })?;
    if report.skipped > 0 {
        eprintln!("warning: {} bad file(s) skipped", report.skipped);
    }
    println!("peak RSS: {:.1} MB", report.peak_rss_mb);
    println!("images/s: {:.2}", report.images_per_sec);
    Ok(())
}
