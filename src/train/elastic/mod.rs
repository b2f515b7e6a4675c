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

use super::checkpoint::{model_checkpoint, save_epoch_weights};
use super::ema::Ema;
use super::epochs::{Epochs, Row};
use super::exchange::{Exchange, Update};
use super::export::export_best;
use super::gate::Gate;
use super::model::{optimizer, seed_stream};
use super::objective::{Objective, insert_top5};
use super::precision::{LossScaler, divide};
use super::scores::ValScores;
use super::shared::{Rates, collective_timeout, epoch_lr, val_share};
use super::trainee::{ImageRecipe, Input, Net, Recipe, Stream, Trainee};
use super::{EpochRows, TrainConfig, TrainReport, run_dir};
use crate::settings::{Balance, ElasticOptions, Precision};
use crate::{HearthError, Result};
use burn::module::Module;
use burn::optim::{GradientsAccumulator, ModuleOptimizer, OptimizerRecord};
use burn::prelude::*;
use burn::store::ModuleRecord;
use burn::tensor::Bytes;
use burn_dist::elastic::join::{JoinService, Reply, Role, request_join};
use burn_dist::elastic::membership::{Decision, Epoch, Health, Limits, Membership, Worker, quorum};
use burn_dist::elastic::reform::Announcement;
use burn_dist::elastic::{broadcast_bytes, step_len, step_positions};
use burn_dist::rendezvous::{
    Abort, RankInfo, RendezvousOptions, bind_coordinator, connect_epoch_on, connect_epoch_watched,
};
use burn_dist::routed::RoutedTransport;
use burn_dist::wire::Kind;
use burn_dist::{Communicator, DistError, ReduceOp, Transport};

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

/// Tells `hearth launch --elastic` (its `HEARTH_ELASTIC_DONE_DIR`) that worker `id` did what
/// it was asked: trained to the end, or checked the settings of a dry run (a graceful leave
/// exits 0 too, so the exit status cannot say it). Outside such a launch: nothing.
pub fn mark_finished(id: &str) {
    if let Ok(dir) = std::env::var("HEARTH_ELASTIC_DONE_DIR") {
        let _ = std::fs::write(Path::new(&dir).join(id), b"done\n");
    }
}

/// Everything a change of membership carries from the new rank 0 to every member.
#[derive(Clone)]
struct Commit<M: Net> {
    /// Optimizer steps done in the whole run.
    step: u64,
    /// Data epoch in progress (0-based) and samples of it done.
    epoch: u64,
    position: u64,
    /// This epoch's training loss x samples, correct predictions, samples, and samples with
    /// their class among the 5 highest scores.
    sums: [f64; 4],
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
    model: M,
    optim: ModuleOptimizer,
    /// fp16's loss scale (`--precision fp16`), moving with the model: every member takes the
    /// same verdict on the averaged gradients, and a joiner or a resume goes on with it.
    scaler: Option<LossScaler>,
    /// Steps of this epoch skipped for non-finite fp16 gradients.
    epoch_skipped: u64,
    /// A multi-label epoch's training outputs so far, every member's (each step's control
    /// allreduce carries them), for the epoch's `train_auroc`.
    train_scores: ValScores,
    /// `optim.model_ema`: the weight average, moving with the model (`average.rs`).
    ema: Option<Ema<M>>,
}

/// The current world of an elastic job.
struct World {
    number: u32,
    transport: Arc<RoutedTransport>,
    /// Shared with `--overlap`'s exchange thread during a step.
    comm: Arc<Communicator>,
    /// The sharded optimizer's collectives (`--zero`): their own tag space, with the run's
    /// `--compression`.
    sharded: Communicator,
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
    /// The epoch's samples are done: its validation comes next.
    EpochEnd,
    /// After a committed step, members asked to leave (their ranks) or joiners wait.
    Planned { leaving: Vec<usize> },
    /// A step failed (a peer lost).
    Failed(String),
}

struct ElasticRun<'a, T: Trainee> {
    cfg: &'a TrainConfig,
    opts: &'a ElasticOptions,
    device: Device,
    plain_device: Device,
    /// The model and this worker's view of the data.
    trainee: T,
    /// Each optimizer step's rate and the transfer-learning phases.
    rates: Rates,
    objective: Objective,
    /// Global batches per epoch, and optimizer steps per epoch (fewer with `--grad-accum`).
    batches_per_epoch: usize,
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
    /// This launch's id (drawn by rank 0 of its first epoch), the run directory's fence, and
    /// the token of the current epoch (see `fence.rs`).
    launch: String,
    fence: fence::Fence,
    token: Option<fence::Token>,
    /// The most bytes of state this worker takes from a new epoch's rank 0 (from the model's
    /// parameter count, counted once).
    state_limit: std::cell::OnceCell<usize>,
    /// Fault injection: the test and benchmark hooks (`train/faults.rs`).
    faults: super::faults::Faults,
    /// `--zero`: this worker's shard of the optimizer (the commit's `optim` is then unused).
    zero: Option<shard::Sharded>,
    /// The step's plan and exchange (a sum: each worker's share is weighted in its loss),
    /// and this epoch's time in them (rank 0 reports it at the epoch's end, as data parallel
    /// does).
    exchange: Exchange,
    /// `checkpoint.log_every`: the step scalars of the world numbered with it (each world's
    /// rank 0 writes; `logging.rs`).
    step_log: Option<(u32, super::step_log::StepLog)>,
}

/// A short fingerprint of a model's values (FNV-1a over the f32 bits), to show in logs that
/// workers hold bit-identical weights.
fn fingerprint<M: Net>(model: &M) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in burn_dist::ddp::module_values(model).iter().flatten() {
        for b in v.to_bits().to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    h
}

/// This machine's identity for the blacklist ([`burn_dist::shm::setup::host_identity`]), or the
/// worker's `id` where the kernel does not say (no `/proc`).
fn machine(id: &str) -> String {
    burn_dist::shm::setup::host_identity().unwrap_or_else(|| id.to_string())
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

mod average;
mod change;
mod entry;
mod fence;
mod logging;
mod members;
mod settle;
mod shard;
mod sharded;
mod state;
mod step;
mod world;

pub(crate) use entry::{train, train_with};

impl<T: Trainee> ElasticRun<'_, T> {
    /// The model, seeded as every run initialises it; commits load their weights into it.
    fn skeleton(&self, device: &Device) -> Result<T::Model> {
        self.trainee.init(device, &mut |_| {})
    }

    /// `model` with the parameters data epoch `epoch` (from 0) trains: the head alone while
    /// `--freeze-backbone` holds, everything once `--unfreeze-after` has passed. Which tensors
    /// train is no value a commit carries, so every member sets it from the committed epoch.
    fn in_phase(&self, model: T::Model, epoch: u64) -> T::Model {
        self.trainee
            .phase(model, self.rates.frozen(epoch as usize + 1))
    }

    /// Before rank 0 writes into the run directory: an error unless the fence still names
    /// this worker's membership epoch (a worker cut off while the others formed a newer one).
    fn fenced(&self) -> Result<()> {
        match &self.token {
            Some(t) => self.fence.check(t),
            None => Ok(()),
        }
    }

    /// How rank 0's files land: each one checked against the fence under the run directory's
    /// lock just before its rename (see `fence.rs`).
    fn gate(&self) -> Gate {
        match &self.token {
            Some(t) => self.fence.gate(t),
            None => Gate::default(),
        }
    }

    fn fresh_commit(&self) -> Result<Commit<T::Model>> {
        let model = self.in_phase(self.skeleton(&self.device)?, 0);
        let ema = self.fresh_average(&model);
        Ok(Commit {
            step: 0,
            epoch: 0,
            position: 0,
            sums: [0.0; 4],
            elapsed: 0.0,
            epoch_started: 0.0,
            start_unix: unix_now(),
            worker_seconds: 0.0,
            world_log: Vec::new(),
            rows: EpochRows::new(),
            finished: false,
            model,
            optim: optimizer(self.cfg),
            scaler: (self.cfg.compute.precision == Precision::Fp16).then(LossScaler::default),
            epoch_skipped: 0,
            train_scores: ValScores::default(),
            ema,
        })
    }

    /// The end of the run: rank 0 exports the best epoch's weights and the plots.
    fn finish(
        &mut self,
        world: World,
        commit: Commit<T::Model>,
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
        // The training state goes before rank 0 builds the best epoch's model again to export
        // it (as data parallel's finish does): that model takes the memory this one held.
        let Commit {
            model, optim, ema, ..
        } = commit;
        drop((model, optim, ema));
        self.zero = None;
        let rows = commit.rows.clone();
        let epochs = Epochs::new(self.cfg, world.rank() == 0);
        epochs.set_rows(rows.clone());
        let best = epochs.best_or_err()?;
        let mut per_class_auroc = None;
        if world.rank() == 0 {
            let gate = self.gate();
            per_class_auroc = export_best(
                self.cfg,
                &self.trainee,
                best,
                &self.plain_device,
                &gate,
                log,
            )?;
            #[cfg(feature = "plots")]
            {
                let dir = &self.cfg.run_dir;
                let points: Vec<(f64, f64)> = commit
                    .world_log
                    .iter()
                    .map(|(_, t, w)| (*t, *w as f64))
                    .collect();
                let (metrics_png, world_png) = (dir.join("metrics.png"), dir.join("world.png"));
                let (m_tmp, w_tmp) = (Gate::temp_for(&metrics_png), Gate::temp_for(&world_png));
                match crate::plot::plot_metrics_world(&rows, &points, &m_tmp) {
                    Ok(()) => gate.land(&m_tmp, &metrics_png)?,
                    Err(e) => log(&format!("warning: no plot written: {e}")),
                }
                match crate::plot::plot_world(&points, &w_tmp) {
                    Ok(()) => gate.land(&w_tmp, &world_png)?,
                    Err(e) => log(&format!("warning: no world-size plot written: {e}")),
                }
            }
        }
        world.comm.barrier()?;
        mark_finished(&self.me.id);
        let images = commit.world_log.len()
            * self.cfg.batch_size
            * self.cfg.optim.grad_accum.unwrap_or(1).max(1);
        let mut report = epochs.report(
            best,
            self.started,
            images,
            self.trainee.classes().to_vec(),
            world.rank(),
            world.size(),
        );
        report.per_class_auroc = per_class_auroc;
        // Every member's skipped files, on rank 0.
        report.skipped = super::shared::gather_lines(&world.comm, &self.trainee.skipped())?;
        // The world changed size along the way: the job's worker-seconds, not this process's
        // wall time times the last world. The steps count from the job's start; added here:
        // the time since the last step (validation, export) by the last world, and this
        // launch's time before the job started (reading the data, forming) by the first.
        let since_start = unix_now() - commit.start_unix;
        let tail = (since_start - commit.elapsed).max(0.0) * world.size() as f64;
        let first = commit.world_log.first().map_or(world.size(), |l| l.2);
        let before = (self.started.elapsed().as_secs_f64() - since_start).max(0.0) * first as f64;
        report.price_process_seconds(
            commit.worker_seconds + tail + before,
            self.cfg.price_per_hour,
        );
        world.transport.shutdown(Duration::from_secs(2));
        Ok(report)
    }
}
