//! A burn-train `MetricLogger` that keeps every numeric entry in memory (burn-train reads them
//! back for early stopping and best-epoch checkpoints) and writes `metrics.csv` after every
//! validation epoch: one row per epoch, a header naming each column (`epoch`, then
//! [`SHARED_COLUMNS`], the same in every mode, then what only some runs have).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use burn::train::logger::MetricLogger;
use burn::train::metric::store::{EpochSummary, MetricsUpdate, Split};
use burn::train::metric::{MetricDefinition, MetricId, NumericEntry};

/// Per-epoch values by column name, shared with the caller.
pub type EpochTable = Arc<Mutex<BTreeMap<usize, BTreeMap<String, f64>>>>;

/// Where one-line epoch summaries go.
pub type Report = Box<dyn Fn(&str) + Send>;

/// The first (epoch, step) whose training loss was not finite.
pub type NonFinite = Arc<Mutex<Option<(usize, usize)>>>;

pub struct CsvMetricLogger {
    report: Option<Report>,
    /// The run's epochs, for the `epoch e/E` of the summary line.
    epochs: Option<usize>,
    /// Distributed runs: averages training metrics across ranks and keeps each rank's curve.
    ranks: Option<std::sync::Arc<burn_dist::Communicator>>,
    /// Whether this process writes `metrics.csv` (rank 0 only in a distributed run).
    write: bool,
    /// Stops the run on a NaN or infinite training loss.
    guard: Option<(NonFinite, burn::train::Interrupter)>,
    /// `train_lr` of an epoch from the schedule, as every mode writes it.
    epoch_lr: Option<EpochLr>,
    train_steps: HashMap<usize, usize>,
    names: HashMap<MetricId, String>,
    entries: HashMap<(String, usize, bool), Vec<NumericEntry>>,
    table: EpochTable,
    csv: PathBuf,
    /// When the run started: each validated epoch's `elapsed_seconds` counts from it.
    started: Instant,
}

/// An epoch's `train_lr` (epoch from 1).
pub type EpochLr = Box<dyn Fn(usize) -> f64 + Send>;

fn slug(name: &str) -> String {
    let lower = name.to_ascii_lowercase();
    if lower.contains("top") && lower.contains("acc") {
        "top5_accuracy".into()
    } else if lower.contains("acc") || lower.starts_with("hamming score") {
        // A multi-label run's per-label accuracy is its accuracy column.
        "accuracy".into()
    } else if lower.starts_with("auroc") {
        "auroc".into()
    } else if lower.starts_with("images/s") {
        "images_per_sec".into()
    } else if lower.contains("loss") {
        "loss".into()
    } else if lower.contains("learning rate") || lower == "lr" {
        "lr".into()
    } else {
        lower
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect::<String>()
            .trim_matches('_')
            .to_string()
    }
}

/// How many samples an epoch's entries cover: the batch sizes of its per-batch entries (1 for a
/// plain value). burn-train closes every epoch with a final entry (the sample-weighted value),
/// which adds no samples; an epoch with a final entry alone counts 1, unless that value is not
/// a number: burn-train closes an epoch without batches (a rank whose validation shard is empty,
/// with fewer images than ranks) with the NaN of an empty mean, which counts 0.
pub fn epoch_count(entries: &[NumericEntry]) -> usize {
    let (mut n, mut last) = (0usize, None);
    for e in entries {
        match e {
            NumericEntry::Aggregated { count, .. } => n += *count,
            NumericEntry::Value(_) => n += 1,
            NumericEntry::Final(v) => last = Some(*v),
        }
    }
    match last {
        Some(v) if n == 0 => usize::from(v.is_finite()),
        _ => n,
    }
}

/// The value of an epoch from its entries: the final value when logged, else the mean weighted
/// by batch size.
pub fn epoch_value(entries: &[NumericEntry]) -> Option<f64> {
    if let Some(NumericEntry::Final(v)) = entries
        .iter()
        .rev()
        .find(|e| matches!(e, NumericEntry::Final(_)))
    {
        return Some(*v);
    }
    let (mut sum, mut n) = (0.0, 0usize);
    for e in entries {
        match e {
            NumericEntry::Value(v) => {
                sum += v;
                n += 1;
            }
            NumericEntry::Aggregated {
                aggregated_value,
                count,
            } => {
                sum += aggregated_value * *count as f64;
                n += count;
            }
            NumericEntry::Final(_) => {}
        }
    }
    (n > 0).then(|| sum / n as f64)
}

impl CsvMetricLogger {
    pub fn new(csv: PathBuf, table: EpochTable) -> Self {
        Self {
            report: None,
            epochs: None,
            ranks: None,
            write: true,
            guard: None,
            epoch_lr: None,
            train_steps: HashMap::new(),
            names: HashMap::new(),
            entries: HashMap::new(),
            table,
            csv,
            started: Instant::now(),
        }
    }

    /// Counts `elapsed_seconds` from `started` (the run's start, not this phase's).
    pub fn with_started(mut self, started: Instant) -> Self {
        self.started = started;
        self
    }

    /// Fails the run through `interrupter` at the first non-finite training loss, recording
    /// where in `seen`.
    pub fn with_nan_guard(
        mut self,
        seen: NonFinite,
        interrupter: burn::train::Interrupter,
    ) -> Self {
        self.guard = Some((seen, interrupter));
        self
    }

    /// Averages each epoch's metrics over the ranks of `comm` (images/s is summed: the job's
    /// throughput), for the CSV and for burn-train's early stopping and checkpoint decisions, and
    /// records every rank's `train_loss_rank{r}` and `train_accuracy_rank{r}`. Every rank must
    /// log the same metrics.
    pub fn with_rank_averaging(mut self, comm: std::sync::Arc<burn_dist::Communicator>) -> Self {
        self.write = comm.rank() == 0;
        self.ranks = Some(comm);
        self
    }

    /// Writes `train_lr` from the schedule (`lr(epoch)`) instead of burn-train's rate metric.
    /// Both are the mean over the epoch's batches of the latest step's rate, except where
    /// burn-train has not stepped yet in this launch: a resumed run's, or a fine-tuning
    /// phase's, first batches with `--grad-accum` show its initial rate of 0 there, where the
    /// run's previous step had a rate.
    pub fn with_epoch_lr(mut self, lr: EpochLr) -> Self {
        self.epoch_lr = Some(lr);
        self
    }

    /// Sends a one-line summary of every validated epoch of `epochs` to `report` (the epoch
    /// line every mode prints).
    pub fn with_report(mut self, report: Report, epochs: usize) -> Self {
        self.report = Some(report);
        self.epochs = Some(epochs);
        self
    }

    fn summary_line(&self, epoch: usize) -> Option<String> {
        let table = self.table.lock().ok()?;
        Some(epoch_line(epoch, self.epochs, table.get(&epoch)?))
    }

    fn write_csv(&self) {
        let Ok(table) = self.table.lock() else { return };
        let out = metrics_csv(&table);
        let tmp = self.csv.with_extension("csv.tmp");
        if std::fs::write(&tmp, out).is_ok() {
            let _ = std::fs::rename(&tmp, &self.csv);
        }
    }
}

/// The console line of a finished epoch, the same in every mode: `epoch e/E: train loss .. acc
/// ..% | val loss .. acc ..%`, then what the row has of AUROC, learning rate, throughput and
/// world size.
pub fn epoch_line(epoch: usize, epochs: Option<usize>, row: &BTreeMap<String, f64>) -> String {
    let get = |k: &str| row.get(k).map_or("-".into(), |v| format!("{v:.4}"));
    let pct = |k: &str| row.get(k).map_or("-".into(), |v| format!("{v:.2}%"));
    let mut line = format!(
        "epoch {epoch}{}: train loss {} acc {} | val loss {} acc {}",
        epochs.map(|n| format!("/{n}")).unwrap_or_default(),
        get("train_loss"),
        pct("train_accuracy"),
        get("val_loss"),
        pct("val_accuracy"),
    );
    if let Some(v) = row.get("val_auroc") {
        line.push_str(&format!(" auroc {v:.2}"));
    }
    if let Some(v) = row.get("train_lr") {
        line.push_str(&format!(" | lr {v:.5}"));
    }
    if let Some(v) = row.get("world_size") {
        line.push_str(&format!(" | world {v:.1}"));
    }
    if let Some(v) = row.get("train_images_per_sec") {
        line.push_str(&format!(" | {v:.0} img/s"));
    }
    // Images that failed to decode this epoch (skipped, never a tensor of garbage).
    let skipped: f64 = ["train_skipped_images", "val_skipped_images"]
        .iter()
        .filter_map(|k| row.get(*k))
        .sum();
    if skipped > 0.0 {
        line.push_str(&format!(" | skipped {skipped:.0} unreadable image(s)"));
    }
    line
}

/// The columns of `metrics.csv` that every mode writes, in this order, right after `epoch`
/// (a cell stays empty where an epoch has no value: a resumed run's rows from an older
/// build, a parameter-server lead's rows before the workers' figures arrive at the end).
pub const SHARED_COLUMNS: [&str; 9] = [
    "train_loss",
    "train_accuracy",
    "val_loss",
    "val_accuracy",
    "train_lr",
    "train_images_per_sec",
    "elapsed_seconds",
    "train_skipped_images",
    "val_skipped_images",
];

/// Where `column` goes in `metrics.csv`: the shared columns in their order, then what only
/// some runs have (top-5 accuracy, AUROC, world size, server version, ...) in name order, then
/// the per-rank curves (`..._rank{r}`) by rank, then name.
fn column_order(column: &str) -> (usize, usize, String) {
    if let Some(i) = SHARED_COLUMNS.iter().position(|c| *c == column) {
        return (0, i, String::new());
    }
    let rank = column
        .rsplit_once("_rank")
        .and_then(|(_, r)| r.parse::<usize>().ok());
    match rank {
        Some(r) => (2, r, column.to_string()),
        None => (1, 0, column.to_string()),
    }
}

/// `metrics.csv` of `table`: `epoch`, the [`SHARED_COLUMNS`], then the run's other columns
/// (see [`column_order`]); an empty cell where an epoch lacks a value.
pub fn metrics_csv(table: &BTreeMap<usize, BTreeMap<String, f64>>) -> String {
    let mut columns: Vec<String> = SHARED_COLUMNS.iter().map(|c| c.to_string()).collect();
    for row in table.values() {
        for k in row.keys() {
            if !columns.contains(k) {
                columns.push(k.clone());
            }
        }
    }
    columns.sort_by_cached_key(|c| column_order(c));
    let mut out = String::from("epoch");
    for c in &columns {
        out.push(',');
        out.push_str(c);
    }
    out.push('\n');
    for (epoch, row) in table.iter() {
        out.push_str(&epoch.to_string());
        for c in &columns {
            out.push(',');
            if let Some(v) = row.get(c) {
                out.push_str(&format!("{v:.6}"));
            }
        }
        out.push('\n');
    }
    out
}

impl MetricLogger for CsvMetricLogger {
    fn log(&mut self, update: MetricsUpdate, epoch: usize, split: &Split) {
        let valid = matches!(split, Split::Valid);
        let step = if valid {
            0
        } else {
            let s = self.train_steps.entry(epoch).or_default();
            *s += 1;
            *s
        };
        for u in update.entries_numeric {
            let Some(name) = self.names.get(&u.entry.metric_id).cloned() else {
                continue;
            };
            if let (false, Some(entry), Some((seen, interrupter))) =
                (valid, &u.numeric_entry, &self.guard)
                && slug(&name) == "loss"
                && !entry.current().is_finite()
                && let Ok(mut first) = seen.lock()
                && first.is_none()
            {
                *first = Some((epoch, step));
                interrupter.fail(burn::data::dataset::DatasetError::new(
                    crate::HearthError::NanLoss { epoch, step },
                ));
            }
            if let Some(entry) = u.numeric_entry {
                self.entries
                    .entry((name, epoch, valid))
                    .or_default()
                    .push(entry);
            }
        }
    }

    fn read_numeric(
        &mut self,
        name: &str,
        epoch: usize,
        split: &Split,
    ) -> Result<Vec<NumericEntry>, String> {
        let valid = matches!(split, Split::Valid);
        // As burn's file logger: an epoch without entries is an empty list, not an error.
        Ok(self
            .entries
            .get(&(name.to_string(), epoch, valid))
            .cloned()
            .unwrap_or_default())
    }

    fn log_metric_definition(&mut self, definition: MetricDefinition) {
        self.names
            .insert(definition.metric_id.clone(), definition.name.to_string());
    }

    fn log_epoch_summary(&mut self, summary: EpochSummary) {
        let valid = matches!(summary.split, Split::Valid);
        let prefix = if valid { "val" } else { "train" };
        let epoch = summary.epoch_number;
        // Epoch value and sample count of every metric, by metric name (sorted: the same order
        // on every rank).
        let mut by_name: BTreeMap<String, f64> = BTreeMap::new();
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        for ((name, e, v), entries) in &self.entries {
            if *e == epoch
                && *v == valid
                && let Some(x) = epoch_value(entries)
            {
                let n = epoch_count(entries);
                // A rank whose shard was empty (fewer validation images than ranks) logged a
                // batch of nothing, whose value is NaN: it weighs nothing in the job's figure.
                let x = if n == 0 && self.ranks.is_some() {
                    0.0
                } else {
                    x
                };
                by_name.insert(name.clone(), x);
                counts.insert(name.clone(), n);
            }
        }
        let mut per_rank_columns = BTreeMap::new();
        if let Some(comm) = &self.ranks
            && let Some(ranks) = gather_over_ranks(comm, &by_name, &counts)
        {
            for (i, (name, value)) in by_name.iter_mut().enumerate() {
                let column = slug(name);
                // Weighted by each rank's sample count: validation shards differ by up to one
                // image when the set does not divide by the world, and each image counts once,
                // so the job's figure equals a single process's on the whole set.
                let (sum, weighted, n) = ranks.iter().fold((0.0, 0.0, 0.0), |(s, w, n), r| {
                    (s + r[i].0, w + r[i].0 * r[i].1, n + r[i].1)
                });
                *value = if column == "images_per_sec" {
                    sum
                } else if n > 0.0 {
                    weighted / n
                } else {
                    sum / ranks.len() as f64
                };
                // Early stopping and best-epoch checkpoints read these entries back: every rank
                // now reads the job's value, so all take the same decisions.
                self.entries.insert(
                    (name.clone(), epoch, valid),
                    vec![NumericEntry::Final(*value)],
                );
                if !valid && (column == "loss" || column == "accuracy") {
                    for (r, values) in ranks.iter().enumerate() {
                        per_rank_columns.insert(format!("train_{column}_rank{r}"), values[i].0);
                    }
                }
            }
        }
        let mut values = per_rank_columns;
        for (name, x) in by_name {
            let column = slug(&name);
            // The learning rate is a training quantity: no val_ copy.
            if column == "lr" && valid {
                continue;
            }
            let x = match &self.epoch_lr {
                Some(lr) if column == "lr" => lr(epoch),
                _ => x,
            };
            values.insert(format!("{prefix}_{column}"), x);
        }
        if valid {
            values.insert(
                "elapsed_seconds".into(),
                self.started.elapsed().as_secs_f64(),
            );
        }
        if let Ok(mut table) = self.table.lock() {
            table.entry(epoch).or_default().extend(values);
        }
        if valid && self.write {
            self.write_csv();
            if let (Some(report), Some(line)) = (&self.report, self.summary_line(epoch)) {
                report(&line);
            }
        }
    }
}

/// Every rank's (value, sample count) pairs (in `values`' key order), by rank. `None` (with a
/// warning) when the exchange fails: the local values then stay.
fn gather_over_ranks(
    comm: &burn_dist::Communicator,
    values: &BTreeMap<String, f64>,
    counts: &BTreeMap<String, usize>,
) -> Option<Vec<Vec<(f64, f64)>>> {
    let mut local: Vec<f32> = values.values().map(|v| *v as f32).collect();
    local.extend(
        values
            .keys()
            .map(|k| counts.get(k).copied().unwrap_or(1) as f32),
    );
    let n = values.len();
    match comm.all_gather(&local) {
        Ok(g) => Some(
            g.chunks(local.len().max(1))
                .take(comm.world())
                .map(|c| (0..n).map(|i| (c[i] as f64, c[n + i] as f64)).collect())
                .collect(),
        ),
        Err(e) => {
            eprintln!("warning: metrics not averaged across ranks: {e}");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_csv_puts_the_shared_columns_first_then_the_runs_own_then_each_ranks() {
        let mut row = BTreeMap::new();
        for (k, v) in [
            ("world_size", 2.0),
            ("train_loss_rank10", 1.0),
            ("train_loss_rank2", 1.0),
            ("elapsed_seconds_rank2", 4.0),
            ("val_accuracy", 50.0),
            ("train_loss", 0.5),
            ("bytes_per_sample", 8.0),
            ("elapsed_seconds", 3.0),
        ] {
            row.insert(k.to_string(), v);
        }
        let table = BTreeMap::from([(1, row)]);
        let csv = metrics_csv(&table);
        let mut lines = csv.lines();
        let header: Vec<&str> = lines.next().unwrap().split(',').collect();
        let mut expected = vec!["epoch"];
        expected.extend(SHARED_COLUMNS);
        expected.extend([
            "bytes_per_sample",
            "world_size",
            "elapsed_seconds_rank2",
            "train_loss_rank2",
            "train_loss_rank10",
        ]);
        assert_eq!(header, expected);
        // The shared columns this row lacks are empty cells, in place.
        let cells: Vec<&str> = lines.next().unwrap().split(',').collect();
        assert_eq!(cells.len(), header.len(), "{csv}");
        let cell = |c: &str| cells[header.iter().position(|h| *h == c).unwrap()];
        assert_eq!(cell("train_loss"), "0.500000");
        assert_eq!(cell("elapsed_seconds"), "3.000000");
        assert_eq!(cell("train_accuracy"), "");
        assert_eq!(cell("train_loss_rank10"), "1.000000");
    }

    #[test]
    fn the_epoch_line_counts_skipped_images_only_when_there_are_some() {
        let mut row = BTreeMap::new();
        row.insert("train_loss".to_string(), 0.5);
        row.insert("train_skipped_images".to_string(), 0.0);
        row.insert("val_skipped_images".to_string(), 0.0);
        assert!(!epoch_line(1, Some(2), &row).contains("skipped"));
        row.insert("train_skipped_images".to_string(), 2.0);
        row.insert("val_skipped_images".to_string(), 1.0);
        let line = epoch_line(1, Some(2), &row);
        assert!(line.ends_with("| skipped 3 unreadable image(s)"), "{line}");
    }

    #[test]
    fn epoch_value_prefers_final_then_weights_by_count() {
        assert_eq!(
            epoch_value(&[NumericEntry::Value(1.0), NumericEntry::Value(3.0)]),
            Some(2.0)
        );
        let agg = [
            NumericEntry::Aggregated {
                aggregated_value: 1.0,
                count: 3,
            },
            NumericEntry::Aggregated {
                aggregated_value: 5.0,
                count: 1,
            },
        ];
        assert_eq!(epoch_value(&agg), Some(2.0));
        assert_eq!(
            epoch_value(&[NumericEntry::Value(1.0), NumericEntry::Final(9.0)]),
            Some(9.0)
        );
        assert_eq!(epoch_value(&[]), None);
        assert_eq!(epoch_count(&agg), 4);
        // An epoch without batches (an empty shard): no samples, it weighs nothing across ranks.
        assert_eq!(epoch_count(&[NumericEntry::Final(f64::NAN)]), 0);
        let with_final = [agg[0].clone(), agg[1].clone(), NumericEntry::Final(1.5)];
        assert_eq!(epoch_count(&with_final), 4);
        assert_eq!(epoch_count(&[NumericEntry::Final(0.5)]), 1);
        assert_eq!(slug("Top-5 Accuracy"), "top5_accuracy");
        assert_eq!(slug("Loss"), "loss");
        assert_eq!(slug("Learning Rate"), "lr");
        assert_eq!(slug("Hamming Score @ Threshold(0.5)"), "accuracy");
        assert_eq!(slug("AUROC [Macro]"), "auroc");
        assert_eq!(slug("Images/s"), "images_per_sec");
    }
}
