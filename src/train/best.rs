//! The best epoch, Keras' `restore_best_weights` made to hold across resumes and phases.
//!
//! One rule ([`best_epoch`]: the monitored column of the run's epoch table, an improvement
//! counting only when larger than `min_delta`) drives all three decisions of every mode:
//! - which checkpoints stay (the best, for the export, and the last, for `--resume`);
//! - when early stopping ends the run ([`Patience`]);
//! - which epoch becomes `model.bpk`.
//!
//! The checkpoints themselves are written by [`super::checkpoint`].
//!
//! They read the [`EpochTable`], which holds every epoch of the run: a resumed run reloads the
//! earlier rows from `metrics.csv`, so the best epoch before a resume stays the best after it.

use std::collections::BTreeMap;

use super::{EpochTable, Monitor};

/// A metric as `metrics.csv` stores it (six decimals): how [`best_epoch`] compares values, so
/// that a resumed run, whose earlier epochs come back from that file, and an uninterrupted run,
/// which holds them at full precision, choose the same epoch. (They did not: two epochs at the
/// same accuracy tied in one run, while in the resumed one the later epoch's unrounded value
/// beat the earlier's rounded one by 3.5e-7 and was exported instead.)
fn as_stored(v: f64) -> f64 {
    (v * 1e6).round() / 1e6
}

/// The best epoch by the monitored metric, compared as `metrics.csv` stores it; an improvement
/// of `min_delta` or less does not count (the earlier epoch stays the best).
pub fn best_epoch(
    rows: &BTreeMap<usize, BTreeMap<String, f64>>,
    monitor: Monitor,
    min_delta: f64,
) -> Option<usize> {
    let key = monitor.column();
    let higher = monitor.higher_is_better();
    let mut best: Option<(usize, f64)> = None;
    for (&epoch, row) in rows {
        let Some(&v) = row.get(key) else { continue };
        if !v.is_finite() {
            continue;
        }
        let v = as_stored(v);
        let better = match best {
            None => true,
            Some((_, b)) if higher => v > b + min_delta,
            Some((_, b)) => v < b - min_delta,
        };
        if better {
            best = Some((epoch, v));
        }
    }
    best.map(|(e, _)| e)
}

/// How the best epoch is chosen: the table of all epochs, the column and the threshold.
#[derive(Clone)]
pub struct BestRule {
    pub table: EpochTable,
    pub monitor: Monitor,
    pub min_delta: f64,
}

impl BestRule {
    pub fn best(&self) -> Option<usize> {
        let rows = self.table.lock().ok()?;
        best_epoch(&rows, self.monitor, self.min_delta)
    }
}

/// Early stopping: stop once `patience` epochs have passed without an improvement of more than
/// `min_delta` over the best epoch so far (of the whole run), counting from `origin` at the
/// earliest (the first epoch of fine-tuning in a two-phase run, 0 otherwise).
#[derive(Clone)]
pub struct Patience {
    pub rule: BestRule,
    pub patience: usize,
    pub origin: usize,
}

impl Patience {
    /// Whether the run should end after `epoch`.
    pub fn exhausted(&self, epoch: usize) -> bool {
        let since = self.rule.best().unwrap_or(epoch).max(self.origin);
        epoch.saturating_sub(since) >= self.patience
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(values: &[(usize, f64)], column: &str) -> EpochTable {
        let rows = values
            .iter()
            .map(|&(e, v)| (e, BTreeMap::from([(column.to_string(), v)])))
            .collect();
        std::sync::Arc::new(std::sync::Mutex::new(rows))
    }

    fn rule(values: &[(usize, f64)], monitor: Monitor, min_delta: f64) -> BestRule {
        BestRule {
            table: table(values, monitor.column()),
            monitor,
            min_delta,
        }
    }

    #[test]
    fn a_tie_is_the_same_tie_whether_the_earlier_epoch_was_read_back_from_metrics_csv() {
        // 15/18 validation images: in memory, and as metrics.csv stores it ("83.333331").
        let in_memory = 15.0f32 as f64 / 18.0 * 100.0;
        let stored: f64 = format!("{in_memory:.6}").parse().unwrap();
        assert_ne!(stored, in_memory);
        assert!(in_memory > stored);
        for (earlier, later) in [(in_memory, in_memory), (stored, in_memory)] {
            let acc = [(1, 61.1), (2, earlier), (3, later)];
            assert_eq!(rule(&acc, Monitor::ValAccuracy, 0.0).best(), Some(2));
        }
        // A loss the file rounds up: the later epoch's unrounded value is below it.
        let loss = 0.123_456_6;
        let stored: f64 = format!("{loss:.6}").parse().unwrap();
        assert!(loss < stored);
        for (earlier, later) in [(loss, loss), (stored, loss)] {
            let rows = [(1, 0.9), (2, earlier), (3, later)];
            assert_eq!(rule(&rows, Monitor::ValLoss, 0.0).best(), Some(2));
        }
        // A real improvement still counts.
        let acc = [(1, 61.1), (2, 83.333331), (3, 83.333341)];
        assert_eq!(rule(&acc, Monitor::ValAccuracy, 0.0).best(), Some(3));
    }

    #[test]
    fn best_epoch_follows_direction_and_min_delta() {
        let acc = [(1, 50.0), (2, 60.0), (3, 60.5), (4, 59.0)];
        assert_eq!(rule(&acc, Monitor::ValAccuracy, 0.0).best(), Some(3));
        // 0.5 is not more than a min_delta of 1: epoch 2 stays the best.
        assert_eq!(rule(&acc, Monitor::ValAccuracy, 1.0).best(), Some(2));
        let loss = [(1, 1.0), (2, 0.5), (3, 0.7), (4, f64::NAN)];
        assert_eq!(rule(&loss, Monitor::ValLoss, 0.0).best(), Some(2));
        assert_eq!(rule(&[], Monitor::ValLoss, 0.0).best(), None);
    }

    #[test]
    fn patience_counts_from_the_best_epoch_and_the_origin() {
        let acc = [(1, 50.0), (2, 60.0), (3, 59.0), (4, 60.4)];
        let p = |min_delta, origin| Patience {
            rule: rule(&acc, Monitor::ValAccuracy, min_delta),
            patience: 2,
            origin,
        };
        assert!(!p(0.0, 0).exhausted(4), "epoch 4 is the best");
        assert!(p(1.0, 0).exhausted(4), "0.4 is below min_delta: best is 2");
        assert!(!p(1.0, 3).exhausted(4), "patience counts from epoch 3");
        assert!(p(1.0, 2).exhausted(4));
    }
}
