//! Elastic data parallelism as a training mode (`hearth train --elastic`, usually started by
//! `hearth launch --elastic`): workers join and leave between optimizer steps, nobody restarts,
//! and the global batch stays `--batch-size`.
//!
//! A step: every worker computes the gradient of its share of the step's samples
//! ([`burn_dist::elastic::step_positions`]: the next `global` positions of the epoch's order,
//! shared evenly or by measured throughput), then one small allreduce of the step's control
//! vector (who asks to leave, whether joiners wait at rank 0, the step's loss and sample
//! counts, each worker's samples per second), then the gradients summed with each worker's
//! weighted by its samples over the step's total (so the update is the mean over the global
//! batch, as one process would compute it), the optimizer step, and the commit: model,
//! optimizer, step, epoch position and the epoch's metric sums move together. A step that
//! fails anywhere (a peer killed, a cut link) commits nothing.
//!
//! Changes: a graceful leave (SIGTERM: finish the step, exit 0) or joiners waiting make every
//! member see the same control vector, so all of them start the same change after the same
//! step. A failure is seen by each survivor when its links to the dead worker time out (the
//! full mesh of QUIC links, keep-alives every second, 5 s idle timeout on loopback); the
//! survivors then greet each other over the links that still work and count who answered. In
//! both cases the lowest surviving rank coordinates: it takes in the joiners waiting at its join
//! service (refusing blacklisted hosts), waits up to `--rejoin-timeout` when fewer than
//! `--min-workers` remain (then writes `checkpoint/elastic.state` and fails saying so), announces
//! the next membership epoch over the old links, and runs its rendezvous; its committed state
//! (model, optimizer, step, position, metrics so far) goes to every member of the new world,
//! so all of them, joiners included, hold bit-identical state and go on from the same step.
//! Rank 0 writes checkpoints and metrics; if it dies, the next rank 0 does.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{GradientsParams, ModuleOptimizer, OptimizerRecord};
use burn::prelude::*;
use burn::store::ModuleRecord;
use burn::tensor::Bytes;
use burn_dist::elastic::join::{JoinService, Reply, Role, request_join};
use burn_dist::elastic::membership::{Decision, Epoch, Limits, Membership, Worker};
use burn_dist::elastic::reform::Announcement;
use burn_dist::elastic::{broadcast_bytes, step_len, step_positions};
use burn_dist::rendezvous::{RankInfo, RendezvousOptions, bind_coordinator, connect_epoch_on};
use burn_dist::transport::quic::QuicTransport;
use burn_dist::wire::Kind;
use burn_dist::{Communicator, ReduceOp, Transport};
use hearth_datasets::BatchStream;
use hearth_models::{Classifier, ModelConfig, Preprocessing, save_model_with};

use super::best::{BestRule, Patience, best_epoch, model_checkpoint};
use super::logger::{EpochTable, metrics_csv};
use super::model::{SEED_LOCK, epoch_seed, init_model, model_config, optimizer};
use super::pipeline::hits;
use super::{EpochRows, TrainConfig, TrainReport, run_dir, sets};
use crate::schedule::Schedule as LrSchedule;
use crate::{HearthError, Result};

/// How the global batch is shared between the workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Balance {
    /// global / world each, the remainder to the first workers.
    #[default]
    Even,
    /// In proportion to each worker's measured samples per second (re-measured as it trains),
    /// so a slow worker and a fast one finish their steps together.
    Throughput,
}

/// Elastic membership settings (`hearth train --elastic`).
#[derive(Debug, Clone)]
pub struct ElasticOptions {
    pub min_workers: usize,
    pub max_workers: usize,
    /// How long a world below `min_workers` waits for joiners before giving up.
    pub rejoin_timeout: Duration,
    pub balance: Balance,
    /// This worker's name in the job (`HEARTH_ELASTIC_ID`; initial workers default to `w<rank>`,
    /// joiners to `<host>:<pid>`).
    pub id: Option<String>,
    /// The host its failures count against for the blacklist (`HEARTH_ELASTIC_HOST`; default:
    /// the id).
    pub host: Option<String>,
    /// Where this worker listens for joiners (`HEARTH_ELASTIC_ADDR`; default 127.0.0.1 or
    /// 0.0.0.0, any port).
    pub join_addr: Option<SocketAddr>,
    /// Join a running job through these join addresses instead of starting one
    /// (`HEARTH_ELASTIC_PEERS`, comma-separated).
    pub peers: Vec<String>,
    /// A file of join addresses, one `host:port` per line, re-read while joining
    /// (`--hosts` / `HEARTH_ELASTIC_HOSTS`).
    pub hosts_file: Option<PathBuf>,
    /// This process joins a running job (no `HEARTH_RANK`).
    pub joiner: bool,
}

impl Default for ElasticOptions {
    fn default() -> Self {
        Self {
            min_workers: 1,
            max_workers: 64,
            rejoin_timeout: Duration::from_secs(300),
            balance: Balance::Even,
            id: None,
            host: None,
            join_addr: None,
            peers: Vec::new(),
            hosts_file: None,
            joiner: false,
        }
    }
}

impl ElasticOptions {
    /// Fills in what the launcher says about this worker: `HEARTH_ELASTIC_ID`,
    /// `HEARTH_ELASTIC_HOST`, `HEARTH_ELASTIC_ADDR` (its join address), `HEARTH_ELASTIC_PEERS`
    /// (join addresses to try, comma-separated), `HEARTH_ELASTIC_HOSTS` (a file of them, unless
    /// one is set), and whether it joins a running job (no `HEARTH_RANK`).
    pub fn with_env(mut self) -> Result<Self> {
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        self.id = env("HEARTH_ELASTIC_ID").or(self.id);
        self.host = env("HEARTH_ELASTIC_HOST").or(self.host);
        if let Some(v) = env("HEARTH_ELASTIC_ADDR") {
            self.join_addr = Some(v.trim().parse().map_err(|_| {
                HearthError::InvalidArgument(format!("HEARTH_ELASTIC_ADDR {v:?} is not IP:port"))
            })?);
        }
        if let Some(v) = env("HEARTH_ELASTIC_PEERS") {
            self.peers = v
                .split(',')
                .map(|p| p.trim().to_string())
                .filter(|p| !p.is_empty())
                .collect();
        }
        if self.hosts_file.is_none() {
            self.hosts_file = env("HEARTH_ELASTIC_HOSTS").map(PathBuf::from);
        }
        self.joiner = std::env::var_os("HEARTH_RANK").is_none();
        Ok(self)
    }

    /// The join addresses to try: the peers given, then the host file's lines.
    fn join_addresses(&self) -> Vec<String> {
        let mut out = self.peers.clone();
        if let Some(f) = &self.hosts_file
            && let Ok(text) = std::fs::read_to_string(f)
        {
            out.extend(
                text.lines()
                    .map(|l| l.split('#').next().unwrap_or("").trim())
                    .filter(|l| !l.is_empty())
                    .map(str::to_string),
            );
        }
        out
    }
}

/// Set by SIGTERM: leave after the current step.
static LEAVE: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigterm(_: libc::c_int) {
    LEAVE.store(true, Ordering::SeqCst);
}

/// Asks this process to leave gracefully after its current step (what SIGTERM does).
pub fn request_leave() {
    LEAVE.store(true, Ordering::SeqCst);
}

/// Everything a change of membership carries from the new rank 0 to every member.
#[derive(Clone)]
struct Commit {
    /// Optimizer steps done in the whole run.
    step: u64,
    /// Data epoch in progress (0-based) and samples of it done.
    epoch: u64,
    position: u64,
    /// This epoch's training loss x samples, correct predictions, samples.
    sums: [f64; 3],
    /// Seconds of training so far (rank 0's clock), and when this epoch started.
    elapsed: f64,
    epoch_started: f64,
    /// The run's start on the wall clock (seconds since 1970), which all members share: time
    /// spent on changes counts too.
    start_unix: f64,
    /// Worker-seconds spent so far (world size integrated over time).
    worker_seconds: f64,
    /// Per step: (step, seconds, world size).
    world_log: Vec<(u64, f64, usize)>,
    rows: EpochRows,
    /// Early stopping decided, or the last epoch done.
    finished: bool,
    model: Classifier,
    optim: ModuleOptimizer,
}

/// The current world of an elastic job.
struct World {
    number: u32,
    transport: Arc<QuicTransport>,
    comm: Communicator,
    members: Vec<Worker>,
    /// Each member's weight in the batch split.
    weights: Vec<f64>,
    /// Rank 0's join address, where other members send joiners.
    coordinator_join: String,
}

impl World {
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn size(&self) -> usize {
        self.members.len()
    }
}

/// How a stretch of training in one world ended.
enum Interrupt {
    /// The run is over.
    Done,
    /// After a committed step, members asked to leave (their ranks) or joiners wait.
    Planned { leaving: Vec<usize> },
    /// A step failed (a peer lost).
    Failed(String),
}

struct ElasticRun<'a> {
    cfg: &'a TrainConfig,
    opts: &'a ElasticOptions,
    device: Device,
    plain_device: Device,
    config: ModelConfig,
    classes: Vec<String>,
    loaders: sets::Loaders,
    lr: LrSchedule,
    steps_per_epoch: usize,
    membership: burn_dist::tls::Membership,
    join: JoinService,
    me: Worker,
    coordinator: Membership,
    started: Instant,
    /// Samples per second of this worker's compute (moving average).
    speed: f64,
    /// The coordinator's endpoint bound for the next rendezvous, and the next members.
    bound: Option<burn_dist::transport::quic::QuicNode>,
    next_members: Option<Vec<Worker>>,
    /// Test and benchmark hooks (see [`hook`]).
    throttle: Option<u64>,
    leave_at: Option<u64>,
    die_at: Option<u64>,
    freeze_at: Option<u64>,
}

/// A per-worker number from a test or benchmark hook variable `ID:N[,ID:N...]`
/// (`HEARTH_ELASTIC_LEAVE_AT_STEP`: leave gracefully after step N, as SIGTERM would;
/// `HEARTH_ELASTIC_DIE_AT_STEP`: SIGKILL itself inside step N, between the control and the
/// gradient allreduce; `HEARTH_ELASTIC_FREEZE_AT_STEP`: SIGSTOP itself there, a worker cut
/// off; `HEARTH_ELASTIC_THROTTLE`: N ms of extra compute per step, a slow worker).
fn hook(name: &str, id: &str) -> Option<u64> {
    std::env::var(name).ok()?.split(',').find_map(|part| {
        let (who, n) = part.trim().split_once(':')?;
        (who == id).then(|| n.parse().ok()).flatten()
    })
}

/// A short fingerprint of a model's values (FNV-1a over the f32 bits), to show in logs that
/// workers hold bit-identical weights.
fn fingerprint(model: &Classifier) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in burn_dist::ddp::module_values(model).iter().flatten() {
        for b in v.to_bits().to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    h
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Tags of the survivors' greetings after a failure, by membership epoch.
fn greeting_tag(epoch: u32) -> u64 {
    0xE1A6_0000_0000_0000 | u64::from(epoch)
}

/// Steps between re-measured throughput shares (`--balance throughput`).
const REBALANCE_EVERY: u64 = 8;

fn collective_timeout() -> Duration {
    burn_dist::rendezvous::env_secs("HEARTH_COLLECTIVE_TIMEOUT").unwrap_or(Duration::from_secs(120))
}

pub(super) fn train(
    cfg: &TrainConfig,
    opts: &ElasticOptions,
    device: &Device,
    log: &mut dyn FnMut(&str),
) -> Result<TrainReport> {
    let started = Instant::now();
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGTERM, on_sigterm as *const () as libc::sighandler_t);
    }
    let membership = burn_dist::tls::Membership::from_env()?;
    if !matches!(membership, burn_dist::tls::Membership::Secret(_)) {
        return Err(HearthError::InvalidArgument(
            "--elastic needs a job secret (HEARTH_JOB_SECRET): members change ranks, which \
             per-rank certificates cannot follow"
                .into(),
        ));
    }
    if cfg.data.is_none() {
        return Err(HearthError::InvalidArgument(
            "--elastic needs --data (workers start at different times, so none may generate the \
             synthetic set for the others: write one with `hearth data synth`)"
                .into(),
        ));
    }
    let initial = cfg.dist.clone();
    if initial.is_none() && !opts.joiner {
        return Err(HearthError::InvalidArgument(
            "--elastic runs under `hearth launch --elastic`, or joins a job given \
             HEARTH_ELASTIC_PEERS or --hosts"
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
    let join = JoinService::bind(join_addr, &membership, Role::Busy)?;
    let id = opts.id.clone().unwrap_or_else(|| match &initial {
        Some(i) => format!("w{}", i.rank),
        None => format!("{}:{}", join_addr.ip(), std::process::id()),
    });
    let me = Worker {
        host: opts.host.clone().unwrap_or_else(|| id.clone()),
        id,
    };
    let (train_set, val_set) = sets::load(cfg, &mut |_| {})?;
    if train_set.multi_label {
        return Err(HearthError::InvalidArgument(
            "multi-label sets do not train with --elastic yet".into(),
        ));
    }
    let classes = train_set.classes.clone();
    let config = model_config(&cfg.model, classes.len())?;
    let loaders = sets::Loaders::new(cfg, train_set, val_set, 0, 1)?;
    let steps_per_epoch = loaders.train.set().len().div_ceil(cfg.batch_size).max(1);
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
        config,
        classes,
        loaders,
        lr: cfg.lr_schedule(cfg.scaled_lr(&mut |_| {})?, steps_per_epoch)?,
        steps_per_epoch,
        membership,
        join,
        coordinator: Membership::new(limits, Vec::new()),
        me,
        started,
        speed: 0.0,
        bound: None,
        next_members: None,
        throttle: None,
        leave_at: None,
        die_at: None,
        freeze_at: None,
    };
    run.die_at = hook("HEARTH_ELASTIC_DIE_AT_STEP", &run.me.id);
    run.freeze_at = hook("HEARTH_ELASTIC_FREEZE_AT_STEP", &run.me.id);
    run.throttle = hook("HEARTH_ELASTIC_THROTTLE", &run.me.id);
    run.leave_at = hook("HEARTH_ELASTIC_LEAVE_AT_STEP", &run.me.id);
    let (world, commit) = match &initial {
        Some(info) => run.first_world(info, log)?,
        None => run.join_world(log)?,
    };
    run.train(world, commit, log)
}

impl ElasticRun<'_> {
    fn log_rank0(&self, world: &World, log: &mut dyn FnMut(&str), line: &str) {
        if world.rank() == 0 {
            log(line);
        }
    }

    /// The model, seeded as every run initialises it; commits load their weights into it.
    fn skeleton(&self, device: &Device) -> Result<Classifier> {
        init_model(
            self.cfg,
            &self.config,
            self.classes.len(),
            false,
            device,
            &mut |_| {},
        )
    }

    fn fresh_commit(&self) -> Result<Commit> {
        let model = self.skeleton(&self.device)?;
        Ok(Commit {
            step: 0,
            epoch: 0,
            position: 0,
            sums: [0.0; 3],
            elapsed: 0.0,
            epoch_started: 0.0,
            start_unix: unix_now(),
            worker_seconds: 0.0,
            world_log: Vec::new(),
            rows: EpochRows::new(),
            finished: false,
            model,
            optim: optimizer(self.cfg),
        })
    }

    /// The world `hearth launch --elastic` started: members `w0..`, rank 0's commit (fresh,
    /// or `checkpoint/elastic.state` with `--resume`) sent to all.
    fn first_world(
        &mut self,
        info: &RankInfo,
        log: &mut dyn FnMut(&str),
    ) -> Result<(World, Commit)> {
        if info.rank == 0 {
            run_dir::prepare(&self.cfg.run_dir)?;
            log(&format!(
                "elastic: {} workers to start (min {}, max {}), global batch {}, {:?} shares",
                info.world,
                self.opts.min_workers,
                self.opts.max_workers,
                self.cfg.batch_size,
                self.opts.balance
            ));
        }
        let transport = connect_epoch_on(
            None,
            info,
            &self.membership,
            &RendezvousOptions::default(),
            0,
        )?;
        let members: Vec<Worker> = (0..info.world)
            .map(|r| Worker {
                id: format!("w{r}"),
                host: format!("w{r}"),
            })
            .collect();
        let mine = if info.rank == 0 {
            let c = if self.cfg.resume {
                let c = self.load_state()?;
                log(&format!(
                    "resuming at step {} (epoch {}, sample {})",
                    c.step,
                    c.epoch + 1,
                    c.position
                ));
                c
            } else {
                self.fresh_commit()?
            };
            Some(c)
        } else {
            None
        };
        self.form(0, Arc::new(transport), members, mine, log)
    }

    /// A joiner: ask the members for admission, then form the announced world.
    fn join_world(&mut self, log: &mut dyn FnMut(&str)) -> Result<(World, Commit)> {
        let addrs = self.opts.join_addresses();
        if addrs.is_empty() {
            return Err(HearthError::InvalidArgument(
                "joining an elastic job needs join addresses: HEARTH_ELASTIC_PEERS or --hosts"
                    .into(),
            ));
        }
        log(&format!(
            "{}: asking to join through {}",
            self.me.id,
            addrs.join(", ")
        ));
        let opts = self.opts.clone();
        let (rank, a) = request_join(
            &move || opts.join_addresses(),
            &self.me,
            &self.membership,
            self.opts.rejoin_timeout.max(Duration::from_secs(30)),
        )?;
        let info = RankInfo {
            rank,
            world: a.members.len(),
            local_rank: None,
            coordinator: a.coordinator.clone(),
            source: "elastic join",
        };
        let transport = connect_epoch_on(
            None,
            &info,
            &self.membership,
            &RendezvousOptions::default(),
            a.epoch,
        )?;
        // Members and everything else come with rank 0's state.
        self.form(a.epoch, Arc::new(transport), Vec::new(), None, log)
    }

    /// Every member of a freshly formed world: rank 0 sends its commit and the member list;
    /// each member takes them, answers joiners by its role, and is ready to train.
    fn form(
        &mut self,
        number: u32,
        transport: Arc<QuicTransport>,
        members: Vec<Worker>,
        mine: Option<Commit>,
        log: &mut dyn FnMut(&str),
    ) -> Result<(World, Commit)> {
        let comm = Communicator::new(transport.clone() as Arc<dyn Transport>)
            .with_timeout(collective_timeout());
        let rank = comm.rank();
        let my_join = self.join.local_addr()?.to_string();
        let bytes = match (&mine, rank) {
            (Some(c), 0) => self.encode(c, number, &members, &my_join)?,
            _ => Vec::new(),
        };
        let bytes = broadcast_bytes(&comm, bytes)?;
        let (members, coordinator_join, commit) = self.decode(&bytes)?;
        if members.len() != comm.world() {
            return Err(HearthError::Training(format!(
                "membership epoch {number}: {} members listed, {} in the world",
                members.len(),
                comm.world()
            )));
        }
        if rank == 0 {
            self.coordinator.adopt(Epoch {
                number: u64::from(number),
                members: members.clone(),
            });
            self.join.set_role(Role::Coordinator);
            log(&format!(
                "membership epoch {number}: {} workers [{}], from step {}",
                members.len(),
                members
                    .iter()
                    .map(|m| m.id.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                commit.step
            ));
        } else {
            self.join.set_role(Role::Redirect(coordinator_join.clone()));
        }
        let weights = vec![1.0; members.len()];
        Ok((
            World {
                number,
                transport,
                comm,
                members,
                weights,
                coordinator_join,
            },
            commit,
        ))
    }

    // ---- the committed state as bytes ----------------------------------------------------

    fn encode(&self, c: &Commit, number: u32, members: &[Worker], join: &str) -> Result<Vec<u8>> {
        burn_dist::ddp::sync_running_stats(&c.model);
        let module = c
            .model
            .clone()
            .into_record()
            .into_bytes()
            .map_err(|e| HearthError::Training(format!("serialising the model: {e}")))?;
        let optim = c
            .optim
            .to_record()
            .into_bytes()
            .map_err(|e| HearthError::Training(format!("serialising the optimizer: {e}")))?;
        let rows: serde_json::Map<String, serde_json::Value> = c
            .rows
            .iter()
            .map(|(e, r)| (e.to_string(), serde_json::json!(r)))
            .collect();
        let meta = serde_json::json!({
            "number": number,
            "members": members.iter().map(|m| [m.id.clone(), m.host.clone()]).collect::<Vec<_>>(),
            "join": join,
            "step": c.step, "epoch": c.epoch, "position": c.position,
            "sums": c.sums, "elapsed": c.elapsed, "epoch_started": c.epoch_started,
            "start_unix": c.start_unix,
            "worker_seconds": c.worker_seconds,
            "world_log": c.world_log,
            "rows": rows,
            "finished": c.finished,
        })
        .to_string();
        let mut out = Vec::with_capacity(24 + meta.len() + module.len() + optim.len());
        for part in [meta.as_bytes(), &module[..], &optim[..]] {
            out.extend_from_slice(&(part.len() as u64).to_le_bytes());
            out.extend_from_slice(part);
        }
        Ok(out)
    }

    fn decode(&self, bytes: &[u8]) -> Result<(Vec<Worker>, String, Commit)> {
        let bad = |m: String| HearthError::Training(format!("elastic state: {m}"));
        let mut parts = Vec::new();
        let mut at = 0usize;
        for _ in 0..3 {
            let len = bytes
                .get(at..at + 8)
                .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as usize)
                .ok_or_else(|| bad("truncated".into()))?;
            let part = bytes
                .get(at + 8..at + 8 + len)
                .ok_or_else(|| bad(format!("truncated: {len} bytes announced")))?;
            parts.push(part);
            at += 8 + len;
        }
        let meta: serde_json::Value =
            serde_json::from_slice(parts[0]).map_err(|e| bad(e.to_string()))?;
        let num = |k: &str| meta[k].as_f64().ok_or_else(|| bad(format!("no {k}")));
        let members = meta["members"]
            .as_array()
            .ok_or_else(|| bad("no members".into()))?
            .iter()
            .map(|m| {
                Some(Worker {
                    id: m.get(0)?.as_str()?.to_string(),
                    host: m.get(1)?.as_str()?.to_string(),
                })
            })
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| bad("malformed members".into()))?;
        let sums = meta["sums"]
            .as_array()
            .filter(|a| a.len() == 3)
            .ok_or_else(|| bad("no sums".into()))?;
        let world_log = meta["world_log"]
            .as_array()
            .ok_or_else(|| bad("no world log".into()))?
            .iter()
            .map(|p| {
                Some((
                    p.get(0)?.as_u64()?,
                    p.get(1)?.as_f64()?,
                    p.get(2)?.as_u64()? as usize,
                ))
            })
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| bad("malformed world log".into()))?;
        let mut rows = EpochRows::new();
        for (e, r) in meta["rows"]
            .as_object()
            .ok_or_else(|| bad("no rows".into()))?
        {
            let e: usize = e.parse().map_err(|_| bad(format!("epoch {e}")))?;
            let r = r
                .as_object()
                .ok_or_else(|| bad("malformed row".into()))?
                .iter()
                .map(|(k, v)| (k.clone(), v.as_f64().unwrap_or(f64::NAN)))
                .collect();
            rows.insert(e, r);
        }
        let record = ModuleRecord::from_bytes(Bytes::from_bytes_vec(parts[1].to_vec()))
            .map_err(|e| bad(format!("model: {e}")))?;
        let optim_record = OptimizerRecord::from_bytes(Bytes::from_bytes_vec(parts[2].to_vec()))
            .map_err(|e| bad(format!("optimizer: {e}")))?;
        let skeleton = self.skeleton(&self.device)?;
        let commit = Commit {
            step: num("step")? as u64,
            epoch: num("epoch")? as u64,
            position: num("position")? as u64,
            sums: [
                sums[0].as_f64().unwrap_or(0.0),
                sums[1].as_f64().unwrap_or(0.0),
                sums[2].as_f64().unwrap_or(0.0),
            ],
            elapsed: num("elapsed")?,
            start_unix: num("start_unix")?,
            epoch_started: num("epoch_started")?,
            worker_seconds: num("worker_seconds")?,
            world_log,
            rows,
            finished: meta["finished"].as_bool().unwrap_or(false),
            model: skeleton.load_record(record),
            optim: optimizer(self.cfg).load_record(optim_record),
        };
        let join = meta["join"].as_str().unwrap_or_default().to_string();
        Ok((members, join, commit))
    }

    fn state_file(&self) -> PathBuf {
        self.cfg.run_dir.join("checkpoint").join("elastic.state")
    }

    fn save_state(&self, c: &Commit, world: &World) -> Result<()> {
        let bytes = self.encode(c, world.number, &world.members, &world.coordinator_join)?;
        let path = self.state_file();
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|source| HearthError::Write {
                path: dir.to_path_buf(),
                source,
            })?;
        }
        let tmp = path.with_extension("state.tmp");
        std::fs::write(&tmp, &bytes)
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|source| HearthError::Write { path, source })
    }

    fn load_state(&self) -> Result<Commit> {
        let path = self.state_file();
        let bytes = std::fs::read(&path).map_err(|e| {
            HearthError::InvalidArgument(format!(
                "--resume: {} cannot be read ({e}); an elastic run resumes from it",
                path.display()
            ))
        })?;
        let (_, _, mut c) = self.decode(&bytes).map_err(|e| {
            HearthError::InvalidArgument(format!("--resume: {}: {e}", path.display()))
        })?;
        // The clock goes on from where the saved run stopped.
        c.start_unix = unix_now() - c.elapsed;
        Ok(c)
    }

    // ---- training --------------------------------------------------------------------------

    fn train(
        mut self,
        mut world: World,
        mut commit: Commit,
        log: &mut dyn FnMut(&str),
    ) -> Result<TrainReport> {
        let n = self.loaders.train.set().len();
        if n == 0 {
            return Err(HearthError::InvalidArgument(
                "the training set is empty".into(),
            ));
        }
        loop {
            let (leaving, lost) = match self.run_world(&mut world, &mut commit, log)? {
                Interrupt::Done => break,
                Interrupt::Planned { leaving } => (leaving, Vec::new()),
                Interrupt::Failed(reason) => {
                    log(&format!(
                        "{}: step {} failed: {reason}",
                        self.me.id,
                        commit.step + 1
                    ));
                    let lost = self.lost_after_failure(&world);
                    log(&format!(
                        "{}: lost {}",
                        self.me.id,
                        lost.iter()
                            .map(|&r| world.members[r].id.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ));
                    (Vec::new(), lost)
                }
            };
            if leaving.contains(&world.rank()) {
                if leaving.len() == world.size() && world.rank() == 0 {
                    self.save_state(&commit, &world)?;
                    log(&format!(
                        "every worker left: state saved in {} (--resume continues it)",
                        self.state_file().display()
                    ));
                }
                self.join.set_role(Role::Busy);
                world.transport.shutdown(Duration::from_secs(5));
                return Err(HearthError::LeftJob {
                    id: self.me.id.clone(),
                    step: commit.step,
                });
            }
            let (next, next_commit) = self.change(&world, commit, &leaving, &lost, log)?;
            world.transport.shutdown(Duration::from_secs(1));
            world = next;
            commit = next_commit;
        }
        self.finish(world, commit, log)
    }

    /// Steps in one world until the run ends, a change is asked for, or a step fails.
    fn run_world(
        &mut self,
        world: &mut World,
        commit: &mut Commit,
        log: &mut dyn FnMut(&str),
    ) -> Result<Interrupt> {
        let n = self.loaders.train.set().len();
        let global = self.cfg.batch_size;
        let mut stream: Option<(u64, u64, BatchStream)> = None;
        loop {
            if commit.finished {
                return Ok(Interrupt::Done);
            }
            if commit.position as usize >= n {
                match self.end_epoch(world, commit, log) {
                    Ok(()) => {}
                    Err(HearthError::Dist(e)) => return Ok(Interrupt::Failed(e.to_string())),
                    Err(e) => return Err(e),
                }
                stream = None;
                continue;
            }
            // The stream of the rest of the epoch for the current world and shares.
            if stream
                .as_ref()
                .is_none_or(|(e, p, _)| *e != commit.epoch || *p != commit.position)
            {
                stream = Some((commit.epoch, commit.position, self.stream(world, commit)?));
            }
            let Some((_, at, s)) = stream.as_mut() else {
                continue;
            };
            let t = Instant::now();
            let batch = s
                .next()
                .ok_or_else(|| HearthError::Training("the loader ended early".into()))??;
            let (images, targets) = match batch.classes {
                Some(c) => (batch.images, c),
                None => return Err(HearthError::Training("the loader gave no classes".into())),
            };
            let mine = images.dims()[0];
            {
                let _rng = SEED_LOCK.lock().unwrap_or_else(|e| e.into_inner());
                self.device
                    .seed(epoch_seed(self.cfg.seed, commit.step, world.rank()));
            }
            let loss_fn = CrossEntropyLossConfig::new()
                .with_smoothing(
                    (self.cfg.label_smoothing > 0.0).then_some(self.cfg.label_smoothing),
                )
                .init(&self.device);
            let logits = commit.model.forward(images);
            let correct = hits(&logits, &targets);
            let loss = loss_fn.forward(logits, targets);
            let loss_value = f64::from(loss.clone().into_scalar::<f32>());
            let mut grads = GradientsParams::from_grads(loss.backward(), &commit.model);
            if let Some(ms) = self.throttle {
                std::thread::sleep(Duration::from_millis(ms));
            }
            if self.leave_at.is_some_and(|at| commit.step + 1 >= at) {
                LEAVE.store(true, Ordering::SeqCst);
            }
            let took = t.elapsed().as_secs_f64().max(1e-6);
            let rate = mine as f64 / took;
            self.speed = if self.speed > 0.0 {
                0.7 * self.speed + 0.3 * rate
            } else {
                rate
            };

            // The step's control vector, the same on every member afterwards.
            let w = world.size();
            let mut control = vec![0.0f32; 2 * w + 4];
            control[world.rank()] = f32::from(LEAVE.load(Ordering::SeqCst));
            if world.rank() == 0 && w < self.opts.max_workers && !self.join.waiting().is_empty() {
                control[w] = 1.0;
            }
            control[w + 1] = (loss_value * mine as f64) as f32;
            control[w + 2] = correct as f32;
            control[w + 3] = mine as f32;
            control[w + 4 + world.rank()] = self.speed as f32;
            if let Err(e) = world.comm.allreduce(&mut control, ReduceOp::Sum) {
                return Ok(Interrupt::Failed(e.to_string()));
            }
            if self.die_at.is_some_and(|at| commit.step + 1 >= at) {
                // The test hook of an abrupt loss inside a step: the others wait in the
                // gradient allreduce below when this worker vanishes (SIGKILL, no goodbye).
                // SAFETY: signals this very process.
                unsafe {
                    libc::kill(libc::getpid(), libc::SIGKILL);
                }
            }
            if self.freeze_at.is_some_and(|at| commit.step + 1 >= at) {
                self.freeze_at = None;
                // A worker cut off: alive, but not a packet in or out (SIGSTOP) until killed.
                // SAFETY: signals this very process.
                unsafe {
                    libc::kill(libc::getpid(), libc::SIGSTOP);
                }
            }
            let total = control[w + 3];
            if let Err(e) = burn_dist::ddp::allreduce_grads_scaled(
                &commit.model,
                &mut grads,
                &world.comm,
                self.cfg.bucket_bytes,
                mine as f32 / total.max(1.0),
            ) {
                return Ok(Interrupt::Failed(e.to_string()));
            }

            // The commit: nothing above changed any state.
            let lr = self.lr.lr_at(commit.step as usize);
            let model = commit.model.clone();
            commit.model = commit.optim.step(lr, model, grads);
            let now = unix_now() - commit.start_unix;
            commit.worker_seconds += (now - commit.elapsed).max(0.0) * w as f64;
            commit.elapsed = now;
            commit.step += 1;
            commit.position += step_len(n, commit.position as usize, global) as u64;
            *at = commit.position;
            commit.sums[0] += f64::from(control[w + 1]);
            commit.sums[1] += f64::from(control[w + 2]);
            commit.sums[2] += f64::from(total);
            commit.world_log.push((commit.step, now, w));

            let leaving: Vec<usize> = (0..w).filter(|&r| control[r] > 0.5).collect();
            if !leaving.is_empty() || control[w] > 0.5 {
                return Ok(Interrupt::Planned { leaving });
            }
            if self.opts.balance == Balance::Throughput
                && commit.step.is_multiple_of(REBALANCE_EVERY)
                && (0..w).all(|r| control[w + 4 + r] > 0.0)
            {
                let speeds: Vec<f64> = (0..w).map(|r| f64::from(control[w + 4 + r])).collect();
                if speeds != world.weights {
                    let shares = burn_dist::elastic::shares(global, &speeds)?;
                    if world.rank() == 0
                        && shares != burn_dist::elastic::shares(global, &world.weights)?
                    {
                        log(&format!(
                            "shares of the global batch by throughput: {shares:?}"
                        ));
                    }
                    world.weights = speeds;
                    stream = None;
                }
            }
        }
    }

    /// This worker's batches for the rest of the epoch with the world's current shares.
    fn stream(&self, world: &World, commit: &Commit) -> Result<BatchStream> {
        let n = self.loaders.train.set().len();
        let order = self.loaders.train.epoch_order(commit.epoch);
        let mut batches = Vec::new();
        let mut at = commit.position as usize;
        while at < n {
            let positions =
                step_positions(n, at, self.cfg.batch_size, &world.weights, world.rank())?;
            batches.push(positions.into_iter().map(|p| order[p]).collect());
            at += step_len(n, at, self.cfg.batch_size);
        }
        Ok(self
            .loaders
            .train
            .stream(commit.epoch, batches, &self.device))
    }

    /// The end of a data epoch: validation over the world, the metrics row, checkpoints and the
    /// early-stopping decision, committed like a step.
    fn end_epoch(
        &mut self,
        world: &World,
        commit: &mut Commit,
        log: &mut dyn FnMut(&str),
    ) -> Result<()> {
        let epoch = commit.epoch as usize + 1;
        // Batch norm statistics differ between members: rank 0's for everyone (as DDP does).
        let model = burn_dist::ddp::broadcast_module(commit.model.clone(), &world.comm)?;
        let valid = model.valid();
        let loss_fn = CrossEntropyLossConfig::new().init(&self.plain_device);
        let (rank, size) = (world.rank(), world.size());
        let val_n = self.loaders.full_val.set().len();
        let per = (self.cfg.batch_size / size).max(1);
        let mine: Vec<usize> = (rank..val_n).step_by(size).collect();
        let batches: Vec<Vec<usize>> = mine.chunks(per).map(<[usize]>::to_vec).collect();
        let mut sums = [0.0f32; 3];
        for batch in self.loaders.full_val.stream(0, batches, &self.plain_device) {
            let batch = batch?;
            let targets = batch
                .classes
                .ok_or_else(|| HearthError::Training("the loader gave no classes".into()))?;
            let k = batch.images.dims()[0];
            let logits = valid.forward(batch.images);
            sums[1] += hits(&logits, &targets) as f32;
            sums[0] += loss_fn.forward(logits, targets).into_scalar::<f32>() * k as f32;
            sums[2] += k as f32;
        }
        world.comm.allreduce(&mut sums, ReduceOp::Sum)?;
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
        let took = (commit.elapsed - commit.epoch_started).max(1e-9);
        let in_epoch: Vec<usize> = commit
            .world_log
            .iter()
            .rev()
            .take_while(|(s, _, _)| *s as usize > (epoch - 1) * self.steps_per_epoch)
            .map(|p| p.2)
            .collect();
        let mean_world = in_epoch.iter().sum::<usize>() as f64 / in_epoch.len().max(1) as f64;
        let row: BTreeMap<String, f64> = [
            ("train_loss", ratio(commit.sums[0], commit.sums[2])),
            (
                "train_accuracy",
                100.0 * ratio(commit.sums[1], commit.sums[2]),
            ),
            ("val_loss", ratio(f64::from(sums[0]), f64::from(sums[2]))),
            (
                "val_accuracy",
                100.0 * ratio(f64::from(sums[1]), f64::from(sums[2])),
            ),
            (
                "train_lr",
                self.lr.lr_at(commit.step.saturating_sub(1) as usize),
            ),
            ("train_images_per_sec", commit.sums[2] / took),
            ("world_size", mean_world),
            ("worker_seconds", commit.worker_seconds),
            ("elapsed_seconds", commit.elapsed),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let mut rows = commit.rows.clone();
        rows.insert(epoch, row.clone());
        let table = EpochTable::default();
        if let Ok(mut t) = table.lock() {
            *t = rows.clone();
        }
        let rule = BestRule {
            table,
            monitor: self.cfg.monitor,
            min_delta: self.cfg.min_delta,
        };
        let end = self
            .cfg
            .stop_after_epoch
            .unwrap_or(self.cfg.epochs)
            .min(self.cfg.epochs);
        let mut finished = epoch >= end;
        if let Some(patience) = self.cfg.patience
            && !finished
            && (Patience {
                rule: rule.clone(),
                patience,
                origin: 0,
            })
            .exhausted(epoch)
        {
            self.log_rank0(
                world,
                log,
                &format!(
                    "early stopping after epoch {epoch}: no improvement of {} in {patience} epochs",
                    self.cfg.monitor.column()
                ),
            );
            finished = true;
        }
        // Commit the epoch's end.
        commit.model = model;
        commit.rows = rows;
        commit.epoch += 1;
        commit.position = 0;
        commit.sums = [0.0; 3];
        commit.epoch_started = commit.elapsed;
        commit.finished = finished;
        if rank == 0 {
            log(&format!(
                "epoch {epoch}/{}: train loss {:.4} acc {:.1}% | val loss {:.4} acc {:.1}% | world {:.1} | {:.0} img/s",
                self.cfg.epochs,
                row["train_loss"],
                row["train_accuracy"],
                row["val_loss"],
                row["val_accuracy"],
                mean_world,
                row["train_images_per_sec"]
            ));
            self.checkpoint(commit, world, epoch, rule.best())?;
        }
        Ok(())
    }

    /// Rank 0: metrics, the epoch's model and optimizer files (best and last kept), and the
    /// whole committed state for an exact `--resume`.
    fn checkpoint(
        &self,
        c: &Commit,
        world: &World,
        epoch: usize,
        best: Option<usize>,
    ) -> Result<()> {
        let dir = &self.cfg.run_dir;
        run_dir::write_atomic(&dir.join("metrics.csv"), &metrics_csv(&c.rows))?;
        let mut steps = String::from("step,elapsed_seconds,world_size\n");
        for (s, t, w) in &c.world_log {
            steps.push_str(&format!("{s},{t:.3},{w}\n"));
        }
        run_dir::write_atomic(&dir.join("world.csv"), &steps)?;
        let path = model_checkpoint(dir, epoch);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|source| HearthError::Write {
                path: parent.to_path_buf(),
                source,
            })?;
        }
        c.model
            .clone()
            .into_record()
            .save(&path)
            .map_err(|e| HearthError::Training(format!("saving epoch {epoch}'s weights: {e}")))?;
        for old in 1..epoch {
            if Some(old) != best {
                let _ = std::fs::remove_file(model_checkpoint(dir, old));
            }
        }
        self.save_state(c, world)
    }

    /// After a failed step: greet every member over the links that still work; those that
    /// answer (in time) survive. Returns the lost members' ranks.
    fn lost_after_failure(&self, world: &World) -> Vec<usize> {
        let t = &world.transport;
        t.accept_losses();
        let tag = greeting_tag(world.number);
        let me = world.rank();
        for r in (0..world.size()).filter(|&r| r != me) {
            let _ = t.send(r, Kind::Control, tag, vec![1]);
        }
        let deadline = Instant::now() + collective_timeout();
        let lost: Vec<usize> = (0..world.size())
            .filter(|&r| r != me && t.recv(r, Kind::Control, tag, deadline).is_err())
            .collect();
        lost
    }

    /// The lowest survivor decides the next epoch's members (survivors in their order, then
    /// joiners admitted by the membership rules), binds the next rendezvous, and announces it
    /// to the survivors over the old links and to the joiners through the join service.
    fn coordinate(
        &mut self,
        world: &World,
        commit: &Commit,
        leaving: &[usize],
        gone: &[usize],
        log: &mut dyn FnMut(&str),
    ) -> Result<Announcement> {
        let next = world.number + 1;
        let now = Instant::now();
        self.coordinator.adopt(Epoch {
            number: u64::from(world.number),
            members: world.members.clone(),
        });
        for &r in gone {
            let id = &world.members[r].id;
            if leaving.contains(&r) {
                self.coordinator.leave(id);
            } else {
                self.coordinator.lost(id, now);
            }
        }
        self.join.set_role(Role::Coordinator);
        let survivors: Vec<usize> = (0..world.size()).filter(|r| !gone.contains(r)).collect();
        let mut said = false;
        let members = loop {
            let now = Instant::now();
            let waiting = self.join.waiting();
            let queued: Vec<String> = self.coordinator.waiting().map(|w| w.id.clone()).collect();
            // Joiners that went away are dropped; new ones are vetted (blacklist, duplicates).
            for id in queued
                .iter()
                .filter(|id| !waiting.iter().any(|w| &w.id == *id))
            {
                self.coordinator.lost(id, now);
            }
            for w in waiting.iter().filter(|w| !queued.contains(&w.id)) {
                if let Err(refusal) = self.coordinator.hello(w.clone(), now) {
                    log(&format!("refused joiner {}: {refusal:?}", w.id));
                    self.join
                        .answer(&w.id, Reply::Refused(format!("{refusal:?}")));
                }
            }
            match self.coordinator.decide(now) {
                Decision::Change { epoch, .. } => break epoch.members,
                Decision::Continue => break self.coordinator.current().members.clone(),
                Decision::Wait { have, need, until } => {
                    if !said {
                        log(&format!(
                            "{have} workers, {need} needed: waiting up to {:.0} s for joiners",
                            until.saturating_duration_since(now).as_secs_f64()
                        ));
                        said = true;
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
                Decision::GiveUp { have, need, waited } => {
                    self.save_state(commit, world)?;
                    let give_up = Announcement {
                        epoch: next,
                        coordinator: String::new(),
                        members: Vec::new(),
                    };
                    let _ = give_up.send_to(world.transport.as_ref(), &survivors);
                    return Err(HearthError::Training(format!(
                        "only {have} of the --min-workers {need} workers after waiting {:.0} s \
                         (--rejoin-timeout) for joiners; state saved in {} (--resume continues it)",
                        waited.as_secs_f64(),
                        self.state_file().display()
                    )));
                }
            }
        };
        let ip = match self.join.local_addr()?.ip() {
            ip if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
            ip => ip,
        };
        let node = bind_coordinator(ip, &self.membership, &RendezvousOptions::default())?;
        let old_rank = |w: &Worker| world.members.iter().position(|m| m.id == w.id);
        let announcement = Announcement {
            epoch: next,
            coordinator: node.local_addr()?.to_string(),
            members: members.iter().map(old_rank).collect(),
        };
        if let Err(e) = announcement.send_to(world.transport.as_ref(), &survivors) {
            log(&format!("announcing membership epoch {next}: {e}"));
        }
        for (rank, w) in members.iter().enumerate() {
            if old_rank(w).is_none() {
                self.join.answer(
                    &w.id,
                    Reply::Admit {
                        rank,
                        announcement: announcement.clone(),
                    },
                );
            }
        }
        self.bound = Some(node);
        self.next_members = Some(members);
        Ok(announcement)
    }

    /// The end of the run: rank 0 exports the best epoch's weights and the plots.
    fn finish(
        &mut self,
        world: World,
        commit: Commit,
        log: &mut dyn FnMut(&str),
    ) -> Result<TrainReport> {
        world.comm.barrier()?;
        self.join.set_role(Role::Busy);
        log(&format!(
            "{}: final weights {:016x} at step {} (rank {} of {})",
            self.me.id,
            fingerprint(&commit.model),
            commit.step,
            world.rank(),
            world.size()
        ));
        let rows = commit.rows.clone();
        let best = best_epoch(&rows, self.cfg.monitor, self.cfg.min_delta).ok_or_else(|| {
            HearthError::Training(format!(
                "no epoch has a {} value to pick the best one by",
                self.cfg.monitor.column()
            ))
        })?;
        let dir = &self.cfg.run_dir;
        if world.rank() == 0 {
            let path = model_checkpoint(dir, best);
            let record = ModuleRecord::load(&path).map_err(|e| {
                HearthError::Training(format!(
                    "the best epoch's ({best}) checkpoint {}: {e}",
                    path.display()
                ))
            })?;
            let model = self.skeleton(&self.plain_device)?.load_record(record);
            save_model_with(
                &model,
                &self.config,
                Some(&self.classes),
                Some(&Preprocessing::eval(self.cfg.image_size)),
                &dir.join("model.bpk"),
            )?;
            log(&format!(
                "exported the best epoch ({best}, by {}) into {}",
                self.cfg.monitor.column(),
                dir.join("model.bpk").display()
            ));
            if let Err(e) = crate::plot::plot_metrics(&rows, &dir.join("metrics.png")) {
                log(&format!("warning: no plot written: {e}"));
            }
            let points: Vec<(f64, f64)> = commit
                .world_log
                .iter()
                .map(|(_, t, w)| (*t, *w as f64))
                .collect();
            if let Err(e) = crate::plot::plot_world(&points, &dir.join("world.png")) {
                log(&format!("warning: no world-size plot written: {e}"));
            }
        }
        world.comm.barrier()?;
        // Tells `hearth launch --elastic` this worker finished the training (a graceful leave
        // exits 0 too).
        if let Ok(dir) = std::env::var("HEARTH_ELASTIC_DONE_DIR") {
            let _ = std::fs::write(Path::new(&dir).join(&self.me.id), b"done\n");
        }
        let images = commit.world_log.len() * self.cfg.batch_size;
        let mut report = TrainReport::summarise(
            self.cfg,
            &rows,
            best,
            self.started,
            images,
            self.classes.clone(),
        );
        report.rank = world.rank();
        report.world = world.size();
        world.transport.shutdown(Duration::from_secs(2));
        Ok(report)
    }

    /// A change of membership after `leaving` asked to go and `lost` were lost: the lowest
    /// survivor coordinates, every survivor forms the next world and takes rank 0's state.
    fn change(
        &mut self,
        world: &World,
        commit: Commit,
        leaving: &[usize],
        lost: &[usize],
        log: &mut dyn FnMut(&str),
    ) -> Result<(World, Commit)> {
        let me = world.rank();
        let next = world.number + 1;
        let mut gone: Vec<usize> = leaving.iter().chain(lost).copied().collect();
        let announcement = loop {
            let Some(lowest) = (0..world.size()).find(|r| !gone.contains(r)) else {
                return Err(HearthError::Training("no member survived".into()));
            };
            if lowest == me {
                break self.coordinate(world, &commit, leaving, &gone, log)?;
            }
            self.join.set_role(Role::Busy);
            let wait = self.opts.rejoin_timeout + collective_timeout();
            match Announcement::receive(
                world.transport.as_ref(),
                lowest,
                next,
                Instant::now() + wait,
            ) {
                Ok(a) => break a,
                // The coordinator died too: the next survivor coordinates.
                Err(_) => gone.push(lowest),
            }
        };
        if announcement.members.is_empty() {
            return Err(HearthError::Training(format!(
                "the job gave up: fewer than --min-workers {} workers and nobody joined within \
                 --rejoin-timeout {:?} (state saved by the coordinator in {})",
                self.opts.min_workers,
                self.opts.rejoin_timeout,
                self.state_file().display()
            )));
        }
        let Some(rank) = announcement.rank_of(me) else {
            return Err(HearthError::Training(format!(
                "{} was left out of membership epoch {next}",
                self.me.id
            )));
        };
        let info = RankInfo {
            rank,
            world: announcement.members.len(),
            local_rank: None,
            coordinator: announcement.coordinator.clone(),
            source: "elastic",
        };
        let bound = self.bound.take();
        let transport = connect_epoch_on(
            bound,
            &info,
            &self.membership,
            &RendezvousOptions::default(),
            next,
        )?;
        let members: Vec<Worker> = announcement
            .members
            .iter()
            .map(|m| match m {
                Some(old) => world.members[*old].clone(),
                None => Worker {
                    id: String::new(),
                    host: String::new(),
                },
            })
            .collect();
        let members = if rank == 0 {
            self.next_members.take().unwrap_or(members)
        } else {
            members
        };
        self.form(
            next,
            Arc::new(transport),
            members,
            (rank == 0).then_some(commit),
            log,
        )
    }
}
