//! `hearth train`: its arguments, augmentation flags, and local multi-process launch.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use hearth::device::DeviceSpec;
use hearth::dist::Compression;
use hearth::dist::pipeline::Schedule;
use hearth::schedule::{LrScaling, ScheduleKind};
use hearth::train::{
    AugmentPreset, FinetuneBn, Monitor, OptimizerKind, PipelineBalance, PipelineOptions,
};

use crate::cli::exit::exit_with;
use crate::cli::resume::take_recorded;

#[derive(Args)]
pub(crate) struct TrainArgs {
    /// Image folder: train/ and val/ class folders, or one folder split by --val-fraction.
    /// Without it a synthetic data set is generated into the run directory.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Multi-label CSV (`path,label1|label2|...`; paths relative to --data or the CSV's folder):
    /// one sigmoid per label, binary cross-entropy, per-class AUROC (CheXNet style).
    #[arg(long)]
    labels: Option<PathBuf>,
    /// Share of the images held out for validation when --data has no val/ (stratified by
    /// class, seeded by --seed).
    #[arg(long, default_value_t = 0.2)]
    val_fraction: f64,
    /// torchvision name (resnet50, densenet121, vgg16, ...), or a small test-size network:
    /// resnet-mini (the default), vgg-mini, vgg-mini-plain (no batch norm, no dropout),
    /// densenet-mini.
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
    /// Batch norm in the fine-tuning phase: `frozen` normalises by the running statistics of
    /// the frozen phase and keeps them (scales and shifts still train; Keras's way, robust to
    /// small per-rank batches), `batch` by each batch's statistics (PyTorch's train mode).
    #[arg(long, value_enum, default_value_t = FinetuneBn::Frozen, requires = "unfreeze_after")]
    finetune_bn: FinetuneBn,
    /// Passes over the training set.
    #[arg(long, default_value_t = 12)]
    epochs: usize,
    /// The global batch: images per optimizer step over all ranks together (split evenly
    /// over data-parallel ranks or pipelines).
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Peak learning rate (after --scale-lr), reached after --warmup-epochs and decayed by
    /// --schedule.
    #[arg(long, default_value_t = 0.05)]
    lr: f64,
    /// The optimizer.
    #[arg(long, value_enum, default_value_t = OptimizerKind::Sgd)]
    optimizer: OptimizerKind,
    /// SGD and LARS momentum (PyTorch semantics: no dampening; 0 for plain SGD). Refused with
    /// adam and adamw, which keep their own moment estimates.
    /// (default 0.9; 0 in the local steps of --mode downpour and dynsgd, whose servers add up
    /// the workers' changes)
    #[arg(long)]
    momentum: Option<f64>,
    /// Nesterov momentum (SGD with momentum above 0).
    #[arg(long)]
    nesterov: bool,
    /// L2 weight decay (SGD, Adam: not applied to biases and batch norm; AdamW: decoupled).
    #[arg(long, default_value_t = 5e-4)]
    weight_decay: f64,
    /// Learning-rate decay after warmup.
    #[arg(long, value_enum, default_value_t = ScheduleKind::Cosine)]
    schedule: ScheduleKind,
    /// Epochs of linear warmup from 0 to --lr before the --schedule decay.
    #[arg(long, default_value_t = 1)]
    warmup_epochs: usize,
    /// Scale --lr by the batch ratio: linear (Goyal et al.) or sqrt.
    #[arg(long, value_enum, requires = "base_batch")]
    scale_lr: Option<LrScaling>,
    /// The batch size --lr was tuned for (with --scale-lr).
    #[arg(long, requires = "scale_lr")]
    base_batch: Option<usize>,
    /// Label smoothing of the cross-entropy loss, in [0, 1) (single-label sets).
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
    /// Seed of the initialisation, the data split, the shuffling and the augmentation: the
    /// same seed and flags train the same run.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Default: runs/<timestamp>.
    #[arg(long)]
    run_dir: Option<PathBuf>,
    /// Continue the run in this directory from its last checkpoint.
    #[arg(long, conflicts_with = "run_dir")]
    resume: Option<PathBuf>,
    /// Replace the run already in --run-dir (its metrics, checkpoints and model files are
    /// deleted first); without it, a --run-dir holding a run is an error.
    #[arg(long, conflicts_with = "resume")]
    overwrite: bool,
    /// End this run after that epoch (its checkpoint written); --resume continues it exactly.
    #[arg(long)]
    stop_after_epoch: Option<usize>,
    /// Price of one process-hour (a GPU or a machine per rank), for the cost line of the
    /// summary: the job's wall time times its processes (an elastic job: its worker-hours).
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
    /// Gradient fusion bucket size in MiB (allreduce: data parallel, elastic, pipeline replicas).
    #[arg(long, default_value_t = 25.0)]
    bucket_mb: f64,
    /// Wire format of gradient averaging in distributed runs (default: the training
    /// precision's, so none in fp32, bf16 in a bf16 run, fp16 in an fp16 run).
    #[arg(long, value_enum)]
    compression: Option<Compression>,
    /// The type steps compute in: fp32, or bf16/fp16 mixed precision with f32 master weights
    /// (fp16 with dynamic loss scaling; skipped steps in metrics.csv). Every mode; wgpu
    /// devices have no bf16.
    #[arg(long, value_enum, default_value_t = hearth::train::Precision::Fp32)]
    precision: hearth::train::Precision,
    /// Sharded optimizer (ZeRO) in data parallel, pipelines with replicas and elastic
    /// training: 1 keeps 1/N of the optimizer state on each of the N ranks, 2 the averaged
    /// gradients too; 0 off (elastic workers also keep a replica of the next one's share, so a
    /// lost worker loses no state). The state is checkpointed as whole named tensors, so a run
    /// resumes on any number of ranks.
    #[arg(long, value_name = "STAGE", default_value_t = 0)]
    zero: u8,
    /// Activation recomputation: keep only each unit's input (a ResNet block, a DenseNet
    /// layer; in pipelines each stage's) from the forward and compute the unit again in the
    /// backward. Less memory for one more forward per step; every mode of the image models.
    #[arg(long, overrides_with = "no_recompute")]
    recompute: bool,
    /// No activation recomputation (the default): turns a resumed run's --recompute off.
    #[arg(long, overrides_with = "recompute")]
    no_recompute: bool,
    /// Data parallel and elastic: overlap the gradient exchange with the backward pass. The
    /// model runs unit by unit and each unit's gradients are averaged, in --bucket-mb buckets,
    /// while the units before it compute (as PyTorch DDP's buckets do). The same result as
    /// without it. Pays off between hosts (1 Gbit/s: a ResNet-50 step 20% shorter); on one
    /// host the exchange shares the backward pass's cores and measured no faster.
    #[arg(long)]
    overlap: bool,
    /// Pipeline model parallelism: split the model into P stages, one per process (--nproc
    /// defaults to P; a multiple P x D trains D pipelines data parallel).
    #[arg(long, value_name = "P")]
    pipeline_stages: Option<usize>,
    /// Micro-batches per step of each pipeline (its batch is cut into M).
    /// (default 4)
    #[arg(long, value_name = "M", requires = "pipeline_stages")]
    micro_batches: Option<usize>,
    /// Pipeline schedule: 1f1b holds at most P micro-batches of activations, gpipe all M.
    /// (default 1f1b)
    #[arg(long, value_enum, requires = "pipeline_stages")]
    pipeline_schedule: Option<Schedule>,
    /// Unit ranges of the stages, e.g. 0:2,2:5 (default: balanced by --pipeline-balance).
    #[arg(long, value_name = "A:B,...", requires = "pipeline_stages")]
    pipeline_split: Option<String>,
    /// How the stages are balanced when no --pipeline-split is given.
    /// (default params)
    #[arg(long, value_enum, requires = "pipeline_stages")]
    pipeline_balance: Option<PipelineBalance>,
    /// Elastic data parallelism: workers may join and leave between steps while the global
    /// batch stays --batch-size (run under `hearth launch --elastic`, or join a running job
    /// given HEARTH_ELASTIC_PEERS or --hosts).
    #[arg(long, conflicts_with = "pipeline_stages")]
    elastic: bool,
    /// Fewest workers an elastic job trains with; below it, it waits --rejoin-timeout for
    /// joiners, then saves its state and fails.
    /// (default 1)
    #[arg(long, requires = "elastic")]
    min_workers: Option<usize>,
    /// Most workers an elastic job admits (later joiners wait for room); default 64, or
    /// --batch-size when smaller (each worker needs a sample of the global batch).
    #[arg(long, requires = "elastic")]
    max_workers: Option<usize>,
    /// Seconds an elastic job below --min-workers waits for joiners.
    /// (default 300)
    #[arg(long, requires = "elastic")]
    rejoin_timeout: Option<f64>,
    /// How an elastic job shares the global batch: even, or by each worker's measured speed.
    /// (default even)
    #[arg(long, value_enum, requires = "elastic")]
    balance: Option<hearth::train::Balance>,
    /// File of elastic join addresses (host:port per line), re-read while joining.
    #[arg(long, requires = "elastic")]
    hosts: Option<PathBuf>,
    /// Parameter servers: P of the --nproc ranks serve the model's shards and the others
    /// train, or `colocated` (every rank trains and also serves a shard).
    #[arg(long, value_name = "P|colocated", conflicts_with_all = ["elastic", "pipeline_stages"])]
    ps: Option<String>,
    /// Parameter-server mode: sync (equals allreduce data parallel), downpour, adag, dynsgd,
    /// easgd (update rules and sources in `burn_dist::ps::rules`).
    /// (default adag)
    #[arg(long, requires = "ps")]
    mode: Option<String>,
    /// Steps between a worker's exchanges with the servers (asynchronous modes).
    /// (default 2 for downpour and easgd, 5 for adag and dynsgd)
    #[arg(long, requires = "ps")]
    window: Option<usize>,
    /// EASGD's rho: the elastic force is alpha = rate x rho, following the schedule (at most 1).
    /// (default: 0.5 / the peak rate, so that alpha is 0.5 at the peak)
    #[arg(long, requires = "ps")]
    rho: Option<f64>,
    /// Most steps a worker may run ahead of the slowest one (stale synchronous parallel).
    #[arg(long, value_name = "S", requires = "ps")]
    staleness: Option<u64>,
    /// Check the settings and print what hparams.json would record, then exit: no data is
    /// read, nothing is launched or written.
    #[arg(long)]
    dry_run: bool,
}

/// The parameter-server settings from the flags.
fn ps_options(a: &TrainArgs) -> Result<Option<hearth::train::PsOptions>> {
    let Some(servers) = &a.ps else {
        return Ok(None);
    };
    Ok(Some(hearth::train::PsOptions {
        servers: servers.parse()?,
        mode: a.mode.as_deref().unwrap_or("adag").parse()?,
        window: a.window,
        rho: a.rho,
        staleness: a.staleness,
    }))
}

/// The elastic settings from the flags and the launcher's variables.
fn elastic_options(a: &TrainArgs) -> Result<hearth::train::ElasticOptions> {
    let rejoin_timeout = a.rejoin_timeout.unwrap_or(300.0);
    if !(rejoin_timeout.is_finite() && rejoin_timeout > 0.0) {
        bail!("--rejoin-timeout {rejoin_timeout} must be positive seconds");
    }
    Ok(hearth::train::ElasticOptions {
        min_workers: a.min_workers.unwrap_or(1),
        max_workers: a.max_workers.unwrap_or(a.batch_size.clamp(1, 64)),
        rejoin_timeout: std::time::Duration::from_secs_f64(rejoin_timeout),
        balance: a.balance.unwrap_or_default(),
        hosts_file: a.hosts.clone(),
        ..Default::default()
    }
    .with_env()?)
}

/// The run's configuration from the flags, for a rank of `dist` (or one process).
fn build_config(
    a: &TrainArgs,
    dist: Option<hearth::dist::rendezvous::RankInfo>,
) -> Result<hearth::train::TrainConfig> {
    use hearth::train::TrainConfig;
    mode_flags(a)?;
    let augment = augmentation(a)?;
    let elastic = a.elastic.then(|| elastic_options(a)).transpose()?;
    let ps = ps_options(a)?;
    let (run_dir, resume) = match (a.resume.clone(), a.run_dir.clone()) {
        (Some(dir), _) => (dir, true),
        (None, Some(dir)) => (dir, false),
        (None, None) => (default_run_dir(), false),
    };
    let mut cfg = TrainConfig::new(run_dir);
    cfg.resume = resume;
    cfg.data = a.data.clone();
    cfg.labels = a.labels.clone();
    cfg.unfreeze_after = a.unfreeze_after;
    cfg.finetune_lr = a.finetune_lr;
    cfg.finetune_bn = a.finetune_bn;
    cfg.val_fraction = a.val_fraction;
    cfg.model = a.model.clone();
    cfg.weights = a.weights.clone();
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
    cfg.overwrite = a.overwrite;
    cfg.grad_accum = a.grad_accum;
    cfg.bucket_bytes = (a.bucket_mb * 1024.0 * 1024.0) as usize;
    cfg.precision = a.precision;
    cfg.zero = a.zero;
    cfg.recompute = a.recompute && !a.no_recompute;
    cfg.overlap = a.overlap;
    cfg.pipeline = match a.pipeline_stages {
        Some(stages) => Some(PipelineOptions {
            stages,
            micro_batches: a.micro_batches.unwrap_or(4),
            schedule: a.pipeline_schedule.unwrap_or(Schedule::OneFOneB),
            split: a
                .pipeline_split
                .as_deref()
                .map(PipelineOptions::parse_split)
                .transpose()?,
            balance: a.pipeline_balance.unwrap_or(PipelineBalance::Params),
        }),
        None => None,
    };
    cfg.elastic = elastic;
    cfg.ps = ps;
    cfg.dist = dist;
    // Gradients travel in the training precision unless --compression says otherwise.
    cfg.compression = match a.compression {
        Some(c) => c,
        None if cfg.exchanges_by_allreduce() => cfg.precision.wire(),
        None => Compression::None,
    };
    Ok(cfg)
}

/// A mode's own flags without the mode are an error naming both (clap's `requires` does not
/// fire beside an argument that conflicts with the mode, as `--ps` with `--micro-batches`).
fn mode_flags(a: &TrainArgs) -> Result<()> {
    // (mode given, its flag, its own flags: (given, name)).
    type Mode<'a> = (bool, &'a str, &'a [(bool, &'a str)]);
    let modes: [Mode; 3] = [
        (
            a.pipeline_stages.is_some(),
            "--pipeline-stages",
            &[
                (a.micro_batches.is_some(), "--micro-batches"),
                (a.pipeline_schedule.is_some(), "--pipeline-schedule"),
                (a.pipeline_split.is_some(), "--pipeline-split"),
                (a.pipeline_balance.is_some(), "--pipeline-balance"),
            ],
        ),
        (
            a.elastic,
            "--elastic",
            &[
                (a.min_workers.is_some(), "--min-workers"),
                (a.max_workers.is_some(), "--max-workers"),
                (a.rejoin_timeout.is_some(), "--rejoin-timeout"),
                (a.balance.is_some(), "--balance"),
                (a.hosts.is_some(), "--hosts"),
            ],
        ),
        (
            a.ps.is_some(),
            "--ps",
            &[
                (a.mode.is_some(), "--mode"),
                (a.window.is_some(), "--window"),
                (a.rho.is_some(), "--rho"),
                (a.staleness.is_some(), "--staleness"),
            ],
        ),
    ];
    for (on, mode, flags) in modes {
        if let Some((_, flag)) = flags.iter().find(|(set, _)| *set && !on) {
            bail!("{flag} belongs to {mode}, which this run does not use");
        }
    }
    unread_flags(a)
}

/// Flags given where the run would not read them, even at their default value (the settings'
/// own check refuses the values it can tell from the defaults).
fn unread_flags(a: &TrainArgs) -> Result<()> {
    let mode = a.mode.as_deref().unwrap_or("adag");
    if a.rho.is_some() && a.ps.is_some() && mode != "easgd" {
        bail!("--rho is EASGD's elastic force; --mode {mode} does not use it (--mode easgd does)");
    }
    if a.ps.is_some() && mode == "sync" {
        if a.window.is_some() {
            bail!(
                "--window sets how often an asynchronous worker exchanges; --mode sync exchanges \
                 every step"
            );
        }
        if a.staleness.is_some() {
            bail!(
                "--staleness bounds how far asynchronous workers run ahead; --mode sync waits \
                 for every worker at every step"
            );
        }
    }
    if a.momentum.is_some() && matches!(a.optimizer, OptimizerKind::Adam | OptimizerKind::AdamW) {
        bail!(
            "--momentum applies to sgd and lars; --optimizer {} keeps its own moment estimates \
             (betas 0.9 and 0.999)",
            if a.optimizer == OptimizerKind::Adam {
                "adam"
            } else {
                "adamw"
            }
        );
    }
    if a.pipeline_balance.is_some() && a.pipeline_split.is_some() {
        bail!(
            "--pipeline-balance chooses where the stages split; --pipeline-split gives the split \
             itself, so one of them would be ignored"
        );
    }
    Ok(())
}

/// `--dry-run`: the settings passed every check; what `hparams.json` would record.
fn dry_run(cfg: &hearth::train::TrainConfig) -> Result<()> {
    eprintln!("hearth train --dry-run: the settings are valid; nothing was read or written");
    // Under `hearth launch --elastic`, a worker's dry run is its whole job.
    if let Ok(id) = std::env::var("HEARTH_ELASTIC_ID") {
        hearth::train::mark_finished(&id);
    }
    println!(
        "{}",
        hearth::train::run_dir::hparams_json(&cfg.hyperparameters())
    );
    Ok(())
}

/// The training command line again, without `--nproc`, with an explicit run directory.
pub(crate) fn rank_args(run_dir: &std::path::Path) -> Vec<String> {
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

pub(crate) fn default_run_dir() -> PathBuf {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    PathBuf::from("runs").join(secs.to_string())
}

/// The preset with the per-transform flags applied.
pub(crate) fn augmentation(a: &TrainArgs) -> Result<hearth::datasets::Augmentation> {
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

pub(crate) fn train_cmd(device_name: &str, a: TrainArgs) -> Result<()> {
    use hearth::train::train;
    let in_job = std::env::var_os("HEARTH_RANK").is_some();
    // A bare `--resume RUN` starts the run as it was started: its processes, and elastic only
    // through `hearth launch --elastic`.
    let mut a = a;
    if let Some(run) = a.resume.clone().filter(|_| !in_job)
        && let Some(then) = crate::cli::resume::recorded_launch(&run)?
    {
        if then.elastic && !a.elastic {
            bail!(
                "{} was trained with --elastic: resume it as it ran, `hearth launch --elastic -n \
                 {} -- hearth train --elastic --resume {} ...`",
                run.display(),
                then.processes,
                run.display()
            );
        }
        if !then.elastic && !crate::cli::resume::given("--nproc") && then.processes > 1 {
            eprintln!(
                "--resume: {} processes, as {} was trained (--nproc {})",
                then.processes,
                run.display(),
                then.processes
            );
            a.nproc = then.processes;
        }
    }
    // A pipeline of P stages needs P processes at least.
    let nproc = match a.pipeline_stages {
        Some(p) if a.nproc == 1 => p,
        _ => a.nproc,
    };
    if a.elastic && !in_job && nproc > 1 {
        bail!(
            "--elastic with --nproc: start the workers with `hearth launch --elastic -n {nproc} \
             --min M --max N -- hearth train --elastic ...`"
        );
    }
    let launching = nproc > 1 && !in_job;
    let dist = if launching {
        Some(hearth::dist::rendezvous::RankInfo {
            rank: 0,
            world: nproc,
            local_rank: Some(0),
            coordinator: "127.0.0.1:0".into(),
            source: "--nproc",
        })
    } else {
        // Inside a job (hearth launch, torchrun, Slurm, mpirun): join it. Half-set or malformed
        // launcher variables are an error, never a silent single-process run.
        hearth::dist::rendezvous::RankInfo::detect()
            .context("reading the launcher's environment")?
            .filter(|info| info.world > 1 || a.elastic)
    };
    let mut cfg = build_config(&a, dist)?;
    let taken = take_recorded(&mut cfg)?;
    if !taken.is_empty() && (launching || a.dry_run || cfg.dist.is_none()) {
        eprintln!(
            "--resume: {} setting(s) from {} ({}); the command line's own win",
            taken.len(),
            cfg.run_dir.join("hparams.json").display(),
            taken.join(", ")
        );
    }
    // Settings that run but probably not as meant: said once, by the process the user started
    // (not by every rank of a job).
    if launching || a.dry_run || cfg.dist.is_none() {
        for w in cfg.warnings() {
            eprintln!("warning: {w}");
        }
    }
    if launching || a.dry_run {
        // Refused settings are said once, here, not by every launched rank; a dry run stops
        // after the checks, before any device starts.
        cfg.validate()?;
        hearth::train::run_dir::check_fresh(&cfg)?;
        if a.dry_run {
            return dry_run(&cfg);
        }
    }
    if launching {
        let run_dir = a
            .resume
            .clone()
            .or(a.run_dir.clone())
            .unwrap_or_else(default_run_dir);
        eprintln!(
            "launching {nproc} ranks; run directory: {}",
            run_dir.display()
        );
        let outcome = hearth::launch::launch(&hearth::launch::LaunchConfig {
            nproc,
            program: std::env::current_exe().context("locating the hearth binary")?,
            args: rank_args(&run_dir),
            port: 0,
            prefix: true,
        })?;
        return exit_with(outcome);
    }
    let spec: DeviceSpec = device_name.parse()?;
    let spec = spec.for_local_rank(cfg.dist.as_ref().and_then(|d| d.local_rank));
    let device = spec.device()?;
    if let Some(info) = &cfg.dist {
        eprintln!(
            "rank {} of {}: device {spec}{}",
            info.rank,
            info.world,
            info.local_rank
                .map(|l| format!(" (local rank {l})"))
                .unwrap_or_default()
        );
    }
    let rank0 = cfg.dist.as_ref().is_none_or(|d| d.rank == 0);
    if rank0 {
        eprintln!("run directory: {}", cfg.run_dir.display());
    }
    // A run that fails leaves no empty folder behind (one it did not create stays).
    let existed = cfg.run_dir.exists();
    let outcome = train(&cfg, &device, &mut |line| eprintln!("{line}"));
    if outcome.is_err() && !existed {
        // Only an empty directory is removed: whatever the run wrote stays for inspection.
        let _ = std::fs::remove_dir(&cfg.run_dir);
    }
    let report = match outcome {
        Ok(r) => r,
        // A graceful elastic leave ends this worker, not the job.
        Err(hearth::HearthError::LeftJob { id, step }) => {
            eprintln!("{id} left the job after step {step}");
            return Ok(());
        }
        Err(e) => return Err(e.into()),
    };
    // Every rank's own peak (ranks differ: rank 0 writes checkpoints, --zero shards state).
    let peak = hearth::loader_bench::peak_rss_mb();
    if peak > 0.0 {
        let heap = hearth::alloc::peak_live_bytes()
            .map(|b| format!(", heap at most {:.0} MB live", b as f64 / 1e6))
            .unwrap_or_default();
        eprintln!(
            "peak memory of rank {} (resident, VmHWM): {peak:.0} MB{heap}",
            report.rank
        );
    }
    if report.rank != 0 {
        return Ok(());
    }
    if let Some(ps) = &cfg.ps {
        println!(
            "trained with parameter servers ({}, mode {}): global batch {}",
            match ps.servers {
                hearth::train::PsServers::Dedicated(p) => format!("{p} dedicated"),
                hearth::train::PsServers::Colocated => "colocated".to_string(),
            },
            ps.mode,
            cfg.batch_size
        );
    }
    match &cfg.pipeline {
        _ if cfg.ps.is_some() => {}
        Some(p) => {
            let pipelines = (report.world / p.stages.max(1)).max(1);
            println!(
                "trained on {} ranks: {} pipelines of {} stages, global batch {} ({} per pipeline, {} micro-batches)",
                report.world,
                pipelines,
                p.stages,
                cfg.batch_size,
                cfg.batch_size / pipelines,
                p.micro_batches
            );
        }
        None if report.world > 1 => println!(
            "trained on {} ranks, global batch {} ({} per rank)",
            report.world,
            cfg.batch_size,
            cfg.batch_size / report.world
        ),
        None => {}
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
    if !report.skipped.is_empty() {
        println!(
            "skipped {} image(s) that failed to decode (never trained or validated on{}):",
            report.skipped.len(),
            if report.world > 1 {
                "; every rank's"
            } else {
                ""
            }
        );
        for s in &report.skipped {
            println!("  {s}");
        }
    }
    Ok(())
}
