//! `hearth train`: the settings from its flags (`train_args.rs`), their checks, augmentation,
//! local multi-process launch, and the summary at the end.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use hearth::device::DeviceSpec;
use hearth::dist::Compression;
use hearth::dist::pipeline::Schedule;
use hearth::train::{OptimizerKind, PipelineBalance, PipelineOptions, TrainingMode};

use crate::commands::exit::exit_with;
use crate::commands::resume::take_recorded;
use crate::commands::train_args::TrainArgs;

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
    cfg.checkpoint.resume = resume;
    cfg.data.folder = a.data.clone();
    cfg.data.labels = a.labels.clone();
    cfg.model.unfreeze_after = a.unfreeze_after;
    cfg.model.finetune_lr = a.finetune_lr;
    cfg.model.finetune_bn = a.finetune_bn;
    cfg.data.val_fraction = a.val_fraction;
    cfg.model.name = a.model.clone();
    cfg.model.weights = a.weights.clone();
    cfg.model.freeze_backbone = a.freeze_backbone;
    cfg.epochs = a.epochs;
    cfg.batch_size = a.batch_size;
    cfg.optim.lr = a.lr;
    cfg.optim.optimizer = a.optimizer;
    cfg.optim.momentum = a.momentum;
    cfg.optim.nesterov = a.nesterov;
    cfg.optim.weight_decay = a.weight_decay;
    cfg.optim.schedule = a.schedule.decay();
    cfg.optim.warmup_epochs = a.warmup_epochs;
    cfg.optim.scale_lr = match (a.scale_lr, a.base_batch) {
        (Some(rule), Some(base)) => Some((rule, base)),
        _ => None,
    };
    cfg.optim.label_smoothing = a.label_smoothing;
    cfg.optim.clip_grad = a.clip_grad;
    cfg.optim.model_ema = match (a.model_ema, a.model_ema_decay) {
        (true, d) => Some(d.unwrap_or(0.9998)),
        (false, Some(_)) => bail!("--model-ema-decay without --model-ema: no average is kept"),
        (false, None) => None,
    };
    cfg.checkpoint.monitor = a.monitor;
    cfg.checkpoint.patience = a.patience;
    cfg.checkpoint.min_delta = a.min_delta;
    cfg.data.image_size = a.size;
    cfg.data.augmentation = augment;
    cfg.data.workers = a.workers;
    cfg.data.mixup = a.mixup;
    cfg.data.cutmix = a.cutmix;
    cfg.data.mixup_prob = a.mixup_prob;
    cfg.data.mixup_switch_prob = a.mixup_switch_prob;
    cfg.data.mixup_off_epoch = a.mixup_off_epoch;
    cfg.seed = a.seed;
    cfg.price_per_hour = a.price_per_hour;
    cfg.checkpoint.stop_after_epoch = a.stop_after_epoch;
    cfg.checkpoint.log_every = a.log_every;
    cfg.checkpoint.overwrite = a.overwrite;
    cfg.optim.grad_accum = a.grad_accum;
    // A negative or NaN size saturates to 0, which validation refuses by name.
    cfg.exchange.bucket_bytes = a.bucket_mb.map(|mb| (mb * 1024.0 * 1024.0) as usize);
    cfg.compute.precision = a.precision;
    cfg.exchange.zero = a.zero;
    cfg.compute.recompute = a.recompute && !a.no_recompute;
    cfg.exchange.overlap = a.overlap;
    // clap refuses two mode flags together (--elastic, --ps, --pipeline-stages).
    cfg.mode = match (a.pipeline_stages, elastic, ps) {
        (Some(stages), _, _) => TrainingMode::Pipeline(PipelineOptions {
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
        (None, Some(e), _) => TrainingMode::Elastic(e),
        (None, None, Some(p)) => TrainingMode::ParameterServers(p),
        (None, None, None) => TrainingMode::DataParallel,
    };
    cfg.dist = dist;
    // Gradients travel in the training precision unless --compression says otherwise.
    cfg.exchange.compression = match a.compression {
        Some(c) => c,
        None if cfg.exchanges_by_allreduce() => cfg.compute.precision.wire(),
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
    if let Some(p) = a.random_erasing {
        aug.random_erasing = p;
    }
    if let Some(p) = &a.auto_augment {
        aug.auto_augment = Some(p.parse().with_context(|| format!("--auto-augment {p}"))?);
    }
    Ok(aug)
}

pub(crate) fn train_cmd(device_name: &str, a: TrainArgs) -> Result<()> {
    use hearth::train::train;
    let in_job = std::env::var_os("HEARTH_RANK").is_some();
    if a.nproc == 0 {
        bail!("--nproc 0: a job needs at least 1 process");
    }
    let mut a = a;
    resume_as_started(&mut a, in_job)?;
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
            eprintln!("warning: {}", hearth::settings::flags::with_flags(&w));
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
        return launch_ranks(&a, nproc);
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
    // The library names settings (`exchange.overlap`); this command line says its flags.
    let outcome = train(&cfg, &device, &mut |line| {
        eprintln!("{}", hearth::settings::flags::with_flags(line))
    });
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
    summarise(&cfg, &report);
    Ok(())
}

/// A bare `--resume RUN` starts the run as it was started: its processes, and elastic only
/// through `hearth launch --elastic`. Then `--weights imagenet` becomes the file's path.
fn resume_as_started(a: &mut TrainArgs, in_job: bool) -> Result<()> {
    if let Some(run) = a.resume.clone().filter(|_| !in_job)
        && let Some(then) = crate::commands::resume::recorded_launch(&run)?
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
        if !then.elastic && !crate::commands::resume::given("--nproc") && then.processes > 1 {
            eprintln!(
                "--resume: {} processes, as {} was trained (--nproc {})",
                then.processes,
                run.display(),
                then.processes
            );
            a.nproc = then.processes;
        }
    }
    // `--weights imagenet`: fetched here, once, by the process the user started (the ranks it
    // launches find it in the cache).
    a.weights = crate::commands::weights::resolve(a.weights.take(), &a.model, a.dry_run)?;
    Ok(())
}

/// What the process the user started prints at the end: every rank its peak memory, rank 0
/// the layout of the job, the best epoch, time and cost, the model's place and its scores.
fn summarise(cfg: &hearth::train::TrainConfig, report: &hearth::train::TrainReport) {
    // Every rank's own peak (ranks differ: rank 0 writes checkpoints, --zero shards state).
    let peak = hearth::alloc::peak_rss_mb();
    if peak > 0.0 {
        let mut heap = hearth::alloc::peak_live_bytes()
            .map(|b| format!(", heap at most {:.0} MB live", b as f64 / 1e6))
            .unwrap_or_default();
        if let Some(start) = hearth::alloc::start_peak_bytes() {
            heap.push_str(&format!(
                " ({:.1} MB by the end of the start)",
                start as f64 / 1e6
            ));
        }
        if let Some(rise) = hearth::alloc::step_rise_bytes() {
            heap.push_str(&format!(
                ", a training step at most {:.1} MB above what steps leave",
                rise as f64 / 1e6
            ));
            let at = hearth::alloc::phase::at_largest_rise();
            if at != hearth::alloc::phase::Phase::Step {
                heap.push_str(&format!(" (its peak in {at})"));
            }
        }
        eprintln!(
            "peak memory of rank {} (resident, VmHWM): {peak:.0} MB{heap}",
            report.rank
        );
    }
    if report.rank != 0 {
        return;
    }
    if let Some(ps) = cfg.mode.ps() {
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
    match cfg.mode.pipeline() {
        _ if cfg.mode.ps().is_some() => {}
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
}

/// `--nproc N` outside a job: this process launches the N ranks on this machine and waits.
fn launch_ranks(a: &TrainArgs, nproc: usize) -> Result<()> {
    let run_dir = a
        .resume
        .clone()
        .or(a.run_dir.clone())
        .unwrap_or_else(default_run_dir);
    eprintln!(
        "launching {nproc} ranks; run directory: {}",
        run_dir.display()
    );
    let outcome = crate::commands::launch::launch(&crate::commands::launch::LaunchConfig {
        nproc,
        program: std::env::current_exe().context("locating the hearth binary")?,
        args: rank_args(&run_dir),
        port: 0,
        prefix: true,
    })?;
    exit_with(outcome)
}
