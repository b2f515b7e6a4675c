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

mod average;
mod finish;
mod job;
mod run;
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
use crate::settings::PsOptions;
use crate::{HearthError, Result};
pub(crate) use job::Roles;
use job::{BYE, SETUP, ServerSetup};

impl PsOptions {
    /// The lead's start line: the servers, the workers and the settings this mode takes (the
    /// asynchronous modes' defaults differ by mode, so it says which).
    pub(crate) fn describe(&self, cfg: &TrainConfig, roles: Roles, lr: f64) -> String {
        let local = match (self.mode, cfg.optim.optimizer) {
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
    // Sync: the round's mean is clipped by the norm over every server's shard.
    s.clip_grad = cfg.optim.clip_grad;
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
    let t = burn_dist::rendezvous::connect(&me, &membership, &RendezvousOptions::from_env())?;
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
            "`TrainingMode::ParameterServers` needs a distributed job: `dist.world` N (or a launcher's variables)".into(),
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
    let out = run::train(cfg, opts, recipe, roles, lr, t, device, started, log);
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
    use crate::settings::PsServers;

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
