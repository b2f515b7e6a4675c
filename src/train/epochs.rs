//! The one epoch loop of every training mode: one process and data parallel (allreduce),
//! elastic membership, parameter servers and pipeline stages, for Hearth's models and a user's
//! own module alike.
//!
//! A mode is a [`Strategy`]: how an epoch trains and validates on this rank, how its state is
//! saved, and how the ranks agree to stop. [`Epochs::run`] owns the rest, once for all of them:
//! the epoch range (a resume's start, `--stop-after-epoch`), the table of every epoch's metrics
//! (reloaded from `metrics.csv` on resume), `metrics.csv` and the console line (the same line
//! in every mode), the best-epoch rule handed to checkpoints, early stopping
//! (`--patience`, `--min-delta`, counted from the fine-tuning phase when there is one), the
//! plot and the summary ([`TrainReport`]).

use std::time::Instant;

use super::best::{BestRule, Patience, best_epoch};
use super::logger::{EpochTable, epoch_line, metrics_csv};
use super::{EpochRows, TrainConfig, TrainReport, run_dir};
use crate::{HearthError, Result};

/// One row of `metrics.csv`: column -> value.
pub(super) type Row = std::collections::BTreeMap<String, f64>;

/// A training mode's part of the epoch loop.
pub(super) trait Strategy {
    /// Trains epoch `epoch` (counted from 1) and validates it. Returns the epoch's row of
    /// `metrics.csv` on the ranks that know it (every rank, or only the lead), else `None`.
    fn epoch(&mut self, epoch: usize, log: &mut dyn FnMut(&str)) -> Result<Option<Row>>;

    /// Saves what `--resume` needs after `epoch`, keeping the files of the best epoch so far
    /// (`best`, on the ranks that hold the table) and of the last.
    fn checkpoint(&mut self, epoch: usize, best: Option<usize>) -> Result<()>;

    /// Every rank's decision to stop after an epoch, from `stop` as the ranks holding the table
    /// decided it (ranks without it learn the decision from those with it). The default suits
    /// modes where every rank holds the same table.
    fn agree_stop(&mut self, stop: bool) -> Result<bool> {
        Ok(stop)
    }

    /// Images that failed to decode so far on this rank, (training, validation): each
    /// epoch's difference goes into its row (`train_skipped_images`, `val_skipped_images`)
    /// and its console line.
    fn decode_failures(&self) -> (usize, usize) {
        (0, 0)
    }

    /// The epoch the last [`Self::epoch`] call finished when it was asked for `asked`. Modes
    /// whose ranks always agree finish the one asked for; elastic membership can hand a rank
    /// the state of another that had not validated the epoch before it yet, which is then
    /// the one finished (recorded again, and the loop goes on after it).
    fn epoch_done(&self, asked: usize) -> usize {
        asked
    }
}

/// The epochs of one run: the table of their metrics and the decisions read from it.
pub(super) struct Epochs<'a> {
    cfg: &'a TrainConfig,
    table: EpochTable,
    /// Whether this rank writes `metrics.csv` and prints the epoch lines (elastic membership
    /// moves it to a new rank 0).
    writer: std::cell::Cell<bool>,
    /// How `metrics.csv` lands (an elastic rank 0's: under the run directory's fence).
    gate: std::cell::RefCell<super::gate::Gate>,
    /// The epoch patience counts from at the earliest (the fine-tuning phase's start).
    patience_origin: usize,
}

impl<'a> Epochs<'a> {
    pub fn new(cfg: &'a TrainConfig, writer: bool) -> Self {
        Self {
            cfg,
            table: EpochTable::default(),
            writer: std::cell::Cell::new(writer),
            gate: Default::default(),
            patience_origin: cfg
                .model
                .unfreeze_after
                .filter(|_| cfg.model.freeze_backbone)
                .unwrap_or(0),
        }
    }

    /// The last epoch this launch trains (`--stop-after-epoch`, else `--epochs`).
    pub fn end(&self) -> usize {
        self.cfg
            .checkpoint
            .stop_after_epoch
            .unwrap_or(self.cfg.epochs)
            .min(self.cfg.epochs)
    }

    /// Fails when a resume after `done` epochs has nothing left to train.
    pub fn check_left(&self, done: usize) -> Result<()> {
        if done >= self.end() {
            return Err(HearthError::InvalidArgument(format!(
                "{} has already finished epoch {done} of {}; nothing left to train",
                self.cfg.run_dir.display(),
                self.cfg.epochs
            )));
        }
        Ok(())
    }

    /// `--resume` after `epoch`: the earlier epochs' rows from the run's `metrics.csv`.
    pub fn reload(&self, epoch: usize) -> Result<()> {
        run_dir::reload_table(&self.cfg.run_dir.join("metrics.csv"), &self.table, epoch)
    }

    /// Makes this rank the one that writes (or not).
    pub fn set_writer(&self, writer: bool) {
        self.writer.set(writer);
    }

    /// Makes `metrics.csv` land through `gate`.
    pub fn set_gate(&self, gate: super::gate::Gate) {
        *self.gate.borrow_mut() = gate;
    }

    /// Replaces the table (a state that carries its rows, as an elastic commit does).
    pub fn set_rows(&self, rows: EpochRows) {
        if let Ok(mut t) = self.table.lock() {
            *t = rows;
        }
    }

    pub fn rows(&self) -> EpochRows {
        self.table.lock().map(|t| t.clone()).unwrap_or_default()
    }

    /// Edits every row (columns known only at the end, as every worker's curves).
    pub fn update_rows(&self, f: impl FnOnce(&mut EpochRows)) {
        if let Ok(mut t) = self.table.lock() {
            f(&mut t);
        }
    }

    pub fn rule(&self) -> BestRule {
        BestRule {
            table: self.table.clone(),
            monitor: self.cfg.checkpoint.monitor,
            min_delta: self.cfg.checkpoint.min_delta,
        }
    }

    /// The best epoch so far, if any has a finite monitored value.
    pub fn best(&self) -> Option<usize> {
        self.rule().best()
    }

    /// Records `epoch`'s row: the table, `metrics.csv` and the console line (on the writer).
    pub fn record(&self, epoch: usize, row: Row, log: &mut dyn FnMut(&str)) -> Result<()> {
        if let Ok(mut t) = self.table.lock() {
            t.insert(epoch, row.clone());
        }
        if self.writer.get() {
            self.write_csv()?;
            log(&epoch_line(epoch, Some(self.cfg.epochs), &row));
        }
        Ok(())
    }

    /// Writes `metrics.csv` and the TensorBoard event file of the same rows (on the writer).
    pub fn write_csv(&self) -> Result<()> {
        if !self.writer.get() {
            return Ok(());
        }
        let rows = self.rows();
        let gate = self.gate.borrow();
        gate.write(
            &self.cfg.run_dir.join("metrics.csv"),
            metrics_csv(&rows).as_bytes(),
        )?;
        crate::tensorboard::write_run(&self.cfg.run_dir, &rows, |path, bytes| {
            gate.write(path, bytes)
        })
    }

    /// Whether early stopping ends the run after `epoch` (said in `log`): `--patience` epochs
    /// without an improvement of more than `--min-delta`. Never after the last epoch.
    pub fn stop_early(&self, epoch: usize, log: &mut dyn FnMut(&str)) -> bool {
        let Some(patience) = self.cfg.checkpoint.patience else {
            return false;
        };
        let stop = epoch < self.end()
            && Patience {
                rule: self.rule(),
                patience,
                origin: self.patience_origin,
            }
            .exhausted(epoch);
        if stop && self.writer.get() {
            log(&format!(
                "early stopping after epoch {epoch}: no improvement of {} in {patience} epochs",
                self.cfg.checkpoint.monitor.column()
            ));
        }
        stop
    }

    /// Runs epochs `first + 1 ..= end` of `strategy`, recording each, until the end or early
    /// stopping. Returns the last epoch trained.
    pub fn run(
        &self,
        first: usize,
        strategy: &mut dyn Strategy,
        log: &mut dyn FnMut(&str),
    ) -> Result<usize> {
        let end = self.end();
        // Every mode's start ends here: its memory so far is the start's (`hearth train` prints
        // it at the end).
        crate::alloc::start_done();
        let mut seen = strategy.decode_failures();
        let mut epoch = first + 1;
        while epoch <= end {
            let row = strategy.epoch(epoch, log)?;
            let done = strategy.epoch_done(epoch);
            let now = strategy.decode_failures();
            if let Some(mut row) = row {
                row.insert(
                    "train_skipped_images".into(),
                    now.0.saturating_sub(seen.0) as f64,
                );
                row.insert(
                    "val_skipped_images".into(),
                    now.1.saturating_sub(seen.1) as f64,
                );
                self.record(done, row, log)?;
            }
            seen = now;
            strategy.checkpoint(done, self.best())?;
            if done < end {
                let stop = self.stop_early(done, log);
                if strategy.agree_stop(stop)? {
                    return Ok(done);
                }
            }
            epoch = done + 1;
        }
        Ok(end)
    }

    /// The epoch to export, or an error naming the monitored column none of them has.
    pub fn best_or_err(&self) -> Result<usize> {
        best_epoch(
            &self.rows(),
            self.cfg.checkpoint.monitor,
            self.cfg.checkpoint.min_delta,
        )
        .ok_or_else(|| {
            HearthError::Training(format!(
                "no epoch has a {} value to pick the best one by",
                self.cfg.checkpoint.monitor.column()
            ))
        })
    }

    /// `metrics.png` of the table (a warning when it cannot be drawn); nothing without the
    /// `plots` feature.
    pub fn plot(&self, log: &mut dyn FnMut(&str)) {
        #[cfg(not(feature = "plots"))]
        let _ = log;
        #[cfg(feature = "plots")]
        if let Err(e) =
            crate::plot::plot_metrics(&self.rows(), &self.cfg.run_dir.join("metrics.png"))
        {
            log(&format!("warning: no plot written: {e}"));
        }
    }

    /// The run's summary: best epoch `best`, `images` trained since `started`, on `rank` of
    /// `world`.
    pub fn report(
        &self,
        best: usize,
        started: Instant,
        images: usize,
        classes: Vec<String>,
        rank: usize,
        world: usize,
    ) -> TrainReport {
        let mut r = TrainReport::summarise(self.cfg, &self.rows(), best, started, images, classes);
        r.rank = rank;
        r.set_world(world, self.cfg.price_per_hour);
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A strategy whose validation accuracy follows a script; it records what the loop asked.
    struct Scripted {
        accuracy: Vec<f64>,
        saved: Vec<(usize, Option<usize>)>,
    }

    impl Strategy for Scripted {
        fn epoch(&mut self, epoch: usize, _: &mut dyn FnMut(&str)) -> Result<Option<Row>> {
            Ok(Some(
                [
                    ("val_accuracy".to_string(), self.accuracy[epoch - 1]),
                    ("train_loss".to_string(), 1.0),
                ]
                .into_iter()
                .collect(),
            ))
        }
        fn checkpoint(&mut self, epoch: usize, best: Option<usize>) -> Result<()> {
            self.saved.push((epoch, best));
            Ok(())
        }
    }

    fn config(dir: &std::path::Path) -> TrainConfig {
        let mut cfg = TrainConfig::new(dir.to_path_buf());
        cfg.epochs = 8;
        cfg.checkpoint.patience = Some(2);
        cfg
    }

    #[test]
    fn patience_stops_the_loop_and_the_best_epoch_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path());
        let epochs = Epochs::new(&cfg, true);
        let mut s = Scripted {
            accuracy: vec![50.0, 60.0, 59.0, 58.0, 90.0, 90.0, 90.0, 90.0],
            saved: Vec::new(),
        };
        let mut lines = Vec::new();
        let last = epochs
            .run(0, &mut s, &mut |l| lines.push(l.to_string()))
            .unwrap();
        assert_eq!(last, 4, "two epochs without improvement after epoch 2");
        assert_eq!(
            s.saved,
            vec![(1, Some(1)), (2, Some(2)), (3, Some(2)), (4, Some(2))]
        );
        assert_eq!(epochs.best_or_err().unwrap(), 2);
        assert!(
            lines.iter().any(|l| l.starts_with("epoch 3/8: ")),
            "{lines:?}"
        );
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("early stopping after epoch 4"))
        );
        let csv = std::fs::read_to_string(dir.path().join("metrics.csv")).unwrap();
        assert_eq!(csv.lines().count(), 5, "{csv}");
    }

    #[test]
    fn patience_counts_from_the_fine_tuning_phase() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = config(dir.path());
        cfg.model.freeze_backbone = true;
        cfg.model.unfreeze_after = Some(4);
        let epochs = Epochs::new(&cfg, true);
        let mut s = Scripted {
            accuracy: vec![60.0, 50.0, 50.0, 50.0, 50.0, 50.0, 50.0, 50.0],
            saved: Vec::new(),
        };
        let last = epochs.run(0, &mut s, &mut |_| {}).unwrap();
        assert_eq!(
            last, 6,
            "patience 2 counted from epoch 4, not from the best (1)"
        );
    }

    #[test]
    fn a_resume_past_the_end_is_refused_and_no_value_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = config(dir.path());
        cfg.checkpoint.stop_after_epoch = Some(3);
        let epochs = Epochs::new(&cfg, false);
        assert_eq!(epochs.end(), 3);
        let e = epochs.check_left(3).unwrap_err().to_string();
        assert!(e.contains("nothing left to train"), "{e}");
        epochs.check_left(2).unwrap();
        let e = epochs.best_or_err().unwrap_err().to_string();
        assert!(e.contains("val_accuracy"), "{e}");
        // Not the writer: no file.
        epochs.record(1, Row::new(), &mut |_| {}).unwrap();
        assert!(!dir.path().join("metrics.csv").exists());
    }

    /// A strategy that, once, finishes the epoch before the one asked for (an elastic member
    /// handed a state that had not validated it yet) with a different value.
    struct Behind {
        inner: Scripted,
        asked: Vec<usize>,
        done: usize,
        rewound: bool,
    }

    impl Strategy for Behind {
        fn epoch(&mut self, epoch: usize, log: &mut dyn FnMut(&str)) -> Result<Option<Row>> {
            self.asked.push(epoch);
            self.done = epoch;
            if epoch == 3 && !self.rewound {
                self.rewound = true;
                self.done = 2;
                self.inner.accuracy[1] = 65.0;
            }
            self.inner.epoch(self.done, log)
        }
        fn epoch_done(&self, _: usize) -> usize {
            self.done
        }
        fn checkpoint(&mut self, epoch: usize, best: Option<usize>) -> Result<()> {
            self.inner.checkpoint(epoch, best)
        }
    }

    #[test]
    fn an_epoch_finished_again_is_recorded_again_and_the_loop_goes_on_after_it() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = config(dir.path());
        cfg.epochs = 4;
        let epochs = Epochs::new(&cfg, true);
        let mut s = Behind {
            inner: Scripted {
                accuracy: vec![50.0, 60.0, 55.0, 70.0],
                saved: Vec::new(),
            },
            asked: Vec::new(),
            done: 0,
            rewound: false,
        };
        assert_eq!(epochs.run(0, &mut s, &mut |_| {}).unwrap(), 4);
        assert_eq!(s.asked, vec![1, 2, 3, 3, 4]);
        assert_eq!(
            s.inner.saved,
            vec![
                (1, Some(1)),
                (2, Some(2)),
                (2, Some(2)),
                (3, Some(2)),
                (4, Some(4))
            ]
        );
        assert_eq!(
            epochs.rows()[&2]["val_accuracy"],
            65.0,
            "the row finished last"
        );
        let csv = std::fs::read_to_string(dir.path().join("metrics.csv")).unwrap();
        assert_eq!(csv.lines().count(), 5, "{csv}");
    }

    #[test]
    fn the_cost_prices_every_process_of_the_job_not_rank_0s_clock() {
        // Issue 55: --price-per-hour priced rank 0's wall clock alone.
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = config(dir.path());
        cfg.price_per_hour = Some(3.0);
        let epochs = Epochs::new(&cfg, true);
        let started = Instant::now() - std::time::Duration::from_secs(36);
        let one = epochs.report(0, started, 10, Vec::new(), 0, 1);
        let four = epochs.report(0, started, 10, Vec::new(), 0, 4);
        for r in [&one, &four] {
            let hours = r.wall_seconds * r.world as f64 / 3600.0;
            assert!(
                (r.node_hours - hours).abs() < 1e-12,
                "{} {hours}",
                r.node_hours
            );
            assert_eq!(r.cost, Some(3.0 * r.node_hours));
        }
        assert!(
            four.node_hours > 3.9 * one.node_hours,
            "{} {}",
            four.node_hours,
            one.node_hours
        );
        // An elastic job's worker-seconds, whatever its last world.
        let mut elastic = four;
        elastic.price_process_seconds(7200.0, cfg.price_per_hour);
        assert_eq!((elastic.node_hours, elastic.cost), (2.0, Some(6.0)));
    }
}
