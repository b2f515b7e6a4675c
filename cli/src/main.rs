//! The `hearth` command line. `hearth --help` lists the commands.

mod commands {
    pub mod bench;
    pub mod data;
    pub mod data_check;
    pub mod exit;
    pub mod export;
    pub mod global;
    pub mod kernels;
    pub mod launch;
    pub mod predict;
    pub mod resume;
    pub mod train;
    pub mod train_args;
    pub mod tune;
    pub mod weights;
}

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use commands::bench::*;
use commands::data::DataCommand;
use commands::exit::exit_with;
use commands::global::Use;
use commands::predict::*;
use commands::train::*;
use commands::train_args::TrainArgs;
use hearth::device::DeviceChoice;
use hearth::models::Architecture;

/// Counts live bytes for `--pipeline-balance memory`.
#[global_allocator]
static ALLOC: hearth::alloc::CountingAllocator = hearth::alloc::CountingAllocator;

#[derive(Parser)]
#[command(
    name = "hearth",
    version,
    about = "Image models and distributed training on Burn"
)]
struct Cli {
    /// Device to run on: flex (default CPU), ndarray (built with the `ndarray` feature), vulkan,
    /// wgpu, vulkan-cpu (the `wgpu` feature), cuda (the `cuda` feature); a GPU index picks one of several (cuda:1, vulkan:1). In a
    /// distributed job without an index, each rank takes the GPU of its local rank.
    /// `hearth devices` lists this build's choices. For commands that run on a device; `launch`
    /// gives it to every rank.
    #[arg(long, global = true, env = "HEARTH_DEVICE", default_value = "flex")]
    device: String,
    /// How GPU kernels are chosen for Hearth's convolutions and linear layers: off (default: by
    /// rule for the operation, its geometry and the GPU, nothing timed; only the kernels that
    /// run are compiled) or full (Burn's autotune times every candidate kernel of each new shape first:
    /// minutes on a GPU it has not seen, its decisions kept in cubecl's cache). GPU devices only.
    #[arg(long, global = true, env = "HEARTH_AUTOTUNE", default_value = "off")]
    autotune: String,
    /// A kernel bundle (`hearth tune --out FILE`, from a machine with the same GPU model) to
    /// import into cubecl's cache before the GPU starts: its compiled kernels spare compiling
    /// them again, and under --autotune full its decisions spare the tuning. GPU devices only.
    /// Without it a CUDA device imports, once, the bundle Hearth ships for its GPU's
    /// architecture where there is one (bundles/: H100/H200; HEARTH_SHIPPED_KERNELS=0 skips it).
    #[arg(long, global = true, env = "HEARTH_KERNEL_BUNDLE")]
    kernel_bundle: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List every model variant with its parameter count.
    Models,
    /// List the devices this build offers and whether each works on this machine.
    Devices,
    /// List a model's units, the pieces `train --pipeline-split A:B,...` cuts between.
    Units(UnitsArgs),
    /// Classify images (or a raw NCHW .npy tensor, or a whole folder) with a model.
    Predict(PredictArgs),
    /// Accuracy, per-class precision and recall and a confusion matrix of a model on class
    /// folders (DIR/<class>/*.png).
    Eval(EvalArgs),
    /// Write a Hearth model file in another framework's format: torchvision's state_dict as
    /// SafeTensors or `.pth`, for PyTorch, or an ONNX inference graph.
    Export(commands::export::ExportArgs),
    /// Pretrained weights by name: `hearth weights fetch resnet50` downloads torchvision's
    /// ImageNet file once into Hearth's cache (`--weights imagenet` does the same on first use).
    #[command(subcommand)]
    Weights(commands::weights::WeightsCommand),
    /// Measure throughput.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Data set tools.
    #[command(subcommand)]
    Data(DataCommand),
    /// Train or fine-tune a classifier on an image folder (or, without --data, on a generated
    /// synthetic set), validating every epoch.
    Train(Box<TrainArgs>),
    /// Print a fresh random job secret (256 bits, hex) for HEARTH_JOB_SECRET or a file named
    /// by HEARTH_JOB_SECRET_FILE: `hearth secret > job.secret && chmod 600 job.secret`.
    Secret,
    /// Start N local ranks of a distributed job: `hearth launch -n 2 -- hearth train ...`.
    Launch(LaunchArgs),
    /// Tune a model's GPU kernels with Burn's autotune (a few training steps: minutes on a GPU
    /// it has not seen) and write them, with the compiled kernels, to a bundle that other
    /// machines with the same GPU model load with --kernel-bundle.
    Tune(commands::tune::TuneArgs),
    /// Which kernel Burn's autotune chose for each shape on a GPU: reads the file a run wrote
    /// with HEARTH_AUTOTUNE_LOG=FILE and prints a table (winner, its time, the runner-up).
    AutotuneReport {
        /// The HEARTH_AUTOTUNE_LOG file (one JSON decision a line).
        file: PathBuf,
    },
}

#[derive(Args)]
struct UnitsArgs {
    /// torchvision name (resnet50, densenet121, vgg16, ...), resnet-mini or vgg-mini.
    #[arg(long)]
    model: String,
    /// Classes of the head, for the parameter counts.
    #[arg(long, default_value_t = 1000)]
    classes: usize,
}

#[derive(Args)]
struct LaunchArgs {
    /// Number of ranks.
    #[arg(short = 'n', long = "nproc")]
    nproc: usize,
    /// Coordinator port on 127.0.0.1 (default: a free one).
    #[arg(long, default_value_t = 0)]
    port: u16,
    /// An elastic job: workers may die, leave and join while it trains (the command should be
    /// `hearth train --elastic ...`); -n workers start it.
    #[arg(long)]
    elastic: bool,
    /// Fewest workers (passed to the workers as --min-workers).
    #[arg(long, requires = "elastic")]
    min: Option<usize>,
    /// Most workers (passed as --max-workers; joiners beyond it are not started).
    #[arg(long, requires = "elastic")]
    max: Option<usize>,
    /// Membership changes on a schedule, e.g. t=30s:-1,t=60s:+2 (-1 stops the newest worker
    /// gracefully, -1! kills it, kill=w0 and term=w0 name one, +N starts N joiners).
    #[arg(long, requires = "elastic")]
    churn: Option<String>,
    /// Host file (`HOST [slots=K]` per line), re-read when it changes: the number of local
    /// workers to run.
    #[arg(long, requires = "elastic")]
    hosts: Option<PathBuf>,
    /// The command each rank runs, after `--`.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

fn main() {
    // Output piped into `head` and the like ends the process quietly, as other command-line
    // tools do, instead of a panic on the closed pipe.
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let matches = <Cli as clap::CommandFactory>::command().get_matches();
    let cli = match <Cli as clap::FromArgMatches>::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(err) => err.exit(),
    };
    // Burn's default device on the run's backend: burn-optim loads optimizer state there
    // (`hearth::device::pin_burn_default`). An unknown --device is refused later, by name.
    if let Ok(spec) = cli.device.parse::<hearth::device::DeviceSpec>() {
        // SAFETY: before any thread of this process starts; ranks it spawns inherit it.
        unsafe { hearth::device::pin_burn_default(spec.choice) }
    }
    let uses = global_flag_use(&cli.command);
    let uses_device = uses == Use::Device;
    if let Err(err) = global_flags(&cli, &matches, uses) {
        eprintln!("error: {}", report(&err));
        std::process::exit(1);
    }
    if let Err(err) = commands::kernels::set_autotune(
        &cli.autotune,
        cli.kernel_bundle.as_deref(),
        &cli.device,
        uses_device,
    ) {
        eprintln!("error: {}", report(&err));
        std::process::exit(1);
    }
    // Freed tensors stay in the process for the next step (`HEARTH_MALLOC=system` opts out).
    if let Err(err) = hearth::alloc::apply_freed_memory_policy() {
        eprintln!("error: {err}");
        std::process::exit(1);
    }
    // This thread computes as one of the kernels' threads (`HEARTH_JOIN_POOL=0` opts out).
    hearth::kernels::join_global_pool();
    if let Err(err) = run(cli) {
        eprintln!("error: {}", report(&err));
        std::process::exit(1);
    }
}

/// What `command` does with the global flags (`commands::global`).
fn global_flag_use(command: &Command) -> Use {
    match command {
        Command::Predict(_)
        | Command::Eval(_)
        | Command::Export(_)
        | Command::Train(_)
        | Command::Tune(_)
        | Command::Bench(BenchCommand::Model(_))
        | Command::Bench(BenchCommand::Loader(_)) => Use::Device,
        Command::Launch(_) => Use::Ranks,
        _ => Use::Nothing,
    }
}

/// Refuses a global flag the command line gave to a command that would ignore it; for
/// `launch`, checks the device and puts each given flag in the environment its ranks inherit.
fn global_flags(cli: &Cli, matches: &clap::ArgMatches, uses: Use) -> Result<()> {
    // The command's words (`data synth`), and the global flags written on the command line
    // at any of its levels (not read from the environment, not defaults).
    let (mut words, mut given, mut level) = (Vec::new(), Vec::new(), Some(matches));
    while let Some(m) = level {
        for (flag, id, _) in commands::global::FLAGS {
            if m.value_source(id) == Some(clap::parser::ValueSource::CommandLine)
                && !given.contains(&flag)
            {
                given.push(flag);
            }
        }
        level = m.subcommand().map(|(name, sub)| {
            words.push(name);
            sub
        });
    }
    let rank_args = match &cli.command {
        Command::Launch(a) => a.command.get(1..).unwrap_or_default(),
        _ => &[],
    };
    commands::global::check(&words.join(" "), uses, &given, rank_args)?;
    if uses == Use::Ranks && given.contains(&"--device") {
        let spec: hearth::device::DeviceSpec =
            (cli.device.parse()).with_context(|| format!("--device {}", cli.device))?;
        let env = commands::global::env_of("--device").unwrap_or("HEARTH_DEVICE");
        // SAFETY: before any thread of this process starts; the ranks inherit it.
        unsafe { std::env::set_var(env, spec.to_string()) };
    }
    Ok(())
}

/// The error and its causes on one line, each said once: our error types already include their
/// source's text ("cannot read x: No such file or directory"), so a cause whose text is already
/// there is not repeated. Settings the library names (`optim.lr`) are said as their flags.
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
    let mut shown = hearth::settings::flags::with_flags(&text);
    // Where the library names its own way, the command line's is said too.
    for (said, hint) in CLI_HINTS {
        if text.contains(said) {
            shown.push_str(hint);
        }
    }
    shown
}

/// (what a library error says, the command line's way to it).
const CLI_HINTS: &[(&str, &str)] = &[
    (
        "`TrainingMode::Elastic` needs this worker's place",
        " (start the job with `hearth launch --elastic -n N -- hearth train --elastic ...`)",
    ),
    (
        "`ModelConfig::init_units` gives them",
        " (`hearth units --model NAME` lists them)",
    ),
];

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Models => models(),
        Command::Devices => devices(),
        Command::Units(args) => units(args),
        Command::Predict(args) => predict_cmd(&cli.device, args),
        Command::Eval(args) => eval_cmd(&cli.device, args),
        Command::Export(args) => commands::export::export_cmd(&cli.device, args),
        Command::Weights(cmd) => commands::weights::weights_cmd(cmd),
        Command::Bench(BenchCommand::Model(args)) => bench_model(&cli.device, args),
        Command::Bench(BenchCommand::Loader(args)) => bench_loader(&cli.device, args),
        Command::Data(DataCommand::Synth(args)) => commands::data::data_synth(args),
        Command::Data(DataCommand::Check(args)) => commands::data::data_check(args),
        Command::Train(args) => train_cmd(&cli.device, *args),
        Command::Tune(args) => commands::tune::tune(&cli.device, args),
        Command::Launch(args) => launch_cmd(args),
        Command::Secret => {
            println!("{}", hearth::dist::tls::random_secret()?);
            Ok(())
        }
        Command::AutotuneReport { file } => {
            print!("{}", hearth::gpu::autotune_report(&file)?);
            Ok(())
        }
        Command::Bench(BenchCommand::Allreduce(args)) => bench_allreduce(args),
        Command::Bench(BenchCommand::AllreduceRank(args)) => bench_allreduce_rank(args),
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
    if a.elastic {
        return launch_elastic_cmd(&a, program, args);
    }
    let outcome = commands::launch::launch(&commands::launch::LaunchConfig {
        nproc: a.nproc,
        program,
        args: args.to_vec(),
        port: a.port,
        prefix: true,
    })?;
    exit_with(outcome)
}

fn launch_elastic_cmd(a: &LaunchArgs, program: PathBuf, args: &[String]) -> Result<()> {
    use commands::launch::elastic::{
        ElasticLaunchConfig, ElasticOutcome, launch_elastic, parse_churn,
    };
    let mut args = args.to_vec();
    let has = |args: &[String], flag: &str| {
        args.iter()
            .any(|x| x == flag || x.starts_with(&format!("{flag}=")))
    };
    let max = a.max.unwrap_or(a.nproc.max(a.min.unwrap_or(1)));
    if let Some(min) = a.min
        && !has(&args, "--min-workers")
    {
        args.extend(["--min-workers".into(), min.to_string()]);
    }
    if !has(&args, "--max-workers") {
        args.extend(["--max-workers".into(), max.to_string()]);
    }
    let churn = a
        .churn
        .as_deref()
        .map(parse_churn)
        .transpose()?
        .unwrap_or_default();
    let outcome = launch_elastic(&ElasticLaunchConfig {
        nproc: a.nproc,
        max,
        program,
        args,
        churn,
        hosts: a.hosts.clone(),
    })?;
    match outcome {
        ElasticOutcome::Finished { by } => {
            eprintln!("hearth launch: training finished ({by})");
            Ok(())
        }
        ElasticOutcome::Failed { code } => {
            eprintln!("error: every worker is gone and none finished the training");
            std::process::exit(code.filter(|c| *c != 0).unwrap_or(1));
        }
    }
}

fn models() -> Result<()> {
    let cpu = burn::prelude::Device::flex();
    println!(
        "{:<14} {:>14}  (1000 classes, torchvision architecture)",
        "model", "parameters"
    );
    for arch in Architecture::ALL {
        // Lazy init: counting parameters allocates nothing.
        let n = arch.init(1000, &cpu)?.learnable_params();
        println!("{:<14} {:>14}", arch.name(), group_digits(n));
    }
    println!(
        "\n{:<14} {:>14}  (10 classes; `hearth train --model`, no torchvision weights)",
        "test-size", "parameters"
    );
    for name in hearth::train::MINI_MODELS {
        let n = hearth::train::model_config(name, 10)?
            .init(&cpu)?
            .learnable_params();
        println!("{name:<14} {:>14}", group_digits(n));
    }
    Ok(())
}

fn group_digits(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn units(a: UnitsArgs) -> Result<()> {
    let config = hearth::train::model_config(&a.model, a.classes)?;
    // Lazy init: counting parameters allocates nothing.
    let units = config.init_units(0..config.units(), &burn::prelude::Device::flex())?;
    let total: usize = units.iter().map(|u| u.learnable_params()).sum();
    println!(
        "{:>5}  {:<44} {:>12} {:>7}",
        "unit", "kind", "parameters", "cumul."
    );
    let mut sum = 0;
    for (i, u) in units.iter().enumerate() {
        let n = u.learnable_params();
        sum += n;
        println!(
            "{i:>5}  {:<44} {:>12} {:>6.1}%",
            u.kind(),
            group_digits(n),
            100.0 * sum as f64 / total.max(1) as f64
        );
    }
    println!(
        "{} units, {} parameters; split with e.g. --pipeline-split 0:{},{}:{}",
        units.len(),
        group_digits(total),
        units.len() / 2,
        units.len() / 2,
        units.len()
    );
    Ok(())
}

fn devices() -> Result<()> {
    println!("{:<12} {:<10} description", "device", "status");
    for d in DeviceChoice::ALL {
        let status = match d.probe() {
            Ok(_) => "ok".to_string(),
            Err(e) => format!("unavailable ({e})"),
        };
        let (short, rest) = match status.split_once(' ') {
            Some((a, b)) => (a.to_string(), format!("  {b}")),
            None => (status.clone(), String::new()),
        };
        println!("{:<12} {:<10} {}{}", d.name(), short, d.description(), rest);
    }
    for (name, feature) in DeviceChoice::left_out() {
        println!(
            "{name:<12} {:<10} not in this build: build with `--features {feature}`",
            "-"
        );
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
