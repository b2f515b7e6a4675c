//! [`DdpStrategy`] as burn-train's supervised loop: every rank trains its part of each batch,
//! the gradients are averaged (or, with ZeRO, exchanged and applied in shards) before each
//! step, rank 0's batch-norm statistics go to every rank before validation, and only rank 0
//! writes checkpoints. Every rank sees the same validation metrics, so early stopping stops
//! them together.

use std::time::{Duration, Instant};

use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::train::{
    EventProcessorTraining, Interrupter, Learner, LearnerEvent, LearnerModel, LearningCheckpointer,
    SupervisedLearningStrategy, SupervisedTrainingEventProcessor, TrainLoader, TrainingComponents,
    TrainingItem, ValidLoader,
};

use super::{DdpStrategy, broadcast_module, exchange_report};
use crate::Result;
use crate::collective::ReduceOp;
use crate::overlap::OverlappedStep;
use crate::zero::ZeroOptimizer;
use crate::zero::module::{save_sharded_state, sharded_step};

impl<M: LearnerModel> SupervisedLearningStrategy<M> for DdpStrategy {
    fn fit(
        &self,
        training_components: TrainingComponents<M>,
        learner: Learner<M>,
        dataloader_train: TrainLoader<M>,
        dataloader_valid: ValidLoader<M>,
        starting_epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        let mut fit = Fit {
            strategy: self,
            learner,
            events: training_components.event_processor,
            interrupter: training_components.interrupter.clone(),
            grad_accumulation: training_components.grad_accumulation,
            zero: None,
        };
        // Rank 0 alone writes checkpoints.
        let mut checkpointer: Option<LearningCheckpointer<M>> = if self.comm.rank() == 0 {
            training_components.checkpointer
        } else {
            None
        };
        let mut early_stopping = training_components.early_stopping;
        if let Err(e) = fit.prepare(starting_epoch) {
            DdpStrategy::fail(&fit.interrupter, e);
            return fit.end();
        }
        for epoch in starting_epoch..=training_components.num_epochs {
            if !fit.train_split(&dataloader_train, epoch) || !fit.validate(&dataloader_valid, epoch)
            {
                break;
            }
            if let Some(c) = &mut checkpointer {
                c.checkpoint(&fit.learner, epoch, &training_components.event_store);
            }
            // Every rank sees the same validation metrics, so they stop together.
            if let Some(es) = &mut early_stopping
                && es.should_stop(epoch, &training_components.event_store)
            {
                break;
            }
        }
        fit.end()
    }
}

/// One data-parallel run of burn-train's loop on this rank: what its epochs carry along.
struct Fit<'a, M: LearnerModel> {
    strategy: &'a DdpStrategy,
    learner: Learner<M>,
    events: SupervisedTrainingEventProcessor<M>,
    interrupter: Interrupter,
    grad_accumulation: Option<usize>,
    /// The sharded optimizer, with ZeRO.
    zero: Option<ZeroOptimizer>,
}

/// A training split's time in steps and, of it, in the gradient exchange (rank 0 prints both).
#[derive(Default)]
struct SplitTimes {
    stepping: Duration,
    exchanging: Duration,
}

impl<M: LearnerModel> Fit<'_, M> {
    fn end(self) -> (M, SupervisedTrainingEventProcessor<M>) {
        (self.learner.model(), self.events)
    }

    /// The same starting point everywhere (rank 0's parameters and buffers), the overlap's
    /// settings checked, the sharded optimizer started (from its saved state on a resume).
    fn prepare(&mut self, starting_epoch: usize) -> Result<()> {
        let s = self.strategy;
        let m = broadcast_module(self.learner.model(), &s.comm)?;
        self.learner.load_model(m.into_record());
        s.check_overlap(self.grad_accumulation)?;
        self.zero = s.start_sharding(&self.learner.model(), starting_epoch)?;
        Ok(())
    }

    /// Epoch `epoch`'s training split; `false` when the run stops (interrupted or failed).
    fn train_split(&mut self, loader: &TrainLoader<M>, epoch: usize) -> bool {
        self.interrupter
            .fail_on_error(self.events.process_train(LearnerEvent::StartSplit {
                epoch_number: epoch,
                total_items: loader.num_items(),
            }));
        let mut iterator = loader.iter();
        let mut iteration = 0;
        let mut accumulator = GradientsAccumulator::new();
        let mut accumulated = 0;
        let mut times = SplitTimes::default();
        while let Some(item) = next_item(&mut *iterator, &self.interrupter) {
            iteration += 1;
            let progress = iterator.progress();
            let step_start = Instant::now();
            let overlapped = match self.begin_overlap() {
                Ok(o) => o,
                Err(e) => {
                    DdpStrategy::fail(&self.interrupter, e);
                    break;
                }
            };
            let out = self.learner.train_step(item);
            let step_grads = match self.grad_accumulation {
                Some(k) => {
                    accumulator.accumulate(&self.learner.model(), out.grads);
                    accumulated += 1;
                    if accumulated >= k || progress.is_completed() {
                        accumulated = 0;
                        Some(accumulator.grads())
                    } else {
                        None
                    }
                }
                None => Some(out.grads),
            };
            if let Some(grads) = step_grads {
                match self.exchange(grads, overlapped) {
                    Ok(took) => times.exchanging += took,
                    Err(e) => {
                        DdpStrategy::fail(&self.interrupter, e);
                        break;
                    }
                }
            }
            times.stepping += step_start.elapsed();
            let lr = Some(self.learner.lr_current());
            let item = TrainingItem::new(out.item, progress, Some(iteration), lr);
            self.interrupter
                .fail_on_error(self.events.process_train(LearnerEvent::ProcessedItem(item)));
            if self.interrupter.should_stop() {
                break;
            }
        }
        self.interrupter
            .fail_on_error(self.events.process_train(LearnerEvent::EndSplit(epoch)));
        let s = self.strategy;
        if s.comm.rank() == 0 && !times.stepping.is_zero() {
            let report = exchange_report(epoch, s.overlap, times.exchanging, times.stepping);
            eprintln!("{report}");
        }
        !self.interrupter.should_stop()
    }

    /// The exchange of this step's gradients started as the backward goes, when overlapping.
    fn begin_overlap(&self) -> Result<Option<OverlappedStep>> {
        let s = self.strategy;
        if !s.overlap {
            return Ok(None);
        }
        let comm = s.comm.clone();
        let compression = s.comm.compression();
        OverlappedStep::begin(comm, s.bucket_bytes, ReduceOp::Mean, compression, 1.0).map(Some)
    }

    /// Averages `grads` over the ranks and steps; returns the time the exchange took (with
    /// ZeRO, the sharded update is part of it).
    fn exchange(
        &mut self,
        grads: GradientsParams,
        overlapped: Option<OverlappedStep>,
    ) -> Result<Duration> {
        let s = self.strategy;
        let exchange_start = Instant::now();
        let Some(z) = self.zero.as_mut() else {
            return s.plain_step(&mut self.learner, grads, overlapped);
        };
        // ZeRO: exchange and update in one (the lr first: this step's rate).
        self.learner.lr_step();
        let lr = self.learner.lr_current().base();
        let mut take = |finite| s.guard.as_ref().is_none_or(|g| g.take_step(finite));
        let model = sharded_step(z, &self.learner.model(), grads, &s.comm, lr, &mut take)?;
        if let Some(m) = model {
            self.learner.load_model(m.into_record());
        }
        Ok(exchange_start.elapsed())
    }

    /// Rank 0's batch-norm statistics on every rank, epoch `epoch`'s validation split, the
    /// epoch's end, and with ZeRO the optimizer state saved; `false` when the run stops.
    fn validate(&mut self, loader: &ValidLoader<M>, epoch: usize) -> bool {
        let s = self.strategy;
        // Rank 0's batch-norm statistics everywhere, so every rank validates one model.
        match broadcast_module(self.learner.model(), &s.comm) {
            Ok(m) => self.learner.load_model(m.into_record()),
            Err(e) => {
                DdpStrategy::fail(&self.interrupter, e);
                return false;
            }
        }
        self.interrupter
            .fail_on_error(self.events.process_valid(LearnerEvent::StartSplit {
                epoch_number: epoch,
                total_items: loader.num_items(),
            }));
        let model = self.learner.model().valid();
        let mut iterator = loader.iter();
        let mut iteration = 0;
        while let Some(item) = next_item(&mut *iterator, &self.interrupter) {
            let progress = iterator.progress();
            iteration += 1;
            let out = burn::train::InferenceStep::step(&model, item);
            let item = TrainingItem::new(out, progress, Some(iteration), None);
            self.interrupter
                .fail_on_error(self.events.process_valid(LearnerEvent::ProcessedItem(item)));
            if self.interrupter.should_stop() {
                break;
            }
        }
        let i = &self.interrupter;
        i.fail_on_error(self.events.process_valid(LearnerEvent::EndSplit(epoch)));
        i.fail_on_error(self.events.process_train(LearnerEvent::EndEpoch(epoch)));
        i.fail_on_error(self.events.flush());
        if i.should_stop() {
            return false;
        }
        if let (Some(z), Some(sharding)) = (&self.zero, &s.sharding) {
            // Every rank hands its shard to rank 0, which writes the whole state before
            // burn-train's files of the epoch: a resume finds it for every complete one.
            let saved = save_sharded_state(z, &s.comm, sharding.store.as_ref(), epoch);
            if let Err(e) = saved {
                DdpStrategy::fail(&self.interrupter, e);
                return false;
            }
        }
        true
    }
}

/// The loader's next item; `None` at its end or on a loader error, which fails the run.
fn next_item<T, E, I>(iterator: &mut I, interrupter: &Interrupter) -> Option<T>
where
    I: Iterator<Item = std::result::Result<T, E>> + ?Sized,
    E: Into<burn::train::TrainingError>,
{
    match iterator.next()? {
        Ok(item) => Some(item),
        Err(err) => {
            interrupter.fail(err);
            None
        }
    }
}
