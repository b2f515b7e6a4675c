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
//! Updates: sync mode runs SGD with `--momentum` on the servers (the optimizer state lives in
//! the shard that owns the parameter); the asynchronous modes run plain SGD on each worker and
//! send changes every `--window` steps. The learning rate is constant (`--lr` after any
//! `--scale-lr`). Batch-norm statistics stay with each worker (the lead's are validated and
//! exported, as DDP keeps rank 0's).

mod state;
mod worker;

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

/// Parameter-server settings (`hearth train --ps`).
#[derive(Debug, Clone)]
pub struct PsOptions {
    pub servers: PsServers,
    pub mode: Mode,
    /// Steps between a worker's exchanges with the servers (asynchronous modes).
    pub window: usize,
    /// EASGD's ρ: the elastic force is α = lr · ρ.
    pub rho: f64,
    /// Most steps a worker may run ahead of the slowest (`--staleness`, SSP).
    pub staleness: Option<u64>,
}

impl Default for PsOptions {
    fn default() -> Self {
        Self {
            servers: PsServers::Dedicated(1),
            mode: Mode::Adag,
            window: 5,
            rho: 5.0,
            staleness: None,
        }
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

/// The servers' settings from the run's.
fn server_config(cfg: &TrainConfig, opts: &PsOptions, lr: f64) -> ServerConfig {
    let mut s = ServerConfig::new(opts.mode);
    s.window = opts.window;
    s.lr = lr as f32;
    s.momentum = cfg.momentum as f32;
    s.max_staleness = opts.staleness;
    s.idle_timeout = super::pipeline::collective_timeout().max(Duration::from_secs(600));
    s
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

/// One server's life: its shard from the lead, serving, its final state to the lead, then the
/// lead's goodbye.
fn serve(
    t: &dyn Transport,
    scfg: &ServerConfig,
    roles: Roles,
    log: &mut dyn FnMut(&str),
) -> Result<ServerReport> {
    let shard = t.rank() - roles.workers;
    let deadline = Instant::now() + super::pipeline::collective_timeout() * 5;
    let report = run_server(t, scfg, 0, &roles.worker_ranks(), deadline, log)?;
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
    // The lead may still be exporting; its goodbye (or its loss) ends this rank.
    let _ = t.recv(
        0,
        Kind::Ps,
        BYE,
        Instant::now() + super::pipeline::collective_timeout(),
    );
    Ok(report)
}

/// Trains with parameter servers; see the module docs.
pub fn train(
    cfg: &TrainConfig,
    opts: &PsOptions,
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
    let scfg = server_config(cfg, opts, lr);
    let worker_rank = (info.rank < roles.workers).then_some(info.rank);
    let colocated_server = roles.colocated.then(|| {
        let info = info.clone();
        let scfg = scfg.clone();
        std::thread::spawn(move || -> Result<ServerReport> {
            let t = connect(&info, roles.workers + info.rank, roles.world())?;
            serve(&*t, &scfg, roles, &mut |l| eprintln!("{l}"))
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
        serve(&*t, &scfg, roles, log)?;
        return Ok(server_report(cfg, started, info.rank, roles));
    };
    let t = connect(&info, rank, roles.world())?;
    let out = worker::train(cfg, opts, roles, lr, t, device, started, log);
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
    r.world = roles.world();
    r
}

#[cfg(test)]
mod tests {
    use super::*;

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
