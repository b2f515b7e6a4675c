//! The elastic mode's entry points: [`train`] for Hearth's image models and [`train_with`]
//! for any trainee, which build the run and drive it through the shared epoch loop
//! (`members.rs`).

use super::*;

pub(crate) fn train(
    cfg: &TrainConfig,
    opts: &ElasticOptions,
    device: &Device,
    log: &mut dyn FnMut(&str),
) -> Result<TrainReport> {
    if cfg.data.folder.is_none() {
        return Err(HearthError::InvalidArgument(
            "`TrainingMode::Elastic` needs `data.folder` (workers start at different times, so none may generate the \
             synthetic set for the others: write one with `hearth data synth`)"
                .into(),
        ));
    }
    train_with(cfg, opts, &ImageRecipe, device, log)
}

/// What a worker is before its first world: the job's membership (by its secret), its place
/// in the job's first world if launched into it, its join service, and its name and machine.
struct Entry {
    membership: burn_dist::tls::Membership,
    initial: Option<burn_dist::rendezvous::RankInfo>,
    join: JoinService,
    me: Worker,
}

impl Entry {
    fn new(cfg: &TrainConfig, opts: &ElasticOptions) -> Result<Self> {
        let membership = burn_dist::tls::Membership::from_env()?;
        if !matches!(membership, burn_dist::tls::Membership::Secret { .. }) {
            return Err(HearthError::InvalidArgument(
                "`TrainingMode::Elastic` needs a job secret (HEARTH_JOB_SECRET): members change ranks, which \
                 per-rank certificates cannot follow"
                    .into(),
            ));
        }
        let initial = cfg.dist.clone();
        if initial.is_none() && !opts.joiner {
            return Err(HearthError::InvalidArgument(
                "`TrainingMode::Elastic` needs this worker's place in the job (`TrainConfig::dist`, \
                 from an elastic launcher's variables), or joins a job given \
                 HEARTH_ELASTIC_PEERS or `ElasticOptions.hosts_file`"
                    .into(),
            ));
        }
        let loopback = initial.as_ref().is_none_or(|i| {
            i.coordinator.starts_with("127.") || i.coordinator.starts_with("localhost")
        });
        let join_addr = opts.join_addr.unwrap_or(SocketAddr::new(
            if loopback {
                IpAddr::V4(Ipv4Addr::LOCALHOST)
            } else {
                IpAddr::V4(Ipv4Addr::UNSPECIFIED)
            },
            0,
        ));
        let join = JoinService::bind(
            join_addr,
            &membership,
            Role::Busy,
            &burn_dist::transport::quic::QuicProfiles::from_env(),
        )?;
        let id = opts.id.clone().unwrap_or_else(|| match &initial {
            Some(i) => format!("w{}", i.rank),
            None => format!("{}:{}", join_addr.ip(), std::process::id()),
        });
        let me = Worker {
            host: opts.host.clone().unwrap_or_else(|| machine(&id)),
            id,
        };
        Ok(Self {
            membership,
            initial,
            join,
            me,
        })
    }
}

/// An elastic worker of `recipe`'s model and data.
pub(crate) fn train_with<R: Recipe>(
    cfg: &TrainConfig,
    opts: &ElasticOptions,
    recipe: &R,
    device: &Device,
    log: &mut dyn FnMut(&str),
) -> Result<TrainReport> {
    let started = Instant::now();
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGTERM, on_sigterm as *const () as libc::sighandler_t);
    }
    let Entry {
        membership,
        initial,
        join,
        me,
    } = Entry::new(cfg, opts)?;
    // Every worker reads the whole set: which part of it a worker trains on changes with
    // the membership.
    let trainee = recipe.prepare(cfg, None, 0, 1, &mut |_| {})?;
    let objective = Objective::new(cfg, trainee.multi_label());
    let batches_per_epoch = trainee.train_len().div_ceil(cfg.batch_size).max(1);
    let limits = Limits {
        min: opts.min_workers,
        max: opts.max_workers,
        rejoin_timeout: opts.rejoin_timeout,
        ..Limits::default()
    };
    let mut run = ElasticRun {
        cfg,
        opts,
        device: device.clone().autodiff(),
        plain_device: device.clone(),
        trainee,
        rates: Rates::new(cfg, cfg.scaled_lr(&mut |_| {})?, batches_per_epoch)?,
        objective,
        batches_per_epoch,
        steps_per_epoch: cfg.optimizer_steps(batches_per_epoch),
        membership,
        join,
        coordinator: Membership::new(limits, Vec::new()),
        me,
        started,
        speed: 0.0,
        bound: None,
        next_members: None,
        launch: String::new(),
        fence: fence::Fence::new(&cfg.run_dir),
        token: None,
        state_limit: std::cell::OnceCell::new(),
        faults: Default::default(),
        zero: None,
        exchange: Exchange::new(&cfg.exchange, ReduceOp::Sum),
        step_log: None,
    };
    run.faults = crate::train::faults::Faults::elastic(&run.me.id, cfg.compute.precision);
    let (world, commit) = match &initial {
        Some(info) => run.first_world(info, log)?,
        None => run.join_world(log)?,
    };
    if cfg.exchange.zero > 0 {
        run.zero = Some(match &initial {
            Some(_) => run.first_shards(&world, &commit, log)?,
            None => run.reshard(&world, &commit, None, log)?,
        });
    }
    run.train(world, commit, log)
}
