//! The `hearth` command line. `hearth --help` lists the commands.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::module::Module;
use clap::{Args, Parser, Subcommand};
use hearth::bench::{BenchMode, ModelBench};
use hearth::device::{DeviceChoice, DeviceSpec};
use hearth::dist::Compression;
use hearth::models::Architecture;
use hearth::schedule::{LrScaling, ScheduleKind};
use hearth::train::{AugmentPreset, Monitor, OptimizerKind};
use hearth::{npy, predict};

#[derive(Parser)]
#[command(
    name = "hearth",
    version,
    about = "Image models and distributed training on Burn"
)]
struct Cli {
    /// Device to run on: flex (default CPU), ndarray, vulkan, wgpu, vulkan-cpu, cuda (when built
    /// with the `cuda` feature); a GPU index picks one of several (cuda:1, vulkan:1). In a
    /// distributed job without an index, each rank takes the GPU of its local rank.
    /// `hearth devices` lists this build's choices.
    #[arg(long, global = true, env = "HEARTH_DEVICE", default_value = "flex")]
    device: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List every model variant with its parameter count.
    Models,
    /// List the devices this build offers and whether each works on this machine.
    Devices,
    /// Classify images (or a raw NCHW .npy tensor, or a whole folder) with a model.
    Predict(PredictArgs),
    /// Accuracy, per-class precision and recall and a confusion matrix of a model on class
    /// folders (DIR/<class>/*.png).
    Eval(EvalArgs),
    /// Measure throughput.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Data set tools.
    #[command(subcommand)]
    Data(DataCommand),
    /// Train or fine-tune a classifier on an image folder (or, without --data, on a generated
    /// synthetic set), validating every epoch.
    Train(Box<TrainArgs>),
    /// Start N local ranks of a distributed job: `hearth launch -n 2 -- hearth train ...`.
    Launch(LaunchArgs),
}

#[derive(Args)]
struct LaunchArgs {
    /// Number of ranks.
    #[arg(short = 'n', long = "nproc")]
    nproc: usize,
    /// Coordinator port on 127.0.0.1 (default: a free one).
    #[arg(long, default_value_t = 0)]
    port: u16,
    /// The command each rank runs, after `--`.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

#[derive(Args)]
struct TrainArgs {
    /// Image folder: train/ and val/ class folders, or one folder split by --val-fraction.
    /// Without it a synthetic data set is generated into the run directory.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Multi-label CSV (`path,label1|label2|...`; paths relative to --data or the CSV's folder):
    /// one sigmoid per label, binary cross-entropy, per-class AUROC (CheXNet style).
    #[arg(long)]
    labels: Option<PathBuf>,
    #[arg(long, default_value_t = 0.2)]
    val_fraction: f64,
    /// torchvision name (resnet50, densenet121, vgg16, ...) or resnet-mini (the default).
    #[arg(long, default_value = hearth::train::DEFAULT_MODEL)]
    model: String,
    /// torchvision weights to start from; the head is replaced to fit the data's classes.
    #[arg(long)]
    weights: Option<PathBuf>,
    /// Train only the new head.
    #[arg(long)]
    freeze_backbone: bool,
    /// With --freeze-backbone: after N epochs, unfreeze everything and fine-tune at
    /// --finetune-lr (early-stopping patience counts from then).
    #[arg(long, requires = "freeze_backbone")]
    unfreeze_after: Option<usize>,
    /// Learning rate of the fine-tuning phase (default: --lr / 10).
    #[arg(long, requires = "unfreeze_after")]
    finetune_lr: Option<f64>,
    #[arg(long, default_value_t = 12)]
    epochs: usize,
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    #[arg(long, default_value_t = 0.05)]
    lr: f64,
    #[arg(long, value_enum, default_value_t = OptimizerKind::Sgd)]
    optimizer: OptimizerKind,
    #[arg(long, default_value_t = 0.9)]
    momentum: f64,
    #[arg(long)]
    nesterov: bool,
    /// L2 weight decay (SGD, Adam: not applied to biases and batch norm; AdamW: decoupled).
    #[arg(long, default_value_t = 5e-4)]
    weight_decay: f64,
    /// Learning-rate decay after warmup.
    #[arg(long, value_enum, default_value_t = ScheduleKind::Cosine)]
    schedule: ScheduleKind,
    #[arg(long, default_value_t = 1)]
    warmup_epochs: usize,
    /// Scale --lr by the batch ratio: linear (Goyal et al.) or sqrt.
    #[arg(long, value_enum, requires = "base_batch")]
    scale_lr: Option<LrScaling>,
    /// The batch size --lr was tuned for.
    #[arg(long)]
    base_batch: Option<usize>,
    #[arg(long, default_value_t = 0.0)]
    label_smoothing: f32,
    /// Metric for early stopping and the exported (best) epoch; val_auroc needs multi-label data.
    #[arg(long, value_enum, default_value_t = Monitor::ValAccuracy)]
    monitor: Monitor,
    /// Stop after this many epochs without improvement of --monitor.
    #[arg(long)]
    patience: Option<usize>,
    /// Smallest change of --monitor that counts as an improvement, for early stopping and for
    /// picking the exported epoch.
    #[arg(long, default_value_t = 0.0)]
    min_delta: f64,
    /// Input side in pixels.
    #[arg(long, default_value_t = 32)]
    size: u32,
    /// Training augmentation recipe; the flags below adjust it. light suits short fine-tuning
    /// runs and small data sets; imagenet is torchvision's recipe for long runs on large sets.
    #[arg(long, value_enum, default_value_t = AugmentPreset::Light)]
    augment: AugmentPreset,
    /// Random resized crop of MIN,MAX of the image area (e.g. 0.5,1), replacing the preset's.
    #[arg(long, value_name = "MIN,MAX")]
    crop_scale: Option<String>,
    /// Random horizontal flips (on in light and imagenet).
    #[arg(long, overrides_with = "no_flip")]
    flip: bool,
    /// No flips: for text, digits, and images whose left and right differ in meaning.
    #[arg(long, overrides_with = "flip")]
    no_flip: bool,
    /// Random rotation up to DEG degrees either way.
    #[arg(long, value_name = "DEG")]
    rotate: Option<f64>,
    /// Random horizontal shear up to DEG degrees either way.
    #[arg(long, value_name = "DEG")]
    shear: Option<f64>,
    /// Brightness, contrast and saturation jitter of up to X (0-1).
    #[arg(long, value_name = "X")]
    color_jitter: Option<f64>,
    /// Decoding threads.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Default: runs/<timestamp>.
    #[arg(long)]
    run_dir: Option<PathBuf>,
    /// Continue the run in this directory from its last checkpoint.
    #[arg(long, conflicts_with = "run_dir")]
    resume: Option<PathBuf>,
    /// End this run after that epoch (its checkpoint written); --resume continues it exactly.
    #[arg(long)]
    stop_after_epoch: Option<usize>,
    /// Price of one node-hour, for the cost line of the summary.
    #[arg(long)]
    price_per_hour: Option<f64>,
    /// Accumulate gradients over K micro-batches per optimizer step (in a distributed run they
    /// are averaged across ranks only on the K-th).
    #[arg(long)]
    grad_accum: Option<usize>,
    /// Train data parallel on N local processes (`hearth launch`); --batch-size stays the global
    /// batch. Inside a launched job (HEARTH_RANK, torchrun, Slurm or mpirun variables) the rank
    /// joins that job instead.
    #[arg(long, default_value_t = 1)]
    nproc: usize,
    /// Gradient fusion bucket size in MB (distributed runs).
    #[arg(long, default_value_t = 25.0)]
    bucket_mb: f64,
    /// Wire format of gradient averaging in distributed runs.
    #[arg(long, value_enum, default_value_t = Compression::None)]
    compression: Compression,
}

#[derive(Subcommand)]
enum DataCommand {
    /// Write a learnable synthetic image-folder data set (coloured shapes over noise).
    Synth(SynthArgs),
}

#[derive(Args)]
struct SynthArgs {
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = 10)]
    classes: usize,
    #[arg(long, default_value_t = 200)]
    per_class: usize,
    /// Image side in pixels.
    #[arg(long, default_value_t = 64)]
    size: u32,
    /// Also write val/ with this many images per class (train/ then holds --per-class).
    #[arg(long, default_value_t = 0)]
    val_per_class: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Write JPEG files instead of PNG.
    #[arg(long)]
    jpeg: bool,
}

#[derive(Args)]
struct PredictArgs {
    /// Architecture (torchvision name, e.g. resnet50); not needed for a Hearth .bpk model file.
    #[arg(long)]
    model: Option<String>,
    /// Weights: torchvision .pth/.pt or .safetensors, or a Hearth .bpk model file.
    #[arg(long)]
    weights: Option<PathBuf>,
    /// Image files, prepared as the model file records (a Hearth model trained at --size S:
    /// shorter side S*256/224, center crop S), else torchvision's 256 / 224 recipe;
    /// ImageNet-normalised.
    #[arg(long, num_args = 1.., conflicts_with_all = ["input", "data"], required_unless_present_any = ["input", "data"])]
    image: Vec<PathBuf>,
    /// Every image under this folder (recursively), streamed in batches; results go to --out.
    #[arg(long, conflicts_with = "input", requires = "out")]
    data: Option<PathBuf>,
    /// With --data: the CSV to write (path, then class and probability for each of --top).
    #[arg(long)]
    out: Option<PathBuf>,
    /// With --data: images per batch.
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// A float32 NCHW .npy tensor used as is.
    #[arg(long)]
    input: Option<PathBuf>,
    /// How many classes to print per input.
    #[arg(long, default_value_t = 5)]
    top: usize,
    /// Write the logits [N, classes] as float32 .npy.
    #[arg(long)]
    logits_out: Option<PathBuf>,
    /// Class count of the model (default: read from the weights' head; 1000 without weights).
    #[arg(long)]
    num_classes: Option<usize>,
}

#[derive(Args)]
struct EvalArgs {
    /// A Hearth model file (.bpk), or torchvision weights with --model.
    #[arg(long)]
    weights: PathBuf,
    /// Architecture, for torchvision weights.
    #[arg(long)]
    model: Option<String>,
    /// Class folders to evaluate on; folder names must be the model's class names.
    #[arg(long)]
    data: PathBuf,
    /// Where per_class.csv, confusion.csv and confusion.png go.
    #[arg(long, default_value = "eval")]
    out: PathBuf,
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Decoding threads.
    #[arg(long, default_value_t = 2)]
    workers: usize,
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Images/s of a model's forward pass or training step on random data.
    Model(BenchModelArgs),
    /// Images/s of the training data pipeline (decode, augmentation, batch to a tensor).
    Loader(BenchLoaderArgs),
    /// Ring allreduce over QUIC on loopback: time, algbw and busbw per size.
    Allreduce(BenchAllreduceArgs),
    /// One rank of `bench allreduce` (started by it).
    #[command(hide = true)]
    AllreduceRank(BenchAllreduceArgs),
}

#[derive(Args, Clone)]
struct BenchAllreduceArgs {
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
}

#[derive(Args)]
struct BenchLoaderArgs {
    /// An image folder (root/<class>/<image>).
    #[arg(long)]
    data: PathBuf,
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Batches in flight.
    #[arg(long, default_value_t = 4)]
    prefetch: usize,
    #[arg(long, default_value_t = 224)]
    size: u32,
    /// Timed batches (after one warm-up batch).
    #[arg(long, default_value_t = 20)]
    batches: usize,
}

#[derive(Args)]
struct BenchModelArgs {
    #[arg(long)]
    model: String,
    /// train (forward, backward, SGD step) or infer (forward in evaluation mode).
    #[arg(long, value_enum, default_value_t = BenchMode::Infer)]
    mode: BenchMode,
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
    #[arg(long, default_value_t = 1000)]
    num_classes: usize,
}

fn main() {
    let cli = Cli::parse();
    if let Err(err) = run(cli) {
        eprintln!("error: {}", report(&err));
        std::process::exit(1);
    }
}

/// The error and its causes on one line, each said once: our error types already include their
/// source's text ("cannot read x: No such file or directory"), so a cause whose text is already
/// there is not repeated.
fn report(err: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in err.chain() {
        let part = cause.to_string();
        if text.contains(&part) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&part);
    }
    text
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Models => models(),
        Command::Devices => devices(),
        Command::Predict(args) => predict_cmd(&cli.device, args),
        Command::Eval(args) => eval_cmd(&cli.device, args),
        Command::Bench(BenchCommand::Model(args)) => bench_model(&cli.device, args),
        Command::Bench(BenchCommand::Loader(args)) => bench_loader(&cli.device, args),
        Command::Data(DataCommand::Synth(args)) => data_synth(args),
        Command::Train(args) => train_cmd(&cli.device, *args),
        Command::Launch(args) => launch_cmd(args),
        Command::Bench(BenchCommand::Allreduce(args)) => bench_allreduce(args),
        Command::Bench(BenchCommand::AllreduceRank(args)) => bench_allreduce_rank(args),
    }
}

fn exit_with(outcome: hearth::launch::LaunchOutcome) -> Result<()> {
    match outcome {
        hearth::launch::LaunchOutcome::Success => Ok(()),
        hearth::launch::LaunchOutcome::Failed { rank, code } => {
            eprintln!("error: rank {rank} failed (exit status {code:?})");
            std::process::exit(code.filter(|c| *c != 0).unwrap_or(1));
        }
    }
}

fn launch_cmd(a: LaunchArgs) -> Result<()> {
    let Some((program, args)) = a.command.split_first() else {
        bail!("hearth launch needs a command after --");
    };
    // `hearth` as the program means this very binary.
    let program = if program == "hearth" {
        std::env::current_exe().context("locating the hearth binary")?
    } else {
        PathBuf::from(program)
    };
    let outcome = hearth::launch::launch(&hearth::launch::LaunchConfig {
        nproc: a.nproc,
        program,
        args: args.to_vec(),
        port: a.port,
        prefix: true,
    })?;
    exit_with(outcome)
}

fn bench_allreduce(a: BenchAllreduceArgs) -> Result<()> {
    let mut args = vec![
        "bench".to_string(),
        "allreduce-rank".into(),
        "--iters".into(),
        a.iters.to_string(),
        "--warmup".into(),
        a.warmup.to_string(),
        "--compression".into(),
        a.compression.name().into(),
        "--size-mb".into(),
    ];
    args.extend(a.size_mb.iter().map(|s| s.to_string()));
    eprintln!(
        "ring allreduce, {} ranks over QUIC on 127.0.0.1, {} timed iterations per size",
        a.ranks, a.iters
    );
    let outcome = hearth::launch::launch(&hearth::launch::LaunchConfig {
        nproc: a.ranks,
        program: std::env::current_exe().context("locating the hearth binary")?,
        args,
        port: 0,
        prefix: false,
    })?;
    exit_with(outcome)
}

fn bench_allreduce_rank(a: BenchAllreduceArgs) -> Result<()> {
    hearth::dist_bench::run_rank(&a.size_mb, a.iters, a.warmup, a.compression, &mut |t| {
        println!("{t}")
    })?;
    Ok(())
}

fn models() -> Result<()> {
    let cpu = burn::prelude::Device::flex();
    println!(
        "{:<14} {:>14}  {}",
        "model", "parameters", "(1000 classes, torchvision architecture)"
    );
    for arch in Architecture::ALL {
        // Lazy init: counting parameters allocates nothing.
        let n = arch.init(1000, &cpu)?.learnable_params();
        println!("{:<14} {:>14}", arch.name(), group_digits(n));
    }
    Ok(())
}

fn group_digits(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn devices() -> Result<()> {
    println!("{:<12} {:<10} description", "device", "status");
    for d in DeviceChoice::ALL {
        let status = match d.device() {
            Ok(_) => "ok".to_string(),
            Err(e) => format!("unavailable ({e})"),
        };
        let (short, rest) = match status.split_once(' ') {
            Some((a, b)) => (a.to_string(), format!("  {b}")),
            None => (status.clone(), String::new()),
        };
        println!("{:<12} {:<10} {}{}", d.name(), short, d.description(), rest);
    }
    Ok(())
}

fn predict_cmd(device_name: &str, args: PredictArgs) -> Result<()> {
    let device = hearth::device::select(device_name)?;
    let loaded = predict::load_for_predict(
        args.model.as_deref(),
        args.weights.as_deref(),
        args.num_classes,
        &device,
    )?;
    if loaded.weights.is_none() {
        eprintln!("warning: no --weights given: these outputs are from RANDOM weights");
    }
    let model = loaded.model.valid();
    if let (Some(dir), Some(out)) = (&args.data, &args.out) {
        let mut progress = progress_bar("predicting");
        let (n, problems) = hearth::eval::predict_folder(
            &model,
            loaded.class_names.as_deref(),
            dir,
            &loaded.preprocessing,
            args.top.max(1),
            args.batch_size,
            2,
            &device,
            out,
            &mut |done, total| progress(done, total),
        )?;
        if let Some(summary) = problems.summary() {
            eprintln!("{summary}");
        }
        println!("{n} image(s) predicted; results in {}", out.display());
        return Ok(());
    }
    let (x, labels): (_, Vec<String>) = match &args.input {
        Some(path) => {
            let x = predict::npy_to_tensor(path, &device)?;
            let n = x.dims()[0];
            (
                x,
                (0..n).map(|i| format!("{}[{i}]", path.display())).collect(),
            )
        }
        None => (
            predict::images_to_tensor(&args.image, &loaded.preprocessing, &device)?,
            args.image.iter().map(|p| p.display().to_string()).collect(),
        ),
    };
    let started = Instant::now();
    let logits = model.try_forward(x)?;
    let [n, classes] = logits.dims();
    let probs = model.head_activation().probabilities(logits.clone());
    let logits: Vec<f32> = logits
        .into_data()
        .try_to_vec::<f32>()
        .map_err(|e| anyhow::anyhow!("reading logits: {e:?}"))?;
    let probs: Vec<f32> = probs
        .into_data()
        .try_to_vec::<f32>()
        .map_err(|e| anyhow::anyhow!("reading probabilities: {e:?}"))?;
    let elapsed = started.elapsed();
    for (label, row) in labels
        .iter()
        .zip(predict::top_k(&probs, classes, args.top.max(1)))
    {
        println!("{label}");
        for (class, p) in row {
            let name = loaded
                .class_names
                .as_ref()
                .and_then(|names| names.get(class))
                .map(|s| format!(" {s}"))
                .unwrap_or_default();
            println!("  class {class:>4}{name}: {p:.4}");
        }
    }
    if let Some(out) = &args.logits_out {
        npy::write(out, &[n, classes], &logits)
            .with_context(|| format!("writing logits to {}", out.display()))?;
        eprintln!("logits [{n}, {classes}] written to {}", out.display());
    }
    eprintln!(
        "{n} input(s) in {:.1} ms on {device_name}",
        elapsed.as_secs_f64() * 1e3
    );
    Ok(())
}

/// An indicatif bar on stderr (hidden when stderr is not a terminal), fed (done, total).
fn progress_bar(what: &'static str) -> impl FnMut(usize, usize) {
    let bar = indicatif::ProgressBar::new(0);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{msg} [{bar:30}] {pos}/{len} images, {per_sec}, eta {eta}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(what);
    move |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
        if done >= total {
            bar.finish_and_clear();
        }
    }
}

fn eval_cmd(device_name: &str, args: EvalArgs) -> Result<()> {
    let device = hearth::device::select(device_name)?;
    let loaded =
        predict::load_for_predict(args.model.as_deref(), Some(&args.weights), None, &device)?;
    let model = loaded.model.valid();
    let mut progress = progress_bar("evaluating");
    let report = hearth::eval::evaluate(
        &model,
        loaded.class_names.as_deref(),
        &args.data,
        &loaded.preprocessing,
        args.batch_size,
        args.workers,
        &device,
        &mut |done, total| progress(done, total),
    )?;
    if let Some(summary) = report.problems.summary() {
        eprintln!("{summary}");
    }
    let files = hearth::eval::write_report(&report, &args.out)?;
    println!(
        "{:<24} {:>9} {:>9} {:>8}",
        "class", "precision", "recall", "images"
    );
    let pct = |v: Option<f64>| {
        v.map(|x| format!("{:.2}%", 100.0 * x))
            .unwrap_or("-".into())
    };
    for c in &report.classes {
        println!(
            "{:<24} {:>9} {:>9} {:>8}",
            c.name,
            pct(c.precision),
            pct(c.recall),
            c.support
        );
    }
    println!(
        "accuracy: {:.2}% on {} images",
        report.accuracy, report.images
    );
    for f in files {
        println!("wrote {}", f.display());
    }
    Ok(())
}

fn bench_model(device_name: &str, args: BenchModelArgs) -> Result<()> {
    let device = hearth::device::select(device_name)?;
    let bench = ModelBench {
        arch: Architecture::from_name(&args.model)?,
        mode: args.mode,
        batch_size: args.batch_size,
        size: args.size,
        warmup: args.warmup,
        steps: args.steps,
        num_classes: args.num_classes,
    };
    if bench.steps == 0 {
        bail!("--steps must be at least 1");
    }
    eprintln!(
        "bench {} {:?} batch {} at {}x{} on {device_name}: {} warm-up + {} timed steps",
        bench.arch, bench.mode, bench.batch_size, bench.size, bench.size, bench.warmup, bench.steps
    );
    let report = bench.run(&device, |i, total, dt, warm| {
        eprintln!(
            "  step {i}/{total}{}: {:.1} ms",
            if warm { " (warm-up)" } else { "" },
            dt * 1e3
        );
    })?;
    let mut sorted = report.step_seconds.clone();
    sorted.sort_by(f64::total_cmp);
    println!("median step: {:.1} ms", sorted[sorted.len() / 2] * 1e3);
    println!("images/s: {:.2}", report.images_per_sec);
    Ok(())
}

fn data_synth(args: SynthArgs) -> Result<()> {
    use hearth::datasets::synth::{SynthConfig, generate};
    let cfg = SynthConfig::new(args.classes, args.per_class, args.size)
        .with_seed(args.seed)
        .with_val(args.val_per_class)
        .with_jpeg(args.jpeg);
    let started = Instant::now();
    let n = generate(&args.out, &cfg)?;
    println!(
        "wrote {n} images ({} classes, {}x{}) to {} in {:.1} s",
        args.classes,
        args.size,
        args.size,
        args.out.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn bench_loader(device_name: &str, args: BenchLoaderArgs) -> Result<()> {
    let device = hearth::device::select(device_name)?;
    let bench = hearth::loader_bench::LoaderBench {
        batch_size: args.batch_size,
        workers: args.workers,
        prefetch: args.prefetch,
        size: args.size,
        batches: args.batches,
    };
    eprintln!(
        "bench loader {}: batch {}, {} workers, prefetch {}, {}x{}, {} batches",
        args.data.display(),
        args.batch_size,
        args.workers,
        args.prefetch,
        args.size,
        args.size,
        args.batches
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

/// The training command line again, without `--nproc`, with an explicit run directory.
fn rank_args(run_dir: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut args = std::env::args().skip(1).peekable();
    let mut has_dir = false;
    while let Some(a) = args.next() {
        if a == "--nproc" {
            args.next();
            continue;
        }
        if a.starts_with("--nproc=") {
            continue;
        }
        has_dir |= a == "--run-dir"
            || a.starts_with("--run-dir=")
            || a == "--resume"
            || a.starts_with("--resume=");
        out.push(a);
    }
    if !has_dir {
        out.push("--run-dir".into());
        out.push(run_dir.display().to_string());
    }
    out
}

fn default_run_dir() -> PathBuf {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    PathBuf::from("runs").join(secs.to_string())
}

/// The preset with the per-transform flags applied.
fn augmentation(a: &TrainArgs) -> Result<hearth::datasets::Augmentation> {
    let mut aug = a.augment.augmentation();
    if let Some(text) = &a.crop_scale {
        let parts: Vec<&str> = text.split(',').map(str::trim).collect();
        let [min, max] = parts.as_slice() else {
            bail!("--crop-scale {text:?}: expected MIN,MAX, e.g. 0.5,1");
        };
        let (min, max): (f64, f64) = (
            min.parse()
                .with_context(|| format!("--crop-scale MIN {min:?}"))?,
            max.parse()
                .with_context(|| format!("--crop-scale MAX {max:?}"))?,
        );
        if !(0.0 < min && min <= max && max <= 1.0) {
            bail!("--crop-scale {min},{max}: need 0 < MIN <= MAX <= 1");
        }
        aug.crop_scale = Some((min, max));
    }
    if a.flip {
        aug.flip = true;
    }
    if a.no_flip {
        aug.flip = false;
    }
    if let Some(d) = a.rotate {
        aug.rotate = d;
    }
    if let Some(d) = a.shear {
        aug.shear = d;
    }
    if let Some(x) = a.color_jitter {
        aug.color_jitter = x;
    }
    Ok(aug)
}

fn train_cmd(device_name: &str, a: TrainArgs) -> Result<()> {
    use hearth::train::{TrainConfig, train};
    let in_job = std::env::var_os("HEARTH_RANK").is_some();
    if a.nproc > 1 && !in_job {
        let run_dir = a
            .resume
            .clone()
            .or(a.run_dir.clone())
            .unwrap_or_else(default_run_dir);
        eprintln!(
            "launching {} ranks; run directory: {}",
            a.nproc,
            run_dir.display()
        );
        let outcome = hearth::launch::launch(&hearth::launch::LaunchConfig {
            nproc: a.nproc,
            program: std::env::current_exe().context("locating the hearth binary")?,
            args: rank_args(&run_dir),
            port: 0,
            prefix: true,
        })?;
        return exit_with(outcome);
    }
    // Inside a job (hearth launch, torchrun, Slurm, mpirun): join it. Half-set or malformed
    // launcher variables are an error, never a silent single-process run.
    let dist = hearth::dist::rendezvous::RankInfo::detect()
        .context("reading the launcher's environment")?
        .filter(|info| info.world > 1);
    let spec: DeviceSpec = device_name.parse()?;
    let spec = spec.for_local_rank(dist.as_ref().and_then(|d| d.local_rank));
    let device = spec.device()?;
    if let Some(info) = &dist {
        eprintln!(
            "rank {} of {}: device {spec}{}",
            info.rank,
            info.world,
            info.local_rank
                .map(|l| format!(" (local rank {l})"))
                .unwrap_or_default()
        );
    }
    let augment = augmentation(&a)?;
    let (run_dir, resume) = match (a.resume, a.run_dir) {
        (Some(dir), _) => (dir, true),
        (None, Some(dir)) => (dir, false),
        (None, None) => (default_run_dir(), false),
    };
    let mut cfg = TrainConfig::new(run_dir);
    cfg.resume = resume;
    cfg.data = a.data;
    cfg.labels = a.labels;
    cfg.unfreeze_after = a.unfreeze_after;
    cfg.finetune_lr = a.finetune_lr;
    cfg.val_fraction = a.val_fraction;
    cfg.model = a.model;
    cfg.weights = a.weights;
    cfg.freeze_backbone = a.freeze_backbone;
    cfg.epochs = a.epochs;
    cfg.batch_size = a.batch_size;
    cfg.lr = a.lr;
    cfg.optimizer = a.optimizer;
    cfg.momentum = a.momentum;
    cfg.nesterov = a.nesterov;
    cfg.weight_decay = a.weight_decay;
    cfg.schedule = a.schedule.decay();
    cfg.warmup_epochs = a.warmup_epochs;
    cfg.scale_lr = match (a.scale_lr, a.base_batch) {
        (Some(rule), Some(base)) => Some((rule, base)),
        _ => None,
    };
    cfg.label_smoothing = a.label_smoothing;
    cfg.monitor = a.monitor;
    cfg.patience = a.patience;
    cfg.min_delta = a.min_delta;
    cfg.image_size = a.size;
    cfg.augmentation = augment;
    cfg.workers = a.workers;
    cfg.seed = a.seed;
    cfg.price_per_hour = a.price_per_hour;
    cfg.stop_after_epoch = a.stop_after_epoch;
    cfg.grad_accum = a.grad_accum;
    cfg.bucket_bytes = (a.bucket_mb * 1e6) as usize;
    cfg.compression = a.compression;
    cfg.dist = dist;
    let rank0 = cfg.dist.as_ref().is_none_or(|d| d.rank == 0);
    if rank0 {
        eprintln!("run directory: {}", cfg.run_dir.display());
    }
    let report = train(&cfg, &device, &mut |line| eprintln!("{line}"))?;
    if report.rank != 0 {
        return Ok(());
    }
    if report.world > 1 {
        println!(
            "trained on {} ranks, global batch {} ({} per rank)",
            report.world,
            cfg.batch_size,
            cfg.batch_size / report.world
        );
    }
    println!("best epoch: {} of {}", report.best_epoch, report.epochs_run);
    if let Some(loss) = report.best_val_loss {
        println!("validation loss: {loss:.4}");
    }
    println!(
        "wall time: {:.1} s, {:.1} images/s, {:.4} node-hours{}",
        report.wall_seconds,
        report.images_per_sec,
        report.node_hours,
        report
            .cost
            .map(|c| format!(", cost {c:.4}"))
            .unwrap_or_default()
    );
    println!(
        "model: {} (metrics.csv, metrics.png beside it)",
        report.model_path.display()
    );
    if let Some(auroc) = report.best_val_auroc {
        println!("validation AUROC (mean over labels): {auroc:.2}%");
    }
    match report.best_val_accuracy {
        Some(acc) if report.per_class_auroc.is_some() => {
            println!("validation accuracy (per label, Hamming): {acc:.2}%")
        }
        Some(acc) => println!("validation accuracy: {acc:.2}%"),
        None => println!("validation accuracy: n/a"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_os_error_is_reported_once_with_its_path() {
        let err: anyhow::Error = hearth::predict::load_for_predict(
            Some("resnet18"),
            Some(std::path::Path::new("/nonexistent/weights.pth")),
            None,
            &burn::prelude::Device::flex(),
        )
        .err()
        .expect("a missing file is an error")
        .into();
        let text = report(&err);
        assert!(text.contains("/nonexistent/weights.pth"), "{text}");
        assert_eq!(text.matches("os error 2").count(), 1, "{text}");
        let wrapped = err.context("predicting");
        assert!(report(&wrapped).starts_with("predicting: "));
    }
}
