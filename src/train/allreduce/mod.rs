//! Data parallel over a fixed world by gradient allreduce, on the shared epoch loop: the mode
//! of Hearth's image models and of a user's own module ([`super::train_custom`]) in one
//! process (a world of one) or on `--nproc N` ranks.
//!
//! A step: each rank computes the gradient of its share of the global batch
//! ([`super::trainee::Trainee::shard`]: every `world`-th sample of each global batch of the
//! epoch's order, so the ranks together see exactly the batches one process would), `--grad-accum
//! K` batches summed (burn-train's accumulation); the gradients are averaged over the ranks
//! (bucketed allreduce, `--compression` on the wire; `--overlap`: during the backward, unit by
//! unit; `--zero`: reduce-scattered into each rank's shard of the optimizer) and every rank
//! applies the same optimizer step at the schedule's rate. Validation: each rank scores every `world`-th validation
//! example with rank 0's batch-norm statistics, and the sums (and AUROC scores) are combined.
//!
//! Checkpoints: rank 0 writes `checkpoint/model-<epoch>.bpk` (the best epoch's and the last
//! are kept) and `checkpoint/optim-<epoch>.bpk` (the last); `--resume` reads them on rank 0 and
//! sends them to the others, so the ranks need no shared disk. The optimizer step and the data
//! order are functions of the epoch, so a resumed run continues the uninterrupted one.

mod files;
mod progress;
mod rows;
mod sharding;

use progress::Progress;

use std::sync::Arc;
use std::time::Instant;

use burn::module::Module;
use burn::optim::{GradientsAccumulator, ModuleOptimizer};
use burn::prelude::*;
use burn_dist::overlap::OverlappedStep;
use burn_dist::zero::ZeroOptimizer;
use burn_dist::zero::module::ShardedParams;
use burn_dist::{Communicator, ReduceOp};

use super::ema::Ema;
use super::epochs::{Epochs, Row};
use super::exchange::{Exchange, ShardedGrads, Update};
use super::export::export_best;
use super::faults::Faults;
use super::model::{optimizer, seed_stream};
use super::objective::{Objective, Sums, insert_top5};
use super::precision::{LossScaler, divide};
use super::scores::ValScores;
use super::shared::{Rates, epoch_lr, val_share};
use super::step_log::StepLog;
use super::trainee::{Recipe, Trainee};
use super::{TrainConfig, TrainReport, run_dir};
use crate::settings::Precision;
use crate::{HearthError, Result};

/// Trains `recipe`'s model in this process, or as one rank of `cfg.dist`'s job.
pub(super) fn train_with<R: Recipe>(
    cfg: &TrainConfig,
    recipe: &R,
    device: &Device,
    log: &mut dyn FnMut(&str),
) -> Result<TrainReport> {
    let started = Instant::now();
    let comm = match &cfg.dist {
        Some(info) if info.world > 1 => Some(Arc::new(
            super::distributed::connect(info, log)?
                .with_compression(cfg.exchange.compression)
                .with_timeout(super::shared::collective_timeout()),
        )),
        _ => None,
    };
    let (rank, world) = comm.as_ref().map_or((0, 1), |c| (c.rank(), c.world()));
    let mut quiet = |_: &str| {};
    let log: &mut dyn FnMut(&str) = if rank == 0 { log } else { &mut quiet };
    if rank == 0 {
        run_dir::start(cfg, log)?;
    }
    let trainee = recipe.prepare(cfg, comm.as_deref(), rank, world, log)?;
    let ad = device.clone().autodiff();
    // ZeRO stage 3: a rank other than 0 takes its segments of rank 0's values
    // (`start_sharding`), and a resumed run's values come from its checkpoint, so the values
    // of a fresh initialisation would never be read: such a model is built without them
    // (Burn's lazy parameters, never initialised; PyTorch FSDP's `sync_module_states` from a
    // rank-0 model, the others on the meta device, does the same).
    let hollow = cfg.exchange.zero == 3 && world > 1 && (rank != 0 || cfg.checkpoint.resume);
    // Rank 0's own values, under stage 3, are drawn as it hands them out a bucket at a time
    // (`start_sharding`), each tensor let go once its segments are out, so that no rank holds
    // the whole model (the seed lock held until then, so the values are `init`'s).
    let drawn_later = cfg.exchange.zero == 3 && world > 1 && !hollow;
    let (model, seed_guard) = match (hollow, drawn_later) {
        (true, _) => (trainee.skeleton(&ad)?, None),
        (false, true) => trainee.init_drawn_later(&ad, log)?,
        (false, false) => (trainee.init(&ad, log)?, None),
    };
    let batches = trainee.shard_batches().max(1);
    let rates = Rates::new(cfg, cfg.scaled_lr(log)?, batches)?;
    let epochs = Epochs::new(cfg, rank == 0);
    let mut s = Allreduce {
        cfg,
        objective: Objective::new(cfg, trainee.multi_label()),
        trainee,
        model: Some(model),
        seed_guard,
        resumed_values: None,
        optim: optimizer(cfg),
        rates,
        // The metrics' own tag space, exact: `--compression` is for gradients only (a bf16
        // sum of the epoch's losses would be off by a part in 256).
        metrics: comm.as_ref().map(|c| {
            Arc::new(
                c.sibling(burn_dist::wire::Kind::Metric)
                    .with_compression(burn_dist::Compression::None),
            )
        }),
        comm,
        rank,
        world,
        device: ad,
        plain_device: device.clone(),
        batches,
        steps: 0,
        images: 0,
        started,
        scaler: (cfg.compute.precision == Precision::Fp16).then(LossScaler::default),
        overflow_at: Faults::rank(rank, cfg.compute.precision).overflow_at(),
        epoch_skipped: 0,
        zero: None,
        params: None,
        gathers: None,
        fetch_order: Default::default(),
        kept_units: Default::default(),
        said_kept: false,
        exchange: Exchange::new(&cfg.exchange, ReduceOp::Mean),
        frozen: false,
        ema: None,
        step_log: None,
    };
    let first = s.resume(&epochs, log)?;
    s.start_sharding(first, log)?;
    epochs.check_left(first)?;
    s.steps = first * cfg.optimizer_steps(batches);
    s.step_log = StepLog::open(
        cfg.checkpoint.log_every,
        &cfg.run_dir,
        rank == 0,
        s.steps as u64,
        log,
    )?;
    if rank == 0 {
        log(&format!(
            "{}: {} rank(s), {batches} batches of {} per rank and epoch",
            if world > 1 {
                "data parallel"
            } else {
                "one process"
            },
            world,
            (cfg.batch_size / world).max(1)
        ));
    }
    let last = epochs.run(first, &mut s, log)?;
    s.finish(&epochs, last, log)
}

/// The strategy: this rank's model, optimizer and data, and its link to the others.
struct Allreduce<'a, T: Trainee> {
    cfg: &'a TrainConfig,
    trainee: T,
    objective: Objective,
    /// The model; taken out only while a step consumes it (the optimizer's step and ZeRO's
    /// update own it, so that the old values can go as the new ones are made instead of the
    /// step holding the parameters twice).
    model: Option<T::Model>,
    /// `--zero 3`, rank 0 of a fresh run: the seed lock, held from the model's seeding until
    /// its parameters are made as their segments are handed out (`start_sharding`), and the
    /// reads of a torchvision file to check then.
    seed_guard: Option<super::model::Drawing>,
    /// `--zero 3`, rank 0 of a resumed run: the checkpoint's trainable values, handed out a
    /// bucket at a time (`start_sharding`).
    resumed_values: Option<super::zero::CheckpointValues>,
    optim: ModuleOptimizer,
    rates: Rates,
    comm: Option<Arc<Communicator>>,
    /// The same ranks for metrics, sums and decisions, never compressed.
    metrics: Option<Arc<Communicator>>,
    rank: usize,
    world: usize,
    /// The autodiff view of the device (training) and the device itself (validation).
    device: Device,
    plain_device: Device,
    /// This rank's batches per epoch, optimizer steps taken in the whole run, and the images
    /// all ranks trained in this launch.
    batches: usize,
    steps: usize,
    images: usize,
    started: Instant,
    /// fp16's loss scale (`--precision fp16` with a module that computes in it), the same on
    /// every rank: the verdict is taken on the averaged gradients.
    scaler: Option<LossScaler>,
    overflow_at: Option<u64>,
    /// Steps of this epoch skipped for non-finite fp16 gradients.
    epoch_skipped: u64,
    /// `--zero`: this rank's shard of the optimizer (`self.optim` then never steps).
    zero: Option<ZeroOptimizer>,
    /// `--zero 3`: the model is a skeleton whose values `zero` holds; where each of its
    /// tensors sits, for gathering a unit.
    params: Option<ShardedParams>,
    /// `--zero 3 --overlap`: the communicator the step's thread gathers parameters over (a
    /// sibling of `comm`, whose reductions run on the exchange thread meanwhile).
    gathers: Option<Arc<Communicator>>,
    /// `--zero 3 --overlap`: the order the last step's backward fetched its buckets in, for
    /// the next step's thread that gathers them ahead.
    fetch_order: std::cell::RefCell<crate::pipeline::FetchOrder>,
    /// `--zero 3` without `--recompute`: the units the steps keep gathered between their
    /// passes, taken by the epoch's report (said once a run).
    kept_units: std::cell::Cell<Option<crate::pipeline::KeptUnits>>,
    said_kept: bool,
    /// The step's plan and exchange (the mean over the ranks), and the epoch's time in them.
    exchange: Exchange,
    /// Whether the model trains its head alone now (`--freeze-backbone`).
    frozen: bool,
    /// `optim.model_ema`: the weight average, the same on every rank (updated from the same
    /// weights), set by [`Self::resume`].
    ema: Option<Ema<T::Model>>,
    /// `checkpoint.log_every`: the step scalars, the job's sums, written by rank 0.
    step_log: Option<StepLog>,
}

/// The model missing: a step that owned it failed (its error came first).
fn lost_model() -> HearthError {
    HearthError::Training("the model was lost in a failed step".into())
}

impl<T: Trainee> Allreduce<'_, T> {
    fn model(&self) -> Result<&T::Model> {
        self.model.as_ref().ok_or_else(lost_model)
    }

    /// The model, out of `self` until a step or phase puts it back.
    fn take_model(&mut self) -> Result<T::Model> {
        self.model.take().ok_or_else(lost_model)
    }

    /// One optimizer step: its gradients unscaled (fp16), exchanged (what `overlapped` has
    /// not reduced during the backward yet, with it) and committed at the step's rate.
    fn apply(
        &mut self,
        epoch: usize,
        mut acc: GradientsAccumulator<T::Model>,
        overlapped: Option<OverlappedStep>,
        log: &mut dyn FnMut(&str),
    ) -> Result<()> {
        let mut grads = acc.grads();
        if let Some(s) = &self.scaler {
            // Unscaled before the exchange (an fp16 wire would overflow on scaled ones; what
            // went during the backward left unscaled).
            divide(self.model()?, &mut grads, s.scale());
        }
        let lr = self.rates.rate(epoch, self.steps);
        // The step owns the model: no other copy keeps the old values alive.
        let model = self.take_model()?;
        let update = Update {
            clip: self.cfg.optim.clip_grad,
            scaler: self.scaler.as_mut(),
        };
        self.steps += 1;
        if let (Some(z), Some(comm)) = (&mut self.zero, &self.comm) {
            // Exchange and update in one; with `--overlap` the gradients were reduced into
            // the shard's buckets during the backward.
            let grads = match overlapped {
                Some(o) => ShardedGrads::Reduced(
                    self.exchange
                        .reduce_sharded(&model, &mut grads, o, comm, log)?,
                ),
                None => grads.into(),
            };
            let (model, stepped) = self
                .exchange
                .timed(|| update.sharded(z, lr, model, grads, comm, Ok))?;
            self.model = Some(model);
            if stepped {
                self.average();
            } else {
                self.epoch_skipped += 1;
            }
            return Ok(());
        }
        if let Some(comm) = &self.comm {
            self.exchange
                .exchange(&model, &mut grads, comm, overlapped, log)?;
        }
        // Every rank holds the averaged gradients whole: its own verdict and norm are the job's.
        let (model, stepped) = update.apply(model, lr, grads, &mut self.optim, Ok, Ok)?;
        self.model = Some(model);
        if stepped {
            self.average();
        } else {
            self.epoch_skipped += 1;
        }
        Ok(())
    }

    /// `checkpoint.log_every`: the step just taken counted, its record written on every N-th
    /// (the sums over the ranks).
    fn log_step(&mut self, epoch: usize) -> Result<()> {
        let Some(l) = &mut self.step_log else {
            return Ok(());
        };
        let lr = self.rates.rate(epoch, self.steps - 1);
        let metrics = self.metrics.clone();
        l.stepped(self.steps as u64, lr, |s| match &metrics {
            Some(comm) => s.all_reduce(comm),
            None => Ok(s),
        })
    }

    /// `optim.model_ema`: the average follows a step that was taken (an fp16 step skipped for
    /// overflow changed no weight, and moves no average).
    fn average(&mut self) {
        if let (Some(e), Some(m)) = (&mut self.ema, &self.model) {
            e.update(m);
        }
    }

    /// The end: rank 0 exports the best epoch and plots; every rank gets the summary.
    fn finish(
        mut self,
        epochs: &Epochs,
        last: usize,
        log: &mut dyn FnMut(&str),
    ) -> Result<TrainReport> {
        // The training state goes before rank 0 builds the best epoch's model again to export
        // it: that model takes the memory the training's held, instead of adding to it
        // (measured: VGG-16's export raised rank 0's peak by 340 MB over the steps').
        self.model = None;
        self.zero = None;
        self.params = None;
        self.ema = None;
        self.optim = optimizer(self.cfg);
        if let Some(comm) = &self.comm {
            // Every rank is done with collectives before anyone hangs up.
            comm.barrier()?;
        }
        let best = epochs.best_or_err()?;
        let mut per_class_auroc = None;
        if self.rank == 0 {
            per_class_auroc = export_best(
                self.cfg,
                &self.trainee,
                best,
                &self.plain_device,
                &Default::default(),
                log,
            )?;
            epochs.plot(log);
        }
        let mut report = epochs.report(
            best,
            self.started,
            self.images,
            self.trainee.classes().to_vec(),
            self.rank,
            self.world,
        );
        report.epochs_run = last;
        report.per_class_auroc = per_class_auroc;
        // Every rank's skipped files, on rank 0.
        report.skipped = match &self.comm {
            Some(comm) => super::shared::gather_lines(comm, &self.trainee.skipped())?,
            None => self.trainee.skipped(),
        };
        Ok(report)
    }
}

impl<T: Trainee> Allreduce<'_, T> {
    /// The model in epoch `epoch`'s phase (`--freeze-backbone`: the head alone until
    /// `--unfreeze-after`); at the switch, `--zero`'s shards move over to the whole model.
    fn enter_phase(&mut self, epoch: usize, log: &mut dyn FnMut(&str)) -> Result<()> {
        let frozen = self.rates.frozen(epoch);
        if epoch > 1 && self.rates.frozen(epoch - 1) && !frozen {
            log(&self.rates.unfreeze_line(epoch - 1));
        }
        let model = self.take_model()?;
        self.model = Some(self.trainee.phase(model, frozen));
        // (A resume right at the switch started its shards over the whole model already.)
        let switch = std::mem::replace(&mut self.frozen, frozen) && !frozen;
        if let (true, Some(z), Some(comm)) = (switch, &self.zero, &self.comm) {
            let model = self.model.as_ref().ok_or_else(lost_model)?;
            let moved = super::zero::refit(self.cfg, z, model, self.batches, comm)?;
            self.zero = Some(moved);
        }
        Ok(())
    }

    /// Plan: `--overlap`'s exchange, installed on this thread so that the backward hands each
    /// unit's gradients over as soon as they exist (fp16's unscaled as they leave).
    fn begin_overlap(&self) -> Result<Option<OverlappedStep>> {
        let Some(comm) = &self.comm else {
            return Ok(None);
        };
        let scale = self.scaler.as_ref().map(|s| s.scale());
        Ok(match &self.zero {
            Some(z) => {
                let gathers = self.gathers.as_deref();
                self.exchange
                    .plan_sharded(comm, scale, z, self.model()?, gathers)?
            }
            None => self.exchange.plan(comm, scale)?,
        })
    }

    /// Stops every rank when one saw a loss that is not finite (fp16 aside, whose loss scale
    /// handles overflows): the error names the earliest such batch of the epoch over the ranks.
    /// (Data parallel learns of it at the epoch's end, so that no rank leaves the others
    /// waiting in a collective; one process stops at the batch itself.)
    fn check_diverged(&self, epoch: usize, diverged: Option<usize>) -> Result<()> {
        let step = match &self.metrics {
            Some(comm) => comm
                .all_gather(&[diverged.map_or(0.0, |s| s as f32)])?
                .into_iter()
                .filter(|&s| s > 0.0)
                .fold(None, |a: Option<f32>, s| Some(a.map_or(s, |a| a.min(s))))
                .map(|s| s as usize),
            None => diverged,
        };
        match step {
            Some(step) => Err(HearthError::NanLoss { epoch, step }),
            None => Ok(()),
        }
    }
}

impl<T: Trainee> super::epochs::Strategy for Allreduce<'_, T> {
    fn epoch(&mut self, epoch: usize, log: &mut dyn FnMut(&str)) -> Result<Option<Row>> {
        let t = Instant::now();
        self.enter_phase(epoch, log)?;
        let k = self.cfg.optim.grad_accum.unwrap_or(1).max(1);
        let mut train = Sums::default();
        // A multi-label epoch's outputs, for its `train_auroc`.
        let mut scores = self.trainee.multi_label().then(ValScores::default);
        let mut acc = GradientsAccumulator::<T::Model>::new();
        let mut pending = 0usize;
        let mut seen = 0usize;
        let mut progress = Progress::new(epoch, self.cfg.epochs, self.batches, self.rank == 0);
        let mut overlapped = None;
        let mut step_started = Instant::now();
        // The first batch of the epoch (from 1) whose loss was not finite on this rank.
        let mut diverged: Option<usize> = None;
        for (i, batch) in self
            .trainee
            .shard(epoch as u64 - 1, &self.device)
            .enumerate()
        {
            let (input, targets) = batch?;
            if pending == 0 {
                step_started = Instant::now();
                overlapped = self.begin_overlap()?;
            }
            // Random ops inside the model (dropout): per rank and batch.
            seed_stream(
                &self.device,
                self.cfg.seed,
                ((epoch - 1) * self.batches + i) as u64,
                self.rank,
            );
            // fp16: the loss times the scale (the gradients divided by it in `apply`).
            let factor = self
                .scaler
                .as_ref()
                .map_or(1.0, |s| s.loss_factor(self.overflow_at));
            let gathering = self.gathering();
            let (grads, sums) = self.objective.train_batch_gathered(
                self.model()?,
                input,
                &targets,
                factor,
                scores.as_mut(),
                gathering.as_ref(),
            )?;
            if !sums.loss.is_finite() && self.scaler.is_none() && diverged.is_none() {
                diverged = Some(i + 1);
                if self.comm.is_none() {
                    return Err(HearthError::NanLoss { epoch, step: i + 1 });
                }
            }
            train.add(sums);
            if let Some(l) = &mut self.step_log {
                l.add(epoch, sums);
            }
            acc.accumulate(self.model()?, grads);
            pending += 1;
            seen = i + 1;
            if pending == k || seen == self.batches {
                self.apply(
                    epoch,
                    std::mem::replace(&mut acc, GradientsAccumulator::new()),
                    overlapped.take(),
                    log,
                )?;
                pending = 0;
                self.exchange.stepped(step_started.elapsed());
                self.log_step(epoch)?;
            }
            progress.batch(seen, log);
        }
        self.report_exchange(epoch, log);
        self.check_diverged(epoch, diverged)?;
        if seen != self.batches {
            return Err(HearthError::Training(format!(
                "epoch {epoch}: the data gave {seen} batches on rank {}, {} were expected",
                self.rank, self.batches
            )));
        }
        let (train, train_auroc, per_rank) = self.gather_train(train, scores)?;
        self.images += train.samples as usize;
        let took = t.elapsed().as_secs_f64().max(1e-9);
        let mut row = self.validate_row(epoch, k, &train, took)?;
        if let Some(a) = train_auroc {
            row.insert("train_auroc".into(), a);
        }
        row.extend(per_rank);
        Ok(Some(row))
    }

    fn checkpoint(&mut self, epoch: usize, best: Option<usize>) -> Result<()> {
        self.save_checkpoint(epoch, best)
    }

    fn agree_stop(&mut self, stop: bool) -> Result<bool> {
        // Rank 0's table decides (the others' may lack the epochs before a resume).
        let Some(comm) = &self.metrics else {
            return Ok(stop);
        };
        let mut v = [f32::from(u8::from(self.rank == 0 && stop))];
        comm.allreduce(&mut v, ReduceOp::Sum)?;
        Ok(v[0] > 0.5)
    }

    fn decode_failures(&self) -> (usize, usize) {
        self.trainee.decode_failures()
    }
}
