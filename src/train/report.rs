//! What a run reports: [`TrainReport`] at its end and [`EpochRows`], the rows of its
//! `metrics.csv`, below every mode that fills them in.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use super::TrainConfig;

/// Epoch -> column -> value: the rows of `metrics.csv`.
pub type EpochRows = BTreeMap<usize, BTreeMap<String, f64>>;

/// What a run reports at the end.
#[derive(Debug, Clone)]
pub struct TrainReport {
    pub run_dir: PathBuf,
    pub model_path: PathBuf,
    pub best_epoch: usize,
    pub best_val_accuracy: Option<f64>,
    pub best_val_loss: Option<f64>,
    pub epochs_run: usize,
    pub wall_seconds: f64,
    pub images_per_sec: f64,
    /// Process-hours of the whole job: wall time times the processes of a fixed world
    /// (workers, servers and stages alike); an elastic job's worker-hours across its
    /// membership changes and resumes.
    pub node_hours: f64,
    pub cost: Option<f64>,
    pub class_names: Vec<String>,
    /// Multi-label runs: mean per-class validation AUROC of the best epoch (0-100, as burn
    /// reports it).
    pub best_val_auroc: Option<f64>,
    /// Multi-label runs: each class's validation AUROC (0-1) for the exported model, as CheXNet
    /// reports it; also written to `auroc.csv`.
    pub per_class_auroc: Option<Vec<(String, f64)>>,
    /// This process's rank (0 when not distributed); only rank 0 exports and plots.
    pub rank: usize,
    pub world: usize,
    /// Images the run's loaders skipped because they failed to decode (on rank 0: every
    /// rank's, gathered at the end; elsewhere this rank's) (`path: reason`, each
    /// once): never trained or validated on.
    pub skipped: Vec<String>,
}

impl TrainReport {
    /// The job runs on `world` processes, each from its start to its end as this one: its
    /// node-hours are this process's wall time times `world`, and `price` (per node-hour,
    /// `--price-per-hour`) prices them.
    pub(crate) fn set_world(&mut self, world: usize, price: Option<f64>) {
        self.world = world;
        self.price_process_seconds(self.wall_seconds * world.max(1) as f64, price);
    }

    /// The job used `seconds` process-seconds in all (an elastic job's worker-seconds, over
    /// the membership changes): its node-hours and their cost at `price` per node-hour.
    pub(crate) fn price_process_seconds(&mut self, seconds: f64, price: Option<f64>) {
        self.node_hours = seconds / 3600.0;
        self.cost = price.map(|p| p * self.node_hours);
    }

    /// The report of a run that trained `images` images in all since `started`, whose best
    /// epoch is `best` (rank 0 of 1, no per-class AUROC: the caller fills those in).
    pub(super) fn summarise(
        cfg: &TrainConfig,
        rows: &EpochRows,
        best: usize,
        started: Instant,
        images: usize,
        class_names: Vec<String>,
    ) -> Self {
        let wall = started.elapsed().as_secs_f64();
        let node_hours = wall / 3600.0;
        let row = rows.get(&best);
        let value = |column: &str| row.and_then(|r| r.get(column)).copied();
        Self {
            run_dir: cfg.run_dir.clone(),
            model_path: cfg.run_dir.join("model.bpk"),
            best_epoch: best,
            best_val_accuracy: value("val_accuracy"),
            best_val_loss: value("val_loss"),
            epochs_run: rows.keys().copied().max().unwrap_or(0),
            wall_seconds: wall,
            images_per_sec: images as f64 / wall.max(1e-9),
            node_hours,
            cost: cfg.price_per_hour.map(|p| p * node_hours),
            class_names,
            best_val_auroc: value("val_auroc"),
            per_class_auroc: None,
            rank: 0,
            world: 1,
            skipped: Vec::new(),
        }
    }
}
