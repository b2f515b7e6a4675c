//! `metrics.csv` and the epoch line: one row per epoch, a header naming each column (`epoch`,
//! then [`SHARED_COLUMNS`], the same in every mode, then what only some runs have).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// Every epoch's metrics: epoch -> column -> value.
pub type EpochTable = Arc<Mutex<BTreeMap<usize, BTreeMap<String, f64>>>>;

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
}
