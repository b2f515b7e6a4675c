//! `checkpoint.log_every` in elastic training: every member knows each committed step's
//! loss, hits and samples over the world (the step's control allreduce), so the world's rank 0
//! writes the records alone. A new world (a member joined, left or was lost) opens the log
//! again on its rank 0, keeping the records of the committed steps; its first window starts
//! there. Rank 0 writes into its own run directory: where a new world's rank 0 runs on another
//! host, the records before it stay in the old host's file.

use super::step::Control;
use super::*;
use crate::train::objective::Sums;
use crate::train::step_log::StepLog;

impl<T: Trainee> ElasticRun<'_, T> {
    /// After committed step `commit.step` (from 1): the step's sums over the world counted,
    /// and on every N-th the record written by rank 0.
    pub(super) fn log_step(
        &mut self,
        world: &World,
        commit: &Commit<T::Model>,
        control: &Control,
        log: &mut dyn FnMut(&str),
    ) -> Result<()> {
        if self.cfg.checkpoint.log_every.is_none() {
            return Ok(());
        }
        if self
            .step_log
            .as_ref()
            .is_none_or(|(number, _)| *number != world.number)
        {
            let opened = StepLog::open(
                self.cfg.checkpoint.log_every,
                &self.cfg.run_dir,
                world.rank() == 0,
                commit.step.saturating_sub(1),
                log,
            )?;
            self.step_log = opened.map(|l| (world.number, l));
        }
        let Some((_, l)) = &mut self.step_log else {
            return Ok(());
        };
        // The step's rate, as `update` took it (before the step counted).
        let lr = self.rates.rate(
            commit.epoch as usize + 1,
            commit.step.saturating_sub(1) as usize,
        );
        l.add(
            commit.epoch as usize + 1,
            Sums {
                loss: control.loss(),
                hits: control.hits(),
                samples: f64::from(control.samples()),
                top5: control.top5(),
            },
        );
        l.stepped(commit.step, lr, Ok)
    }
}
