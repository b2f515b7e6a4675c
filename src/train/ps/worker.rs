//! A worker of a parameter-server run: its shard of the data, the mode's rule around every
//! step, and, on the lead (rank 0), the epoch ends (validation of the servers' model,
//! checkpoints, metrics) and the end of the run (final state, per-worker metrics, export).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::prelude::*;
use burn::store::ModuleRecord;
use burn_dist::flat::layout::Layout;
use burn_dist::flat::module::{
    trainable_grads, trainable_names, trainable_values, with_trainable_values,
};
use burn_dist::ps::client::{Client, PsWorker};
use burn_dist::ps::message::ShardState;
use burn_dist::transport::Transport;
use burn_dist::transport::group::Group;
use burn_dist::wire::Kind;
use burn_dist::{Communicator, DistError};

use super::super::flat::{decay_ranges, flat_optimizer};
use super::job::{BYE, Roles, SETUP, SKIPPED, STATS, ServerSetup};
use super::state::{
    EpochStats, PsState, Sharding, decode_stats, encode_stats, reshard_optim_state, state_file,
};
use crate::settings::Precision;
use crate::settings::PsOptions;
use crate::train::best::{model_checkpoint, save_epoch_weights};
use crate::train::epochs::{Epochs, Row, Strategy};
use crate::train::export::export_best;
use crate::train::model::seed_stream;
use crate::train::objective::Objective;
use crate::train::precision::{LossScaler, overflow_hook, unscale_flat};
use crate::train::shared::{Rates, collective_timeout, epoch_lr, hook};
use crate::train::trainee::{Net, Recipe, Trainee};
use crate::train::{TrainConfig, TrainReport, run_dir};
use crate::{HearthError, Result};

/// A long wait that only a peer's loss ends early (waiting for the slowest worker).
const PATIENT: Duration = Duration::from_secs(24 * 3600);

/// What the steps of one worker share.
struct Worker<'a, T: Trainee> {
    cfg: &'a TrainConfig,
    opts: &'a PsOptions,
    roles: Roles,
    rank: usize,
    t: Arc<dyn Transport>,
    device: Device,
    plain_device: Device,
    /// The model and this worker's shard of the data.
    trainee: T,
    objective: Objective,
    model: T::Model,
    stats: Vec<EpochStats>,
    started: Instant,
    delay: Option<u64>,
    die_at: Option<u64>,
    /// Each optimizer step's rate and the transfer-learning phases (the `train_lr` column, as
    /// burn-train's metric writes it for data parallel runs: [`epoch_lr`]).
    rates: Rates,
    /// Loader batches per epoch on this worker.
    batches: usize,
    /// fp16's loss scale of this worker's own steps (`--precision fp16`): each worker decides
    /// for its own gradient (see [`Worker::push`]).
    scaler: Option<LossScaler>,
    overflow_at: Option<u64>,
}

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
    let group = Group::new(t.clone(), roles.worker_ranks(), 2)?;
    let comm = Communicator::new(Arc::new(group)).with_timeout(collective_timeout());
    let trainee = recipe.prepare(cfg, Some(&comm), rank, roles.workers, log)?;
    let objective = Objective::new(cfg, trainee.multi_label());
    let ad = device.clone().autodiff();
    let mut model = trainee.init(&ad, log)?;
    if cfg.freeze_backbone {
        log("backbone frozen: only the head trains");
        model = trainee.phase(model, true);
    }
    // Loader batches per epoch (optimizer steps: a K-th of them with `--grad-accum K`).
    let batches = trainee.shard_batches().max(1);
    let rates = Rates::new(cfg, lr, batches)?;
    let mut w = Worker {
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
        delay: hook("HEARTH_PS_DELAY_MS", &format!("w{rank}")),
        die_at: hook("HEARTH_PS_DIE_AT_STEP", &format!("w{rank}")),
        rates,
        batches,
        scaler: (cfg.precision == Precision::Fp16).then(LossScaler::default),
        overflow_at: overflow_hook(cfg.precision, &format!("w{rank}")),
    };
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
    let steps_before = (first * cfg.optimizer_steps(batches)) as u64;
    let (ps, params) = w.session(first + 1, steps_before, |w, layout| {
        w.starting_state(layout, resume)
    })?;
    // Early stopping: the lead's decision reaches every worker at each epoch's end (only then
    // do the asynchronous workers wait for each other; a long wait: the lead validates).
    let stop = match cfg.patience {
        Some(_) => Some(
            Communicator::new(Arc::new(Group::new(w.t.clone(), roles.worker_ranks(), 3)?))
                .with_timeout(PATIENT),
        ),
        None => None,
    };
    // `--unfreeze-after`: the workers agree on the switch to the fine-tuning session.
    let phase = match w.rates.fine_tuning(epochs.end()) && !unfrozen {
        true => Some(
            Communicator::new(Arc::new(Group::new(w.t.clone(), roles.worker_ranks(), 4)?))
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
        w.t.send(0, Kind::Ps, STATS, encode_stats(&w.stats))?;
        let skipped = crate::train::shared::encode_lines(&w.trainee.skipped());
        w.t.send(0, Kind::Ps, SKIPPED, skipped)?;
        // The lead's goodbye, or its loss, ends this worker.
        let _ = w.t.recv(0, Kind::Ps, BYE, Instant::now() + PATIENT);
        return Ok(epochs.report(
            0,
            w.started,
            0,
            w.trainee.classes().to_vec(),
            rank,
            w.roles.world(),
        ));
    }
    if last < epochs.end() {
        // Stopped early: every worker is done once the servers send their final states.
        client.timeout = PATIENT;
        client.final_states()?;
    }
    w.finish(&epochs, last, log)
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

impl<T: Trainee> Worker<'_, T> {
    /// Starts a session with the servers for the model's trainable tensors in the phase of
    /// `epoch`: the lead sends each server its optimizer's setup (the phase's rate and
    /// schedule) and its starting shard (`states`); every worker pulls the values. `steps`:
    /// this worker's optimizer steps before (the asynchronous modes' local rate goes on from
    /// there).
    fn session(
        &mut self,
        epoch: usize,
        steps: u64,
        states: impl FnOnce(&Self, &Layout) -> Result<Vec<ShardState>>,
    ) -> Result<(PsWorker, Vec<f32>)> {
        let cfg = self.cfg;
        let layout = Layout::new(&trainable_names(&self.model), self.roles.servers)?;
        let mut client = Client::new(self.t.clone(), layout.clone(), self.roles.server_ranks())?;
        client.timeout = collective_timeout().max(Duration::from_secs(600));
        let lr = self.rates.base(epoch);
        // The run's optimizer over the whole vector: the asynchronous modes' local steps (by
        // this worker's step count), and each server's, restricted to its shard.
        let local = flat_optimizer(cfg, lr, self.batches, decay_ranges(cfg, &self.model))?;
        if self.rank == 0 {
            for (s, &server) in self.roles.server_ranks().iter().enumerate() {
                let setup = ServerSetup {
                    batches_per_epoch: self.batches as u64,
                    lr,
                    decay: local.restrict(layout.range(s)).decay,
                };
                self.t.send(server, Kind::Ps, SETUP, setup.encode())?;
            }
            client.init_servers(states(self, &layout)?)?;
        }
        let (ps, params) = PsWorker::start(
            client,
            self.opts.mode,
            self.opts.window(),
            lr as f32,
            self.opts.rho_at(lr) as f32,
        )?;
        let ps = ps.with_optimizer(local).resumed_at(steps);
        self.model = with_trainable_values(self.model.clone(), &params)?;
        Ok((ps, params))
    }

    /// `--resume`: the lead reads `checkpoint/ps.state` and its epoch's weights (its batch-norm
    /// statistics); every worker learns the epoch to go on after.
    fn resume(
        &mut self,
        comm: &Communicator,
        epochs: &Epochs,
        log: &mut dyn FnMut(&str),
    ) -> Result<Option<PsState>> {
        let cfg = self.cfg;
        let hparams = cfg.hyperparameters();
        let mut state = None;
        let mut epoch = [0f32];
        if self.rank == 0 {
            if cfg.resume {
                let s = PsState::load(&state_file(&cfg.run_dir))?;
                run_dir::check_resume_compatible(&cfg.run_dir, &self.trainee.describe(), &hparams)?;
                epochs.reload(s.epoch)?;
                let path = model_checkpoint(&cfg.run_dir, s.epoch);
                let record = ModuleRecord::load(&path).map_err(|e| {
                    HearthError::Training(format!(
                        "epoch {}'s checkpoint {}: {e}",
                        s.epoch,
                        path.display()
                    ))
                })?;
                self.model = self.model.clone().load_record(record);
                log(&format!("resuming after epoch {}", s.epoch));
                if s.shards.len() != self.roles.servers {
                    log(&format!(
                        "the servers' state was written by {} server(s): cut anew for {}",
                        s.shards.len(),
                        self.roles.servers
                    ));
                }
                epoch[0] = s.epoch as f32;
                state = Some(s);
            } else {
                run_dir::record(&cfg.run_dir, &self.trainee.describe(), &hparams)?;
            }
        }
        comm.broadcast(&mut epoch, 0)?;
        if self.rank != 0 && epoch[0] > 0.0 {
            // Only the values matter here: they come from the servers.
            state = Some(PsState {
                epoch: epoch[0] as usize,
                shards: Vec::new(),
            });
        }
        Ok(state)
    }

    /// Every shard's starting state: the seeded model's values, or the checkpoint's.
    fn starting_state(&self, layout: &Layout, resume: Option<PsState>) -> Result<Vec<ShardState>> {
        if let Some(s) = resume {
            let held: usize = s.shards.iter().map(|x| x.values.len()).sum();
            if held != layout.total() {
                return Err(HearthError::InvalidArgument(format!(
                    "{} holds {held} values in {} shards; this run's model has {}: resume with \
                     the same model",
                    state_file(&self.cfg.run_dir).display(),
                    s.shards.len(),
                    layout.total()
                )));
            }
            let same_cut = s.shards.len() == layout.servers()
                && s.shards
                    .iter()
                    .enumerate()
                    .all(|(i, sh)| sh.values.len() == layout.range(i).len());
            if same_cut {
                return Ok(s.shards);
            }
            return reshard(&s.shards, layout, &trainable_names(&self.model)).map_err(|e| {
                HearthError::Training(format!("{}: {e}", state_file(&self.cfg.run_dir).display()))
            });
        }
        let values = trainable_values(&self.model);
        Ok((0..layout.servers())
            .map(|i| ShardState {
                version: 0,
                values: values[layout.range(i)].to_vec(),
                optim_state: Vec::new(),
            })
            .collect())
    }

    /// One epoch of this worker's shard.
    fn epoch(
        &mut self,
        epoch: usize,
        ps: &mut PsWorker,
        params: &mut Vec<f32>,
        step: &mut u64,
    ) -> Result<()> {
        let mut row = EpochStats {
            epoch,
            ..Default::default()
        };
        // `--grad-accum K`: the sum of K batches' mean gradients goes to the servers as one
        // step (burn-train's accumulation), on every K-th batch and the epoch's last.
        let k = self.cfg.grad_accum.unwrap_or(1).max(1);
        let batches = self.trainee.shard_batches();
        let mut acc: Option<(Vec<f32>, u64)> = None;
        for (i, batch) in self
            .trainee
            .shard(epoch as u64 - 1, &self.device)
            .enumerate()
        {
            let (input, targets) = batch?;
            seed_stream(&self.device, self.cfg.seed, *step, self.rank);
            // fp16: the loss times the scale; the sum is divided by it before it goes out.
            let factor = self
                .scaler
                .as_ref()
                .map_or(1.0, |s| s.loss_factor(self.overflow_at));
            let (grads, sums) = self
                .objective
                .train_batch(&self.model, input, &targets, factor)?;
            let n = sums.samples as usize;
            row.correct += sums.hits;
            row.loss_sum += sums.loss;
            row.samples += sums.samples;
            let grad = trainable_grads(&self.model, &grads);
            if let Some(ms) = self.delay {
                std::thread::sleep(Duration::from_millis(ms));
            }
            *step += 1;
            if self.die_at.is_some_and(|at| *step >= at) {
                // The test hook of a worker lost mid-run (SIGKILL: no goodbye).
                // SAFETY: signals this very process.
                unsafe {
                    libc::kill(libc::getpid(), libc::SIGKILL);
                }
            }
            let (sum, samples) = match acc.take() {
                None => (grad, n as u64),
                Some((mut sum, m)) => {
                    sum.iter_mut().zip(&grad).for_each(|(s, g)| *s += g);
                    (sum, m + n as u64)
                }
            };
            if (i + 1) % k != 0 && i + 1 < batches {
                acc = Some((sum, samples));
                continue;
            }
            let waited = Instant::now();
            self.push(ps, params, sum, samples, &mut row)?;
            row.wait += waited.elapsed().as_secs_f64();
            self.model = with_trainable_values(self.model.clone(), params)?;
        }
        row.elapsed = self.started.elapsed().as_secs_f64();
        row.bytes = (ps.client.bytes_in + ps.client.bytes_out) as f64;
        self.stats.push(row);
        self.save_loss_scale(epoch)
    }

    /// fp16: this worker's loss scale after `epoch`, in its own file of the run directory (on
    /// its own disk), for a resume after that epoch; the one before the last is removed.
    fn save_loss_scale(&self, epoch: usize) -> Result<()> {
        let Some(s) = &self.scaler else {
            return Ok(());
        };
        let file = self.loss_scale_file(epoch);
        if let Some(dir) = file.parent() {
            std::fs::create_dir_all(dir).map_err(|source| HearthError::Write {
                path: dir.to_path_buf(),
                source,
            })?;
        }
        s.save(&file)
            .map_err(|source| HearthError::Write { path: file, source })?;
        if epoch > 2 {
            let _ = std::fs::remove_file(self.loss_scale_file(epoch - 2));
        }
        Ok(())
    }

    fn loss_scale_file(&self, epoch: usize) -> std::path::PathBuf {
        self.cfg
            .run_dir
            .join("checkpoint")
            .join(format!("loss-scale-w{}-{epoch}.json", self.rank))
    }

    /// One step of the mode's rule with `grad` (the sum over `samples` samples). fp16: the
    /// gradient is divided by the loss scale, and one that is not finite is skipped (this
    /// worker's scale halves): the step still counts, but this worker's gradient is left out
    /// (sync: its share of the round weighs nothing; asynchronous modes: no local update, the
    /// exchanges keep their rhythm). Workers of a parameter-server run never exchange
    /// gradients with each other, so each decides for its own; a round where every worker
    /// skipped changes nothing on the servers.
    fn push(
        &mut self,
        ps: &mut PsWorker,
        params: &mut Vec<f32>,
        mut grad: Vec<f32>,
        samples: u64,
        row: &mut EpochStats,
    ) -> Result<()> {
        if let Some(s) = &mut self.scaler {
            let finite = unscale_flat(&mut grad, s.scale());
            if !s.decide(finite) {
                row.skipped += 1.0;
                return Ok(ps.skip(params)?);
            }
        }
        Ok(ps.step(params, &grad, samples)?)
    }

    /// The lead after `epoch`: the servers' model (at one consistent cut) validated with the
    /// lead's batch-norm statistics; the epoch's metrics row and that model.
    fn validate_servers(&self, epoch: usize, states: &[ShardState]) -> Result<(Row, T::Model)> {
        let values: Vec<f32> = states
            .iter()
            .flat_map(|s| s.values.iter().copied())
            .collect();
        let mut served = with_trainable_values(self.model.clone(), &values)?;
        if self.opts.mode != burn_dist::ps::Mode::Sync {
            served = self.measure_batch_norm(served, epoch)?;
        }
        // The lead validates the whole set alone: its scores need no gathering.
        let val = self.objective.validate(
            &served.valid(),
            self.trainee.full_val(&self.plain_device),
            None,
        )?;
        let mine = self.stats.last().copied().unwrap_or_default();
        let mut row: Row = [
            ("train_loss", mine.loss()),
            ("train_accuracy", mine.accuracy()),
            ("val_loss", val.sums.mean_loss()),
            ("val_accuracy", val.sums.accuracy()),
            (
                "train_lr",
                epoch_lr(
                    |i| self.rates.rate(epoch, i),
                    epoch,
                    self.batches,
                    self.cfg.grad_accum.unwrap_or(1),
                ),
            ),
            ("elapsed_seconds", self.started.elapsed().as_secs_f64()),
            (
                "server_version",
                states.first().map_or(0.0, |s| s.version as f64),
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        if let Some(a) = val.auroc {
            row.insert("val_auroc".into(), a);
        }
        if self.scaler.is_some() {
            row.insert("train_skipped_steps".into(), mine.skipped);
        }
        Ok((row, served))
    }

    /// Asynchronous modes: the servers' parameters with batch-norm statistics measured on
    /// them (forward passes in training mode over up to 50 of the lead's training batches,
    /// nothing learned). The lead's own statistics follow its local parameters, which the
    /// other workers' updates move away from the servers' (most after `--unfreeze-after`,
    /// when the backbone's layers move); in sync mode they are the servers' already.
    fn measure_batch_norm(&self, served: T::Model, epoch: usize) -> Result<T::Model> {
        if !self.trainee.has_batch_norm() {
            return Ok(served);
        }
        let stream = self
            .trainee
            .shard(u64::MAX / 2 + epoch as u64, &self.device);
        for batch in stream.take(50) {
            let (input, _) = batch?;
            let _ = served.logits(input);
        }
        Ok(served)
    }

    /// The lead's checkpoint of `epoch`: the servers' model and their state (the best epoch's
    /// and the last epoch's weights are kept).
    fn save(
        &self,
        epoch: usize,
        served: T::Model,
        states: Vec<ShardState>,
        best: Option<usize>,
    ) -> Result<()> {
        let dir = &self.cfg.run_dir;
        save_epoch_weights(dir, epoch, served, &Default::default())?;
        // The state file names the epoch whose weights it goes with: written after them.
        PsState {
            epoch,
            shards: states,
        }
        .save(&state_file(dir))?;
        for old in 1..epoch {
            if Some(old) != best {
                let _ = std::fs::remove_file(model_checkpoint(dir, old));
            }
        }
        Ok(())
    }

    /// The lead at the end: every worker's statistics into `metrics.csv`, the goodbyes, the
    /// plot, and the best epoch's weights into `model.bpk`.
    fn finish(
        &self,
        epochs: &Epochs,
        last: usize,
        log: &mut dyn FnMut(&str),
    ) -> Result<TrainReport> {
        // The servers' sessions are over: no further one follows.
        for &server in &self.roles.server_ranks() {
            self.t.send(server, Kind::Ps, SETUP, Vec::new())?;
        }
        let mut all: Vec<(usize, Vec<EpochStats>)> = vec![(0, self.stats.clone())];
        let mut skipped = self.trainee.skipped();
        let deadline = Instant::now() + collective_timeout();
        for r in 1..self.roles.workers {
            match self.t.recv(r, Kind::Ps, STATS, deadline) {
                Ok(b) => match decode_stats(&b) {
                    Ok(s) => all.push((r, s)),
                    Err(e) => log(&format!("worker {r} sent damaged statistics: {e}")),
                },
                Err(DistError::PeerFailed { reason, .. }) => {
                    log(&format!(
                        "worker {r} was lost ({reason}); its statistics are missing"
                    ));
                    continue;
                }
                Err(e) => {
                    log(&format!("no statistics from worker {r}: {e}"));
                    continue;
                }
            }
            // Its skipped images, for the summary (each worker decodes only its shard).
            match self
                .t
                .recv(r, Kind::Ps, SKIPPED, deadline)
                .map_err(|e| e.to_string())
                .and_then(|b| crate::train::shared::decode_lines(&b))
            {
                Ok(lines) => {
                    for l in lines {
                        if !skipped.contains(&l) {
                            skipped.push(l);
                        }
                    }
                }
                Err(e) => log(&format!("worker {r}'s skipped images are missing: {e}")),
            }
        }
        for r in (1..self.roles.workers).chain(self.roles.server_ranks()) {
            let _ = self.t.send(r, Kind::Ps, BYE, Vec::new());
        }
        epochs.update_rows(|rows| self.merge_worker_stats(rows, &all, log));
        epochs.write_csv()?;
        let best = epochs.best_or_err()?;
        let per_class_auroc = export_best(
            self.cfg,
            &self.trainee,
            best,
            &self.plain_device,
            &Default::default(),
            log,
        )?;
        epochs.plot(log);
        let samples: f64 = all.iter().flat_map(|(_, s)| s).map(|s| s.samples).sum();
        let mut report = epochs.report(
            best,
            self.started,
            samples as usize,
            self.trainee.classes().to_vec(),
            0,
            self.roles.world(),
        );
        report.epochs_run = last;
        report.per_class_auroc = per_class_auroc;
        report.skipped = skipped;
        Ok(report)
    }

    /// Each worker's epochs as `*_rank{r}` columns, `train_*` as the mean over the workers,
    /// bytes exchanged per sample, and in sync mode which worker the rounds waited for.
    fn merge_worker_stats(
        &self,
        rows: &mut crate::train::EpochRows,
        all: &[(usize, Vec<EpochStats>)],
        log: &mut dyn FnMut(&str),
    ) {
        for (&epoch, row) in rows.iter_mut() {
            let mut of_epoch: Vec<(usize, EpochStats)> = Vec::new();
            for (r, stats) in all {
                if let Some(s) = stats.iter().find(|s| s.epoch == epoch) {
                    of_epoch.push((*r, *s));
                }
            }
            if of_epoch.is_empty() {
                continue;
            }
            for (r, s) in &of_epoch {
                row.insert(format!("train_accuracy_rank{r}"), s.accuracy());
                row.insert(format!("train_loss_rank{r}"), s.loss());
                row.insert(format!("wait_seconds_rank{r}"), s.wait);
                row.insert(format!("elapsed_seconds_rank{r}"), s.elapsed);
                if self.scaler.is_some() {
                    row.insert(format!("skipped_steps_rank{r}"), s.skipped);
                }
            }
            if self.scaler.is_some() {
                row.insert(
                    "train_skipped_steps".into(),
                    of_epoch.iter().map(|(_, s)| s.skipped).sum(),
                );
            }
            let samples: f64 = of_epoch.iter().map(|(_, s)| s.samples).sum();
            row.insert(
                "train_loss".into(),
                of_epoch.iter().map(|(_, s)| s.loss_sum).sum::<f64>() / samples.max(1.0),
            );
            row.insert(
                "train_accuracy".into(),
                100.0 * of_epoch.iter().map(|(_, s)| s.correct).sum::<f64>() / samples.max(1.0),
            );
            if self.opts.mode == burn_dist::ps::Mode::Sync && of_epoch.len() > 1 {
                // The slowest worker waits least: the rounds wait for it.
                if let Some((slow, s)) =
                    of_epoch.iter().min_by(|a, b| a.1.wait.total_cmp(&b.1.wait))
                {
                    let others: Vec<f64> = of_epoch
                        .iter()
                        .filter(|(r, _)| r != slow)
                        .map(|(_, s)| s.wait)
                        .collect();
                    let mean = others.iter().sum::<f64>() / others.len().max(1) as f64;
                    log(&format!(
                        "epoch {epoch}: the sync rounds waited mostly for worker {slow}: the \
                         others waited {mean:.1} s on the servers on average, it {:.1} s",
                        s.wait
                    ));
                }
            }
        }
        // Cumulative bytes over cumulative samples, per epoch.
        let mut bytes_at: BTreeMap<usize, (f64, f64)> = BTreeMap::new();
        for (_, stats) in all {
            let mut samples = 0.0;
            for s in stats {
                samples += s.samples;
                let e = bytes_at.entry(s.epoch).or_default();
                e.0 += s.bytes;
                e.1 += samples;
            }
        }
        for (epoch, (bytes, samples)) in bytes_at {
            if let Some(row) = rows.get_mut(&epoch) {
                row.insert("bytes_per_sample".into(), bytes / samples.max(1.0));
            }
        }
    }
}

/// `shards` (a checkpoint's, written by another number of servers) cut anew for `layout`:
/// the same flat vector of `tensors`, each value with its optimizer state, at the new servers'
/// ranges. Shards of one consistent cut hold the same version (the updates applied); where
/// they differ, the new shards take the largest.
fn reshard(
    shards: &[ShardState],
    layout: &Layout,
    tensors: &[(String, usize)],
) -> std::result::Result<Vec<ShardState>, String> {
    let mut values = Vec::with_capacity(layout.total());
    let mut old_ranges = Vec::with_capacity(shards.len());
    for s in shards {
        old_ranges.push(values.len()..values.len() + s.values.len());
        values.extend_from_slice(&s.values);
    }
    let new_ranges: Vec<std::ops::Range<usize>> =
        (0..layout.servers()).map(|i| layout.range(i)).collect();
    let optim = reshard_optim_state(
        Sharding {
            tensors,
            ranges: &old_ranges,
        },
        shards,
        Sharding {
            tensors,
            ranges: &new_ranges,
        },
    );
    let had_state = shards.iter().any(|s| !s.optim_state.is_empty());
    if had_state && optim.iter().all(Vec::is_empty) {
        return Err(format!(
            "the optimizer state of its {} shards does not fit their values",
            shards.len()
        ));
    }
    let version = shards.iter().map(|s| s.version).max().unwrap_or(0);
    Ok(new_ranges
        .into_iter()
        .zip(optim)
        .map(|(r, optim_state)| ShardState {
            version,
            values: values[r].to_vec(),
            optim_state,
        })
        .collect())
}
