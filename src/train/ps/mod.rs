//! Parameter-server training as a training mode (`hearth train --ps P --mode adag ...`): the
//! model's trainable tensors live, sharded, on server ranks ([`burn_dist::ps`]); workers
//! compute gradients on their shard of the data and push and pull by the mode's rule.
//!
//! Roles (rank 0 is always the lead worker):
//! - `--ps P` (dedicated): of N ranks, workers are `0..N-P`, servers `N-P..N`;
//! - `--ps colocated`: all N ranks are workers, and each process also runs one server in a
//!   thread as rank `N + r` of a 2N-rank job (BytePS's colocated servers: no idle machine).
//!
//! A run: the workers read the data (as data parallel: every worker the same sets, its own
//! shard of the training set) and build the same seeded model; the lead gives every server
//! its shard's starting state (or, with `--resume`, the checkpoint's); each worker pulls and
//! trains its epochs ([`worker`]). At each of its epoch ends the lead takes a consistent
//! checkpoint of all shards ([`burn_dist::ps::client::Client::checkpoint`]), validates the
//! servers' model with its own batch-norm statistics, and writes `metrics.csv`, the epoch's
//! weights and `checkpoint/ps.state`. The last epoch ends when every worker is done: the lead
//! takes the servers' final state, gathers each worker's per-epoch training loss, accuracy and
//! time spent waiting on the servers, and writes `metrics.csv` with a column per worker
//! (`train_accuracy_rank{r}`), `metrics.png`, and `model.bpk` from the best epoch.
//!
//! Updates: the run's optimizer (`--optimizer` sgd, adam or adamw, `--momentum`,
//! `--nesterov`, `--weight-decay` on layer weights as data parallel applies it) and its
//! learning-rate schedule (`--lr` after `--scale-lr`, `--warmup-epochs`, `--schedule`, in
//! optimizer steps) run on the servers in sync mode, each server holding the optimizer state
//! of its shard and taking the rate of the round's number (the global step; the lead sends
//! each server the steps per epoch and its shard's weight-decay ranges before its values,
//! [`SETUP`]). The asynchronous modes run the same optimizer and schedule for each worker's
//! local steps (by its own step count) and send changes every `--window` steps; the servers
//! apply the rule. Batch-norm statistics stay with each worker: in sync mode the lead's are
//! validated and exported (as DDP keeps rank 0's); in the asynchronous modes, whose lead
//! holds local parameters the servers' have moved away from, the lead measures them on the
//! servers' parameters before validating.
//!
//! `--freeze-backbone --unfreeze-after N`: the servers hold the head's shards for N epochs,
//! then a second session shards the whole model (see [`SETUP`]).

mod state;
mod worker;

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::prelude::*;
use burn_dist::ps::Mode;
use burn_dist::ps::server::{ServerConfig, ServerReport, run_server};
use burn_dist::rendezvous::{RankInfo, RendezvousOptions};
use burn_dist::transport::Transport;
use burn_dist::wire::Kind;

use super::{TrainConfig, TrainReport};
use crate::{HearthError, Result};

/// Where the parameter servers run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PsServers {
    /// This many of the job's ranks serve; the others train.
    Dedicated(usize),
    /// Every rank trains and also serves one shard (a thread of its own).
    Colocated,
}

impl std::str::FromStr for PsServers {
    type Err = HearthError;
    fn from_str(s: &str) -> Result<Self> {
        if s == "colocated" {
            return Ok(Self::Colocated);
        }
        match s.parse::<usize>() {
            Ok(n) if n > 0 => Ok(Self::Dedicated(n)),
            _ => Err(HearthError::InvalidArgument(format!(
                "--ps {s:?}: give a number of server ranks (at least 1) or `colocated`"
            ))),
        }
    }
}

/// EASGD's elastic force α at the schedule's peak rate unless `--rho` is given: a worker and
/// the centre meet halfway at each exchange. ρ = 5 with `--lr 0.05` (α = 0.25) learned 3 to
/// 14 points under sync with the other flags at their defaults; α = 0.5 came within about 3
/// (BENCHMARKS.md, issue 55).
pub const EASGD_PEAK_ALPHA: f64 = 0.5;

/// Parameter-server settings (`hearth train --ps`).
#[derive(Debug, Clone)]
pub struct PsOptions {
    pub servers: PsServers,
    pub mode: Mode,
    /// Steps between a worker's exchanges with the servers (asynchronous modes); `None`: the
    /// mode's default ([`PsOptions::window`]).
    pub window: Option<usize>,
    /// EASGD's ρ: the elastic force is α = lr · ρ (the scheduled rate). `None`: ρ =
    /// [`EASGD_PEAK_ALPHA`] / the phase's base rate, so that α is 0.5 at the schedule's peak
    /// whatever `--lr` is.
    pub rho: Option<f64>,
    /// Most steps a worker may run ahead of the slowest (`--staleness`, SSP).
    pub staleness: Option<u64>,
}

impl Default for PsOptions {
    fn default() -> Self {
        Self {
            servers: PsServers::Dedicated(1),
            mode: Mode::Adag,
            window: None,
            rho: None,
            staleness: None,
        }
    }
}

impl PsOptions {
    /// Steps between a worker's exchanges: `window` where set, else 2 for `downpour` and
    /// `easgd` and 5 for `adag` and `dynsgd` (1 for `sync`, which exchanges every step).
    /// Chosen by measurement with every other flag at its default (BENCHMARKS.md, issue 55):
    /// EASGD's centre, moved only by the elastic pulls, learned 12 points under sync with a
    /// window of 5 and came level with one of 2; DOWNPOUR gained 2 to 3 points; ADAG, whose
    /// servers divide each change by the window, lost 7 with 2.
    pub fn window(&self) -> usize {
        self.window.unwrap_or(match self.mode {
            Mode::Sync => 1,
            Mode::Downpour | Mode::Easgd => 2,
            Mode::Adag | Mode::DynSgd => 5,
        })
    }

    /// EASGD's ρ in a phase whose base (peak) rate is `lr`: `rho` where set, else
    /// [`EASGD_PEAK_ALPHA`] / `lr`.
    pub fn rho_at(&self, lr: f64) -> f64 {
        self.rho.unwrap_or(EASGD_PEAK_ALPHA / lr)
    }

    /// The lead's start line: the servers, the workers and the settings this mode takes (the
    /// asynchronous modes' defaults differ by mode, so it says which).
    pub(crate) fn describe(&self, cfg: &TrainConfig, roles: Roles, lr: f64) -> String {
        let local = match (self.mode, cfg.optimizer) {
            (Mode::Sync, _) => String::new(),
            (_, super::OptimizerKind::Sgd) => format!(", local SGD momentum {}", cfg.momentum()),
            _ => String::new(),
        };
        let elastic = match self.mode {
            Mode::Easgd => {
                let rho = self.rho_at(lr);
                format!(", rho {rho} (alpha {} at the peak)", rho * lr)
            }
            _ => String::new(),
        };
        let staleness = self
            .staleness
            .map(|s| format!(", staleness bound {s}"))
            .unwrap_or_default();
        format!(
            "parameter servers: {} {}, {} workers, mode {}, window {}, lr {lr}{local}{elastic}{staleness}",
            roles.servers,
            if roles.colocated {
                "colocated"
            } else {
                "dedicated"
            },
            roles.workers,
            self.mode,
            self.window(),
        )
    }
}

/// Who does what in a job of `world` launched ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Roles {
    pub workers: usize,
    pub servers: usize,
    pub colocated: bool,
}

impl Roles {
    pub fn new(servers: PsServers, world: usize) -> Result<Self> {
        match servers {
            PsServers::Dedicated(p) if p < world => Ok(Self {
                workers: world - p,
                servers: p,
                colocated: false,
            }),
            PsServers::Dedicated(p) => Err(HearthError::InvalidArgument(format!(
                "--ps {p} leaves no worker among {world} ranks (--nproc must exceed --ps)"
            ))),
            PsServers::Colocated => Ok(Self {
                workers: world,
                servers: world,
                colocated: true,
            }),
        }
    }

    /// Ranks of the parameter-server job (twice the launched ranks when colocated).
    pub fn world(&self) -> usize {
        self.workers + self.servers
    }

    pub fn worker_ranks(&self) -> Vec<usize> {
        (0..self.workers).collect()
    }

    pub fn server_ranks(&self) -> Vec<usize> {
        (self.workers..self.world()).collect()
    }
}

/// The lead worker's goodbye: everything it needed from this rank has arrived.
pub(crate) const BYE: u64 = burn_dist::ps::message::APP_TAGS + 1;
/// A worker's per-epoch statistics, sent to the lead when it is done.
pub(crate) const STATS: u64 = burn_dist::ps::message::APP_TAGS;
/// A worker's skipped images (`path: reason` lines), sent to the lead after its statistics.
pub(crate) const SKIPPED: u64 = burn_dist::ps::message::APP_TAGS + 3;

/// The lead's settings for one server's optimizer, sent before each session's values: the
/// optimizer steps per epoch (the schedule's unit), the phase's base rate and its shard's
/// weight-decay ranges. A run has one session, or two with `--unfreeze-after` (the frozen
/// phase's shards of the head, then the fine-tuning phase's shards of the whole model); an
/// empty [`SETUP`] says there is no further session.
pub(crate) const SETUP: u64 = burn_dist::ps::message::APP_TAGS + 2;

/// What [`SETUP`] carries.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ServerSetup {
    pub batches_per_epoch: u64,
    /// The phase's rate (after `--scale-lr`; `--finetune-lr` in the fine-tuning phase).
    pub lr: f64,
    /// Value ranges of the shard (shard indices) that weight decay applies to.
    pub decay: Vec<Range<usize>>,
}

impl ServerSetup {
    /// Little-endian `u64`s: steps per epoch, the rate's bits, the number of ranges, then each
    /// start and end.
    pub fn encode(&self) -> Vec<u8> {
        let mut words = vec![
            self.batches_per_epoch,
            self.lr.to_bits(),
            self.decay.len() as u64,
        ];
        for r in &self.decay {
            words.extend([r.start as u64, r.end as u64]);
        }
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    /// The setup for a shard of `shard_len` values; anything else is an error naming it.
    pub fn decode(bytes: &[u8], shard_len: usize) -> Result<Self> {
        let bad = |m: String| HearthError::Training(format!("parameter server setup: {m}"));
        if !bytes.len().is_multiple_of(8) || bytes.len() < 24 {
            return Err(bad(format!("{} bytes", bytes.len())));
        }
        let words: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
            .collect();
        let lr = f64::from_bits(words[1]);
        if !(lr.is_finite() && lr > 0.0) {
            return Err(bad(format!("a rate of {lr}")));
        }
        let n = usize::try_from(words[2]).unwrap_or(usize::MAX);
        if words.len() != n.saturating_mul(2).saturating_add(3) {
            return Err(bad(format!(
                "{n} ranges in {} words",
                words.len().saturating_sub(3)
            )));
        }
        let mut decay = Vec::with_capacity(n);
        for pair in words[3..].chunks_exact(2) {
            let (a, b) = (pair[0] as usize, pair[1] as usize);
            if a >= b || b > shard_len {
                return Err(bad(format!(
                    "range {a}..{b} outside a shard of {shard_len} values"
                )));
            }
            decay.push(a..b);
        }
        Ok(Self {
            batches_per_epoch: words[0].max(1),
            lr,
            decay,
        })
    }
}

/// The servers' settings from the run's, once the lead's [`ServerSetup`] is known.
fn server_config(
    cfg: &TrainConfig,
    opts: &PsOptions,
    roles: Roles,
    setup: ServerSetup,
) -> Result<ServerConfig> {
    let mut s = ServerConfig::new(opts.mode);
    s.window = opts.window();
    s.optimizer =
        super::flat::flat_optimizer(cfg, setup.lr, setup.batches_per_epoch as usize, setup.decay)?;
    s.max_staleness = opts.staleness;
    // Sync rounds are all or nothing across the shards: the servers agree each one's set.
    s.peers = roles.server_ranks();
    s.idle_timeout = super::shared::collective_timeout().max(Duration::from_secs(600));
    Ok(s)
}

/// Joins the parameter-server job as `rank` of `world`.
fn connect(info: &RankInfo, rank: usize, world: usize) -> Result<Arc<dyn Transport>> {
    let membership = burn_dist::tls::Membership::from_env()?;
    let me = RankInfo {
        rank,
        world,
        local_rank: info.local_rank,
        coordinator: info.coordinator.clone(),
        source: info.source,
    };
    let t = burn_dist::rendezvous::connect(&me, &membership, &RendezvousOptions::default())?;
    Ok(Arc::new(t))
}

/// One server's life: for each of the run's sessions (one per transfer-learning phase), its
/// optimizer's setup and its shard from the lead, serving, its final state to the lead; then
/// the lead's goodbye. Returns the last session's report.
fn serve(
    t: &dyn Transport,
    cfg: &TrainConfig,
    opts: &PsOptions,
    roles: Roles,
    log: &mut dyn FnMut(&str),
) -> Result<ServerReport> {
    let shard = t.rank() - roles.workers;
    let mut last = None;
    loop {
        // The lead validates and exports between sessions: a long wait that its loss ends.
        let deadline = Instant::now() + super::shared::collective_timeout() * 5;
        let bytes = t.recv(0, Kind::Ps, SETUP, deadline)?;
        if bytes.is_empty() {
            break;
        }
        // The shard's length is known with its values; the ranges are checked against the
        // largest a shard can be here and again by the optimizer's clipping.
        let setup = ServerSetup::decode(&bytes, usize::MAX)?;
        let scfg = server_config(cfg, opts, roles, setup)?;
        let report = run_server(t, &scfg, 0, &roles.worker_ranks(), deadline, log)?;
        let mut line = format!(
            "parameter server {shard}: {} values, {} updates, {:.1} MB in, {:.1} MB out, largest lead {} steps",
            report.values.len(),
            report.version,
            report.bytes_in as f64 / 1e6,
            report.bytes_out as f64 / 1e6,
            report.max_lead
        );
        for (w, (rounds, waited)) in &report.waited_for {
            line.push_str(&format!(
                "; waited for worker {w} in {rounds} rounds ({:.1} s)",
                waited.as_secs_f64()
            ));
        }
        for (w, why) in &report.dropped {
            line.push_str(&format!("; dropped worker {w}: {why}"));
        }
        log(&line);
        last = Some(report);
    }
    // The lead may still be exporting; its goodbye (or its loss) ends this rank.
    let _ = t.recv(
        0,
        Kind::Ps,
        BYE,
        Instant::now() + super::shared::collective_timeout(),
    );
    last.ok_or_else(|| HearthError::Training(format!("parameter server {shard}: no session")))
}

/// Trains with parameter servers; see the module docs.
pub fn train(
    cfg: &TrainConfig,
    opts: &PsOptions,
    device: &Device,
    log: &mut dyn FnMut(&str),
) -> Result<TrainReport> {
    train_with(cfg, opts, &super::trainee::ImageRecipe, device, log)
}

/// A rank of a parameter-server run of `recipe`'s model and data (the workers read the data;
/// the servers hold flat values and need neither).
pub(super) fn train_with<R: super::trainee::Recipe>(
    cfg: &TrainConfig,
    opts: &PsOptions,
    recipe: &R,
    device: &Device,
    log: &mut dyn FnMut(&str),
) -> Result<TrainReport> {
    let started = Instant::now();
    let info = cfg.dist.clone().ok_or_else(|| {
        HearthError::InvalidArgument(
            "--ps needs a distributed job: --nproc N (or a launcher's variables)".into(),
        )
    })?;
    let roles = Roles::new(opts.servers, info.world)?;
    let lr = cfg.scaled_lr(&mut |_| {})?;
    let worker_rank = (info.rank < roles.workers).then_some(info.rank);
    let colocated_server = roles.colocated.then(|| {
        let info = info.clone();
        let (cfg, opts) = (cfg.clone(), opts.clone());
        std::thread::spawn(move || -> Result<ServerReport> {
            let t = connect(&info, roles.workers + info.rank, roles.world())?;
            serve(&*t, &cfg, &opts, roles, &mut |l| eprintln!("{l}"))
        })
    });
    let Some(rank) = worker_rank else {
        // A dedicated server.
        let t = connect(&info, info.rank, roles.world())?;
        if info.rank == roles.workers {
            log(&format!(
                "parameter servers: {} server(s), {} worker(s), mode {}",
                roles.servers, roles.workers, opts.mode
            ));
        }
        serve(&*t, cfg, opts, roles, log)?;
        return Ok(server_report(cfg, started, info.rank, roles));
    };
    let t = connect(&info, rank, roles.world())?;
    let out = worker::train(cfg, opts, recipe, roles, lr, t, device, started, log);
    if let Some(h) = colocated_server {
        let served = h
            .join()
            .map_err(|_| HearthError::Training("the colocated server thread panicked".into()))?;
        // The worker's error says more than the server's, which usually follows from it.
        let out = out?;
        served?;
        return Ok(out);
    }
    out
}

/// What a dedicated server reports (it trains nothing; only the lead prints a summary).
fn server_report(cfg: &TrainConfig, started: Instant, rank: usize, roles: Roles) -> TrainReport {
    let mut r = TrainReport::summarise(cfg, &Default::default(), 0, started, 0, Vec::new());
    r.rank = rank;
    r.set_world(roles.world(), cfg.price_per_hour);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_setup_round_trips_and_garbage_is_named() {
        let s = ServerSetup {
            batches_per_epoch: 7,
            lr: 0.25,
            decay: vec![0..3, 5..9],
        };
        assert_eq!(ServerSetup::decode(&s.encode(), 9).unwrap(), s);
        let e = ServerSetup::decode(&s.encode(), 8).unwrap_err().to_string();
        assert!(e.contains("5..9") && e.contains("8 values"), "{e}");
        let bytes = s.encode();
        for cut in [0, 7, 15, bytes.len() - 8] {
            let e = ServerSetup::decode(&bytes[..cut], 9)
                .unwrap_err()
                .to_string();
            assert!(e.contains("parameter server setup"), "{cut}: {e}");
        }
        let mut huge = bytes.clone();
        huge[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(ServerSetup::decode(&huge, 9).is_err());
        let mut nan = bytes.clone();
        nan[8..16].copy_from_slice(&f64::NAN.to_bits().to_le_bytes());
        let e = ServerSetup::decode(&nan, 9).unwrap_err().to_string();
        assert!(e.contains("rate"), "{e}");
    }

    #[test]
    fn roles_put_the_lead_worker_at_rank_0() {
        let r = Roles::new(PsServers::Dedicated(2), 5).unwrap();
        assert_eq!(r.worker_ranks(), vec![0, 1, 2]);
        assert_eq!(r.server_ranks(), vec![3, 4]);
        let c = Roles::new(PsServers::Colocated, 3).unwrap();
        assert_eq!(
            (c.worker_ranks(), c.server_ranks()),
            (vec![0, 1, 2], vec![3, 4, 5])
        );
        let e = Roles::new(PsServers::Dedicated(2), 2).unwrap_err();
        assert!(e.to_string().contains("no worker"), "{e}");
        assert!("0".parse::<PsServers>().is_err());
        assert!("x".parse::<PsServers>().is_err());
        assert_eq!(
            "colocated".parse::<PsServers>().unwrap(),
            PsServers::Colocated
        );
        assert_eq!("3".parse::<PsServers>().unwrap(), PsServers::Dedicated(3));
    }
}
