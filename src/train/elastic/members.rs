//! Elastic membership as a [`Strategy`] of the shared epoch loop: an epoch is the steps of the
//! current world, a change of membership wherever one is asked for or a step fails, and the
//! validation over whoever is a member at the epoch's end.
//!
//! A change hands every member the state of the lowest survivor, which may stand on either
//! side of an epoch's end that this member saw differently (a peer lost inside the validation
//! allreduce can leave one member past it and another before it). So an epoch call reports the
//! epoch it finished ([`Strategy::epoch_done`]): the one asked for, the one before it when the
//! state handed over had not validated that yet, and the table is the handed-over state's.

use super::*;
use crate::train::epochs::Strategy;

/// One elastic worker's part of the loop: its run, the current world and committed state.
pub(super) struct Members<'r, 'e, 'c, T: Trainee> {
    pub run: &'r mut ElasticRun<'c, T>,
    pub epochs: &'e Epochs<'c>,
    pub world: World,
    pub commit: Commit<T::Model>,
    /// The epoch the last [`Strategy::epoch`] call finished.
    pub done: usize,
}

impl<T: Trainee> Members<'_, '_, '_, T> {
    /// A change of membership after `interrupt`: this worker leaves (an error saying so), or
    /// forms the next world with the others and takes its rank 0's state.
    fn reform(&mut self, interrupt: Interrupt, log: &mut dyn FnMut(&str)) -> Result<()> {
        let world = &self.world;
        let me = &self.run.me.id;
        let names = |lost: &[usize]| {
            lost.iter()
                .map(|&r| world.members[r].id.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let (leaving, lost) = match interrupt {
            Interrupt::EpochEnd => return Ok(()),
            Interrupt::Planned { leaving } if leaving.contains(&world.rank()) => {
                (leaving, Vec::new())
            }
            Interrupt::Planned { leaving } => {
                // Every member that stays answers first: one that died after the step's
                // last collective is counted lost here, not waited for in the rendezvous.
                let lost = self.run.unanswered(world, &leaving);
                if !lost.is_empty() {
                    log(&format!(
                        "{me}: lost {} (no answer before the planned change after step {})",
                        names(&lost),
                        self.commit.step
                    ));
                }
                (leaving, lost)
            }
            Interrupt::Failed(reason) => {
                log(&format!(
                    "{me}: step {} failed: {reason}",
                    self.commit.step + 1
                ));
                let lost = self.run.unanswered(world, &[]);
                log(&format!("{me}: lost {}", names(&lost)));
                (Vec::new(), lost)
            }
        };
        if leaving.contains(&world.rank()) {
            if leaving.len() == world.size() {
                // --zero: every member hands its shard to rank 0's file first.
                self.run.save_shards(world, self.commit.step)?;
            }
            if leaving.len() == world.size() && world.rank() == 0 {
                let saved = self.run.save_state(&self.commit, world)?;
                log(&format!(
                    "every worker left: {} {} (`checkpoint.resume` continues it)",
                    if saved {
                        "state saved in"
                    } else {
                        "a later state kept in"
                    },
                    self.run.state_file().display()
                ));
            }
            self.run.join.set_role(Role::Busy);
            world.transport.shutdown(Duration::from_secs(5));
            return Err(HearthError::LeftJob {
                id: self.run.me.id.clone(),
                step: self.commit.step,
            });
        }
        let mine = self.commit.step;
        let (next, commit) = self
            .run
            .change(world, self.commit.clone(), &leaving, &lost, log)?;
        self.world.transport.shutdown(Duration::from_secs(1));
        self.world = next;
        self.commit = commit;
        if let Some(z) = self.run.zero.take() {
            // --zero: the optimizer state re-sharded over the new world.
            self.run.zero =
                Some(
                    self.run
                        .reshard(&self.world, &self.commit, Some((z, mine)), log)?,
                );
        }
        // The new rank 0 writes the files, from the table the state carries.
        self.epochs.set_writer(self.world.rank() == 0);
        self.epochs.set_gate(self.run.gate());
        self.epochs.set_rows(self.commit.rows.clone());
        Ok(())
    }
}

impl<T: Trainee> Strategy for Members<'_, '_, '_, T> {
    fn epoch(&mut self, epoch: usize, log: &mut dyn FnMut(&str)) -> Result<Option<Row>> {
        let rates = &self.run.rates;
        if epoch > 1 && rates.frozen(epoch - 1) && !rates.frozen(epoch) {
            log(&rates.unfreeze_line(epoch - 1));
        }
        loop {
            // The data epoch the committed state is in (from 1).
            let current = self.commit.epoch as usize + 1;
            if current > epoch {
                // A change handed over a state that had validated this epoch already.
                if self.world.rank() == 0 {
                    self.run.fenced()?;
                }
                self.done = epoch;
                return Ok(self.commit.rows.get(&epoch).cloned());
            }
            let interrupt = match self.run.steps(&mut self.world, &mut self.commit, log)? {
                Interrupt::EpochEnd => match self.run.validate(&self.world, &mut self.commit) {
                    Ok(row) => {
                        if self.world.rank() == 0 {
                            // The loop writes metrics.csv from this row next.
                            self.run.fenced()?;
                        }
                        self.done = current;
                        return Ok(Some(row));
                    }
                    Err(HearthError::Dist(e)) => Interrupt::Failed(e.to_string()),
                    Err(e) => return Err(e),
                },
                other => other,
            };
            self.reform(interrupt, log)?;
        }
    }

    fn epoch_done(&self, _asked: usize) -> usize {
        self.done
    }

    /// Commits the epoch's end (unless the state handed over had), then rank 0 writes the
    /// epoch's files and the whole state.
    fn checkpoint(&mut self, epoch: usize, best: Option<usize>) -> Result<()> {
        let c = &mut self.commit;
        if c.epoch as usize + 1 == epoch {
            // The next epoch's phase decides what trains.
            c.model = self.run.in_phase(c.model.clone(), epoch as u64);
            c.epoch += 1;
            c.position = 0;
            c.sums = [0.0; 4];
            c.train_scores = ValScores::default();
            c.epoch_skipped = 0;
            c.epoch_started = c.elapsed;
        }
        c.rows = self.epochs.rows();
        // --zero: every member streams its shard into rank 0's file of this step first.
        self.run.save_shards(&self.world, self.commit.step)?;
        if self.world.rank() == 0 {
            let t = Instant::now();
            self.run
                .checkpoint(&self.commit, &self.world, epoch, best)?;
            // The others wait in the next step's allreduce meanwhile; past the collective
            // timeout they count this worker as lost. Said, so that a slow disk is seen.
            let took = t.elapsed();
            if took > collective_timeout() / 4 {
                eprintln!(
                    "warning: writing epoch {epoch}'s checkpoint took {:.1} s while the other \
                     workers waited (they give up on this one after HEARTH_COLLECTIVE_TIMEOUT, \
                     {} s)",
                    took.as_secs_f64(),
                    collective_timeout().as_secs()
                );
            }
        }
        Ok(())
    }

    /// Every member holds the same table, so each takes the same decision.
    fn agree_stop(&mut self, stop: bool) -> Result<bool> {
        self.commit.finished = stop;
        Ok(stop)
    }

    fn decode_failures(&self) -> (usize, usize) {
        self.run.trainee.decode_failures()
    }
}

impl<T: Trainee> ElasticRun<'_, T> {
    /// The run's epochs on the shared loop ([`Epochs::run`]), membership changes inside them,
    /// then the end of the run.
    pub(super) fn train(
        mut self,
        world: World,
        commit: Commit<T::Model>,
        log: &mut dyn FnMut(&str),
    ) -> Result<TrainReport> {
        if self.trainee.train_len() == 0 {
            return Err(HearthError::InvalidArgument(
                "the training set is empty".into(),
            ));
        }
        let epochs = Epochs::new(self.cfg, world.rank() == 0);
        epochs.set_gate(self.gate());
        epochs.set_rows(commit.rows.clone());
        let first = commit.epoch as usize;
        let mut members = Members {
            run: &mut self,
            epochs: &epochs,
            world,
            commit,
            done: first,
        };
        epochs.run(first, &mut members, log)?;
        let Members { world, commit, .. } = members;
        self.finish(world, commit, log)
    }
}
