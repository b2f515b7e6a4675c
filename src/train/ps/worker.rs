//! A worker of a parameter-server run: its shard of the data, the mode's rule around every
//! step, and, on the lead (rank 0), the epoch ends (validation of the servers' model,
//! checkpoints, metrics). The loop that drives it is in `run.rs`, the end of the run (final
//! state, per-worker metrics, export) in `finish.rs`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::prelude::*;
use burn::store::ModuleRecord;
use burn_dist::Communicator;
use burn_dist::flat::layout::Layout;
use burn_dist::flat::module::{
    trainable_grads, trainable_names, trainable_values, with_trainable_values,
};
use burn_dist::ps::client::{Client, PsWorker};
use burn_dist::ps::message::ShardState;
use burn_dist::transport::Transport;
use burn_dist::wire::Kind;

use super::super::flat::{decay_ranges, flat_optimizer};
use super::job::{Roles, SETUP, ServerSetup};
use super::state::{EpochStats, PsState, state_file};
use crate::settings::PsOptions;
use crate::train::checkpoint::{model_checkpoint, save_epoch_weights};
use crate::train::epochs::{Epochs, Row};
use crate::train::exchange::Update;
use crate::train::model::seed_stream;
use crate::train::objective::{Objective, insert_top5};
use crate::train::precision::LossScaler;
use crate::train::scores::ValScores;
use crate::train::shared::{Rates, collective_timeout, epoch_lr};
use crate::train::trainee::{Net, Trainee};
use crate::train::{TrainConfig, run_dir};
use crate::{HearthError, Result};

/// A long wait that only a peer's loss ends early (waiting for the slowest worker).
pub(super) const PATIENT: Duration = Duration::from_secs(24 * 3600);

/// What the steps of one worker share.
pub(super) struct Worker<'a, T: Trainee> {
    pub(super) cfg: &'a TrainConfig,
    pub(super) opts: &'a PsOptions,
    pub(super) roles: Roles,
    pub(super) rank: usize,
    pub(super) t: Arc<dyn Transport>,
    pub(super) device: Device,
    pub(super) plain_device: Device,
    /// The model and this worker's shard of the data.
    pub(super) trainee: T,
    pub(super) objective: Objective,
    pub(super) model: T::Model,
    pub(super) stats: Vec<EpochStats>,
    pub(super) started: Instant,
    /// Fault injection: the test and benchmark hooks (`train/faults.rs`).
    pub(super) faults: crate::train::faults::Faults,
    /// Each optimizer step's rate and the transfer-learning phases (the `train_lr` column, as
    /// burn-train's metric writes it for data parallel runs: [`epoch_lr`]).
    pub(super) rates: Rates,
    /// Loader batches per epoch on this worker.
    pub(super) batches: usize,
    /// fp16's loss scale of this worker's own steps (`--precision fp16`): each worker decides
    /// for its own gradient (see [`Update::served`]).
    pub(super) scaler: Option<LossScaler>,
    /// A multi-label run's training outputs of each epoch on this worker, for the epoch's
    /// `train_auroc` (every worker's, merged by the lead at the end).
    pub(super) train_scores: Vec<(usize, ValScores)>,
    /// `optim.model_ema` on the lead: the weight average of the model it holds (`average.rs`).
    pub(super) ema: Option<crate::train::ema::Ema<T::Model>>,
    /// `checkpoint.log_every` on the lead: its own steps' scalars (the workers do not step
    /// together, so there is no job-wide sum per step; the epochs' rows hold every worker's).
    pub(super) step_log: Option<crate::train::step_log::StepLog>,
}

impl<T: Trainee> Worker<'_, T> {
    /// Starts a session with the servers for the model's trainable tensors in the phase of
    /// `epoch`: the lead sends each server its optimizer's setup (the phase's rate and
    /// schedule) and its starting shard (`states`); every worker pulls the values. `steps`:
    /// this worker's optimizer steps before (the asynchronous modes' local rate goes on from
    /// there).
    pub(super) fn session(
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
        // The asynchronous modes clip each local step's gradient (sync: the servers do).
        let ps = ps
            .with_optimizer(local)
            .with_clip(cfg.optim.clip_grad)
            .resumed_at(steps);
        self.model = with_trainable_values(self.model.clone(), &params)?;
        Ok((ps, params))
    }

    /// `--resume`: the lead reads `checkpoint/ps.state` and its epoch's weights (its batch-norm
    /// statistics); every worker learns the epoch to go on after.
    pub(super) fn resume(
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
            if cfg.checkpoint.resume {
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
    pub(super) fn starting_state(
        &self,
        layout: &Layout,
        resume: Option<PsState>,
    ) -> Result<Vec<ShardState>> {
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
            return super::state::reshard(&s.shards, layout, &trainable_names(&self.model))
                .map_err(|e| {
                    HearthError::Training(format!(
                        "{}: {e}",
                        state_file(&self.cfg.run_dir).display()
                    ))
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
    pub(super) fn epoch(
        &mut self,
        epoch: usize,
        ps: &mut PsWorker,
        params: &mut Vec<f32>,
        step: &mut u64,
    ) -> Result<()> {
        let began = Instant::now();
        let mut row = EpochStats {
            epoch,
            ..Default::default()
        };
        // `--grad-accum K`: the sum of K batches' mean gradients goes to the servers as one
        // step (burn-train's accumulation), on every K-th batch and the epoch's last.
        let k = self.cfg.optim.grad_accum.unwrap_or(1).max(1);
        let batches = self.trainee.shard_batches();
        let mut acc: Option<(Vec<f32>, u64)> = None;
        let mut scores = self.trainee.multi_label().then(ValScores::default);
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
                .map_or(1.0, |s| s.loss_factor(self.faults.overflow_at()));
            let (grads, sums) = self.objective.train_batch_scored(
                &self.model,
                input,
                &targets,
                factor,
                scores.as_mut(),
            )?;
            let n = sums.samples as usize;
            if let Some(l) = &mut self.step_log {
                l.add(epoch, sums);
            }
            row.correct += sums.hits;
            row.top5 += sums.top5;
            row.loss_sum += sums.loss;
            row.samples += sums.samples;
            let grad = trainable_grads(&self.model, &grads);
            // The test hooks of a slow worker, and of one lost mid-run (no goodbye).
            self.faults.after_compute(*step);
            self.faults.in_step(*step);
            *step += 1;
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
            // Exchange and commit in one: the servers apply the mode's rule.
            // `optim.clip_grad` is the servers' (sync) or the local steps' (set up with the
            // session), not the exchange's.
            let update = Update {
                clip: None,
                scaler: self.scaler.as_mut(),
            };
            let stepped = update.served(ps, params, sum, samples)?;
            if !stepped {
                row.skipped += 1.0;
            }
            row.wait += waited.elapsed().as_secs_f64();
            self.model = with_trainable_values(self.model.clone(), params)?;
            if stepped {
                self.average_step();
            }
            if let Some(l) = &mut self.step_log {
                let step = ps.steps();
                let lr = self.rates.rate(epoch, step.saturating_sub(1) as usize);
                l.stepped(step, lr, Ok)?;
            }
        }
        row.elapsed = self.started.elapsed().as_secs_f64();
        row.seconds = began.elapsed().as_secs_f64();
        row.bytes = (ps.client.bytes_in + ps.client.bytes_out) as f64;
        self.stats.push(row);
        if let Some(s) = scores {
            self.train_scores.push((epoch, s));
        }
        self.save_loss_scale(epoch)
    }

    /// fp16: this worker's loss scale after `epoch`, in its own file of the run directory (on
    /// its own disk), for a resume after that epoch; the one before the last is removed.
    pub(super) fn save_loss_scale(&self, epoch: usize) -> Result<()> {
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

    pub(super) fn loss_scale_file(&self, epoch: usize) -> std::path::PathBuf {
        self.cfg
            .run_dir
            .join("checkpoint")
            .join(format!("loss-scale-w{}-{epoch}.json", self.rank))
    }

    /// The lead after `epoch`: the servers' model (at one consistent cut) validated with the
    /// lead's batch-norm statistics; the epoch's metrics row and that model.
    pub(super) fn validate_servers(
        &self,
        epoch: usize,
        states: &[ShardState],
    ) -> Result<(Row, T::Model)> {
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
                    self.cfg.optim.grad_accum.unwrap_or(1),
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
        // The lead's own training top-5 here; the mean over the workers once their stats
        // are in (`merge_worker_stats`).
        insert_top5(
            &mut row,
            self.trainee.classes().len(),
            self.trainee.multi_label(),
            (mine.top5, mine.samples),
            (val.sums.top5, val.sums.samples),
        );
        if self.scaler.is_some() {
            row.insert("train_skipped_steps".into(), mine.skipped);
        }
        self.validate_average(&mut row)?;
        Ok((row, served))
    }

    /// Asynchronous modes: the servers' parameters with batch-norm statistics measured on
    /// them (forward passes in training mode over up to 50 of the lead's training batches,
    /// nothing learned). The lead's own statistics follow its local parameters, which the
    /// other workers' updates move away from the servers' (most after `--unfreeze-after`,
    /// when the backbone's layers move); in sync mode they are the servers' already.
    pub(super) fn measure_batch_norm(&self, served: T::Model, epoch: usize) -> Result<T::Model> {
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
    pub(super) fn save(
        &self,
        epoch: usize,
        served: T::Model,
        states: Vec<ShardState>,
        best: Option<usize>,
    ) -> Result<()> {
        let dir = &self.cfg.run_dir;
        save_epoch_weights(dir, epoch, served, &Default::default())?;
        self.save_average(epoch, best)?;
        // The state file names the epoch whose weights (and average) it goes with: written
        // after them.
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
}
