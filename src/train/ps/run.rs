//! A parameter-server worker's run: [`train`] sets the worker up and drives it through the
//! shared epoch loop with [`PsStrategy`], its part of each epoch.

use std::sync::Arc;
use std::time::Instant;

use burn::prelude::*;
use burn_dist::Communicator;
use burn_dist::flat::layout::Layout;
use burn_dist::flat::module::{trainable_names, trainable_values, with_trainable_values};
use burn_dist::ps::client::{Client, PsWorker};
use burn_dist::ps::message::ShardState;
use burn_dist::transport::Transport;
use burn_dist::transport::group::Group;
use burn_dist::wire::Kind;

use super::job::{BYE, Roles, SCORES, SKIPPED, STATS};
use super::state::{Sharding, encode_scores, encode_stats, reshard_optim_state};
use super::worker::{PATIENT, Worker};
use crate::settings::Precision;
use crate::settings::PsOptions;
use crate::train::epochs::{Epochs, Row, Strategy};
use crate::train::faults::Faults;
use crate::train::objective::Objective;
use crate::train::precision::LossScaler;
use crate::train::shared::{Rates, collective_timeout};
use crate::train::trainee::{Recipe, Trainee};
use crate::train::{TrainConfig, TrainReport, run_dir};
use crate::{HearthError, Result};

#[allow(clippy::too_many_arguments)]
pub(super) fn train<R: Recipe>(
    cfg: &TrainConfig,
    opts: &PsOptions,
    recipe: &R,
    roles: Roles,
    lr: f64,
    t: Arc<dyn Transport>,
    device: &Device,
    started: Instant,
    log: &mut dyn FnMut(&str),
) -> Result<TrainReport> {
    let rank = t.rank();
    let mut quiet = |_: &str| {};
    let log: &mut dyn FnMut(&str) = if rank == 0 { log } else { &mut quiet };
    if rank == 0 {
        run_dir::start(cfg, log)?;
        log(&opts.describe(cfg, roles, lr));
    }
    let (mut w, comm) = start(cfg, opts, recipe, roles, lr, t, device, started, log)?;
    let epochs = Epochs::new(cfg, rank == 0);
    let resume = w.resume(&comm, &epochs, log)?;
    let first = resume.as_ref().map_or(0, |s| s.epoch);
    epochs.check_left(first)?;
    if first > 0 && w.scaler.is_some() {
        // Each worker goes on with its own fp16 loss scale of the epoch resumed after.
        w.scaler = Some(LossScaler::load(&w.loss_scale_file(first), first)?);
    }
    // A resume after a fine-tuning epoch trains (and its checkpoint holds) every tensor; one
    // after the last frozen epoch starts from the head's shards and switches at once.
    let unfrozen = w.rates.fine_tuning(first);
    if unfrozen {
        w.model = w.trainee.phase(w.model.clone(), false);
    }
    let steps_before = (first * cfg.optimizer_steps(w.batches)) as u64;
    let (ps, params) = w.session(first + 1, steps_before, |w, layout| {
        w.starting_state(layout, resume)
    })?;
    w.start_average(first)?;
    w.step_log = crate::train::step_log::StepLog::open(
        cfg.checkpoint.log_every,
        &cfg.run_dir,
        rank == 0,
        steps_before,
        log,
    )?;
    // Early stopping: the lead's decision reaches every worker at each epoch's end (only then
    // do the asynchronous workers wait for each other; a long wait: the lead validates).
    let stop = match cfg.checkpoint.patience {
        Some(_) => Some(
            Communicator::from_env(Arc::new(Group::new(w.t.clone(), roles.worker_ranks(), 3)?))
                .with_timeout(PATIENT),
        ),
        None => None,
    };
    // `--unfreeze-after`: the workers agree on the switch to the fine-tuning session.
    let phase = match w.rates.fine_tuning(epochs.end()) && !unfrozen {
        true => Some(
            Communicator::from_env(Arc::new(Group::new(w.t.clone(), roles.worker_ranks(), 4)?))
                .with_timeout(PATIENT),
        ),
        false => None,
    };
    let mut strategy = PsStrategy {
        w: &mut w,
        ps: Some(ps),
        client: None,
        params,
        step: 0,
        end: epochs.end(),
        served: None,
        stop,
        phase,
    };
    let last = epochs.run(first, &mut strategy, log)?;
    let mut client = match (strategy.client.take(), strategy.ps.take()) {
        (Some(c), _) => c,
        (None, Some(ps)) => ps.finish()?,
        (None, None) => return Err(HearthError::Training("the worker lost its client".into())),
    };
    if rank != 0 {
        return farewell(&w, &epochs);
    }
    if last < epochs.end() {
        // Stopped early: every worker is done once the servers send their final states.
        client.timeout = PATIENT;
        client.final_states()?;
    }
    w.finish(&epochs, last, log)
}

/// Worker `t.rank()`: its shard of the data, its model (the backbone frozen where asked), its
/// rates and test hooks; and the workers' communicator.
#[allow(clippy::too_many_arguments)]
fn start<'a, R: Recipe>(
    cfg: &'a TrainConfig,
    opts: &'a PsOptions,
    recipe: &R,
    roles: Roles,
    lr: f64,
    t: Arc<dyn Transport>,
    device: &Device,
    started: Instant,
    log: &mut dyn FnMut(&str),
) -> Result<(Worker<'a, R::T>, Communicator)> {
    let rank = t.rank();
    let group = Group::new(t.clone(), roles.worker_ranks(), 2)?;
    let comm = Communicator::from_env(Arc::new(group)).with_timeout(collective_timeout());
    let trainee = recipe.prepare(cfg, Some(&comm), rank, roles.workers, log)?;
    let objective = Objective::new(cfg, trainee.multi_label());
    let ad = device.clone().autodiff();
    let mut model = trainee.init(&ad, log)?;
    if cfg.model.freeze_backbone {
        log("backbone frozen: only the head trains");
        model = trainee.phase(model, true);
    }
    // Loader batches per epoch (optimizer steps: a K-th of them with `--grad-accum K`).
    let batches = trainee.shard_batches().max(1);
    let rates = Rates::new(cfg, lr, batches)?;
    let w = Worker {
        cfg,
        opts,
        roles,
        rank,
        t,
        device: ad,
        plain_device: device.clone(),
        trainee,
        objective,
        model,
        stats: Vec::new(),
        started,
        // Test hooks, as the elastic trainer's ("w1:50,w2:10" names workers by rank).
        faults: Faults::ps_worker(&format!("w{rank}"), cfg.compute.precision),
        rates,
        batches,
        scaler: (cfg.compute.precision == Precision::Fp16).then(LossScaler::default),
        train_scores: Vec::new(),
        ema: None,
        step_log: None,
    };
    Ok((w, comm))
}

/// A worker other than the lead at the end: its statistics and skipped images to the lead,
/// then it waits for the lead's goodbye (or its loss).
fn farewell<T: Trainee>(w: &Worker<'_, T>, epochs: &Epochs) -> Result<TrainReport> {
    w.t.send(0, Kind::Ps, STATS, encode_stats(&w.stats))?;
    let skipped = crate::train::shared::encode_lines(&w.trainee.skipped());
    w.t.send(0, Kind::Ps, SKIPPED, skipped)?;
    if w.trainee.multi_label() {
        w.t.send(0, Kind::Ps, SCORES, encode_scores(&w.train_scores))?;
    }
    // The lead's goodbye, or its loss, ends this worker.
    let _ = w.t.recv(0, Kind::Ps, BYE, Instant::now() + PATIENT);
    Ok(epochs.report(
        0,
        w.started,
        0,
        w.trainee.classes().to_vec(),
        w.rank,
        w.roles.world(),
    ))
}

/// A worker's part of the epoch loop: its link to the servers and, on the lead, the servers'
/// model of the epoch just validated.
struct PsStrategy<'w, 'a, T: Trainee> {
    w: &'w mut Worker<'a, T>,
    /// The worker's exchange with the servers, until it finishes (the lead's last epoch).
    ps: Option<PsWorker>,
    /// The lead's client after it finished (reading the servers' final states).
    client: Option<Client>,
    params: Vec<f32>,
    step: u64,
    end: usize,
    /// The lead: the servers' model and state of the epoch just validated, for its checkpoint.
    served: Option<(T::Model, Vec<ShardState>)>,
    /// Early stopping's agreement among the workers.
    stop: Option<Communicator>,
    /// `--unfreeze-after`: the workers' agreement that the fine-tuning session is set up,
    /// until the switch.
    phase: Option<Communicator>,
}

impl<T: Trainee> PsStrategy<'_, '_, T> {
    /// The switch to the fine-tuning phase before `epoch`: the frozen phase's session ends
    /// (the lead takes the servers' final head), every tensor becomes trainable, and a new
    /// session shards the whole model over the servers at `--finetune-lr`, its rate going on
    /// from the steps taken. The head's optimizer state moves to its new shards; the
    /// backbone's starts at zero.
    fn unfreeze(&mut self, epoch: usize, log: &mut dyn FnMut(&str)) -> Result<()> {
        let Some(phase) = self.phase.take() else {
            return Ok(());
        };
        let ps = self
            .ps
            .take()
            .ok_or_else(|| HearthError::Training("the worker already finished".into()))?;
        let steps = ps.steps();
        let old_layout = ps.client.layout().clone();
        let old_tensors = trainable_names(&self.w.model);
        let mut client = ps.finish()?;
        let mut version = 0;
        let mut old_states = Vec::new();
        if self.w.rank == 0 {
            // Every worker is done with the frozen phase once the servers send their states.
            client.timeout = PATIENT;
            let states = client.final_states()?;
            version = states.iter().map(|s| s.version).max().unwrap_or(0);
            let head: Vec<f32> = states
                .iter()
                .flat_map(|s| s.values.iter().copied())
                .collect();
            self.w.model = with_trainable_values(self.w.model.clone(), &head)?;
            old_states = states;
            log(&self.w.rates.unfreeze_line(epoch - 1));
        }
        self.w.model = self.w.trainee.phase(self.w.model.clone(), false);
        let mut go = [0f32];
        if self.w.rank != 0 {
            // A request for the new session must not reach a server still in the old one:
            // wait until the lead has set every server up.
            phase.broadcast(&mut go, 0)?;
        }
        let (ps, params) = self.w.session(epoch, steps, |w, layout| {
            let values = trainable_values(&w.model);
            let ranges = |l: &Layout| (0..l.servers()).map(|i| l.range(i)).collect::<Vec<_>>();
            // The head's optimizer state goes on (as one process's fine-tuning phase loads
            // it from the checkpoint); the backbone's starts.
            let (before, after) = (ranges(&old_layout), ranges(layout));
            let now = trainable_names(&w.model);
            let optim = reshard_optim_state(
                Sharding {
                    tensors: &old_tensors,
                    ranges: &before,
                },
                &old_states,
                Sharding {
                    tensors: &now,
                    ranges: &after,
                },
            );
            Ok((0..layout.servers())
                .zip(optim)
                .map(|(i, optim_state)| ShardState {
                    version,
                    values: values[layout.range(i)].to_vec(),
                    optim_state,
                })
                .collect())
        })?;
        if self.w.rank == 0 {
            phase.broadcast(&mut go, 0)?;
        }
        self.ps = Some(ps);
        self.params = params;
        Ok(())
    }
}

impl<T: Trainee> Strategy for PsStrategy<'_, '_, T> {
    fn epoch(&mut self, epoch: usize, log: &mut dyn FnMut(&str)) -> Result<Option<Row>> {
        if self.w.rates.fine_tuning(epoch) {
            self.unfreeze(epoch, log)?;
        }
        let ps = self
            .ps
            .as_mut()
            .ok_or_else(|| HearthError::Training("the worker already finished".into()))?;
        self.w.epoch(epoch, ps, &mut self.params, &mut self.step)?;
        if self.w.rank != 0 {
            return Ok(None);
        }
        let states = if epoch < self.end {
            ps.client.checkpoint()?
        } else {
            // The last epoch ends when every worker is done.
            log("waiting for the other workers to finish");
            let mut client = self
                .ps
                .take()
                .ok_or_else(|| HearthError::Training("the worker already finished".into()))?
                .finish()?;
            client.timeout = PATIENT;
            let states = client.final_states()?;
            self.client = Some(client);
            states
        };
        let (row, served) = self.w.validate_servers(epoch, &states)?;
        self.served = Some((served, states));
        Ok(Some(row))
    }

    fn checkpoint(&mut self, epoch: usize, best: Option<usize>) -> Result<()> {
        match self.served.take() {
            Some((served, states)) => self.w.save(epoch, served, states, best),
            None => Ok(()),
        }
    }

    fn decode_failures(&self) -> (usize, usize) {
        self.w.trainee.decode_failures()
    }

    fn agree_stop(&mut self, stop: bool) -> Result<bool> {
        let Some(comm) = &self.stop else {
            return Ok(stop);
        };
        let mut flag = [if stop { 1.0f32 } else { 0.0 }];
        comm.broadcast(&mut flag, 0)?;
        Ok(flag[0] > 0.5)
    }
}
