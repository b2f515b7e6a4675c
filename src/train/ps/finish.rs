//! The end of a parameter-server run on a worker: the lead reads the servers' final state,
//! validates and exports it, and merges every worker's statistics into `metrics.csv`.

use std::collections::BTreeMap;
use std::time::Instant;

use burn_dist::DistError;
use burn_dist::wire::Kind;

use super::job::{BYE, SCORES, SETUP, SKIPPED, STATS};
use super::state::{EpochStats, decode_scores, decode_stats};
use super::worker::Worker;
use crate::Result;
use crate::train::TrainReport;
use crate::train::epochs::Epochs;
use crate::train::export::export_best;
use crate::train::scores::ValScores;
use crate::train::shared::collective_timeout;
use crate::train::trainee::Trainee;

impl<T: Trainee> Worker<'_, T> {
    /// The lead at the end: every worker's statistics into `metrics.csv`, the goodbyes, the
    /// plot, and the best epoch's weights into `model.bpk`.
    pub(super) fn finish(
        &self,
        epochs: &Epochs,
        last: usize,
        log: &mut dyn FnMut(&str),
    ) -> Result<TrainReport> {
        // The servers' sessions are over: no further one follows.
        for &server in &self.roles.server_ranks() {
            self.t.send(server, Kind::Ps, SETUP, Vec::new())?;
        }
        let Gathered {
            all,
            skipped,
            scores,
        } = self.gather_workers(log);
        for r in (1..self.roles.workers).chain(self.roles.server_ranks()) {
            let _ = self.t.send(r, Kind::Ps, BYE, Vec::new());
        }
        epochs.update_rows(|rows| {
            self.merge_worker_stats(rows, &all, log);
            for (epoch, s) in &scores {
                if let (Some(row), Some(a)) = (rows.get_mut(epoch), s.auroc()) {
                    row.insert("train_auroc".into(), a);
                }
            }
        });
        epochs.write_csv()?;
        let best = epochs.best_or_err()?;
        let per_class_auroc = export_best(
            self.cfg,
            &self.trainee,
            best,
            &self.plain_device,
            &Default::default(),
            log,
        )?;
        epochs.plot(log);
        let samples: f64 = all.iter().flat_map(|(_, s)| s).map(|s| s.samples).sum();
        let mut report = epochs.report(
            best,
            self.started,
            samples as usize,
            self.trainee.classes().to_vec(),
            0,
            self.roles.world(),
        );
        report.epochs_run = last;
        report.per_class_auroc = per_class_auroc;
        report.skipped = skipped;
        Ok(report)
    }

    /// Every worker's statistics, skipped images and (multi-label) training outputs, this
    /// lead's among them; what a lost or damaged worker did not send is said and left out.
    fn gather_workers(&self, log: &mut dyn FnMut(&str)) -> Gathered {
        let mut g = Gathered {
            all: vec![(0, self.stats.clone())],
            skipped: self.trainee.skipped(),
            scores: BTreeMap::new(),
        };
        g.keep(self.train_scores.clone());
        let deadline = Instant::now() + collective_timeout();
        for r in 1..self.roles.workers {
            match self.t.recv(r, Kind::Ps, STATS, deadline) {
                Ok(b) => match decode_stats(&b) {
                    Ok(s) => g.all.push((r, s)),
                    Err(e) => log(&format!("worker {r} sent damaged statistics: {e}")),
                },
                Err(DistError::PeerFailed { reason, .. }) => {
                    log(&format!(
                        "worker {r} was lost ({reason}); its statistics are missing"
                    ));
                    continue;
                }
                Err(e) => {
                    log(&format!("no statistics from worker {r}: {e}"));
                    continue;
                }
            }
            // Its skipped images, for the summary (each worker decodes only its shard).
            match self
                .t
                .recv(r, Kind::Ps, SKIPPED, deadline)
                .map_err(|e| e.to_string())
                .and_then(|b| crate::train::shared::decode_lines(&b))
            {
                Ok(lines) => {
                    for l in lines {
                        if !g.skipped.contains(&l) {
                            g.skipped.push(l);
                        }
                    }
                }
                Err(e) => log(&format!("worker {r}'s skipped images are missing: {e}")),
            }
            if self.trainee.multi_label() {
                match self
                    .t
                    .recv(r, Kind::Ps, SCORES, deadline)
                    .map_err(|e| e.to_string())
                    .and_then(|b| decode_scores(&b).map_err(|e| e.to_string()))
                {
                    Ok(part) => g.keep(part),
                    Err(e) => log(&format!(
                        "worker {r}'s training outputs are missing ({e}): `train_auroc` \
                         leaves its samples out"
                    )),
                }
            }
        }
        g
    }

    /// Each worker's epochs as `*_rank{r}` columns, `train_*` as the mean over the workers,
    /// `train_images_per_sec` as their sum, bytes exchanged per sample, and in sync mode which worker the rounds waited for.
    pub(super) fn merge_worker_stats(
        &self,
        rows: &mut crate::train::EpochRows,
        all: &[(usize, Vec<EpochStats>)],
        log: &mut dyn FnMut(&str),
    ) {
        for (&epoch, row) in rows.iter_mut() {
            let mut of_epoch: Vec<(usize, EpochStats)> = Vec::new();
            for (r, stats) in all {
                if let Some(s) = stats.iter().find(|s| s.epoch == epoch) {
                    of_epoch.push((*r, *s));
                }
            }
            if of_epoch.is_empty() {
                continue;
            }
            for (r, s) in &of_epoch {
                row.insert(format!("train_accuracy_rank{r}"), s.accuracy());
                row.insert(format!("train_loss_rank{r}"), s.loss());
                row.insert(format!("wait_seconds_rank{r}"), s.wait);
                row.insert(format!("elapsed_seconds_rank{r}"), s.elapsed);
                if self.scaler.is_some() {
                    row.insert(format!("skipped_steps_rank{r}"), s.skipped);
                }
            }
            if self.scaler.is_some() {
                row.insert(
                    "train_skipped_steps".into(),
                    of_epoch.iter().map(|(_, s)| s.skipped).sum(),
                );
            }
            let samples: f64 = of_epoch.iter().map(|(_, s)| s.samples).sum();
            // The job's throughput: the workers train side by side, so their rates add up.
            row.insert(
                "train_images_per_sec".into(),
                of_epoch
                    .iter()
                    .map(|(_, s)| s.samples / s.seconds.max(1e-9))
                    .sum(),
            );
            row.insert(
                "train_loss".into(),
                of_epoch.iter().map(|(_, s)| s.loss_sum).sum::<f64>() / samples.max(1.0),
            );
            row.insert(
                "train_accuracy".into(),
                100.0 * of_epoch.iter().map(|(_, s)| s.correct).sum::<f64>() / samples.max(1.0),
            );
            if let Some(top5) = row.get_mut("train_top5_accuracy") {
                *top5 =
                    100.0 * of_epoch.iter().map(|(_, s)| s.top5).sum::<f64>() / samples.max(1.0);
            }
            if self.opts.mode == burn_dist::ps::Mode::Sync && of_epoch.len() > 1 {
                // The slowest worker waits least: the rounds wait for it.
                if let Some((slow, s)) =
                    of_epoch.iter().min_by(|a, b| a.1.wait.total_cmp(&b.1.wait))
                {
                    let others: Vec<f64> = of_epoch
                        .iter()
                        .filter(|(r, _)| r != slow)
                        .map(|(_, s)| s.wait)
                        .collect();
                    let mean = others.iter().sum::<f64>() / others.len().max(1) as f64;
                    log(&format!(
                        "epoch {epoch}: the sync rounds waited mostly for worker {slow}: the \
                         others waited {mean:.1} s on the servers on average, it {:.1} s",
                        s.wait
                    ));
                }
            }
        }
        // Cumulative bytes over cumulative samples, per epoch.
        let mut bytes_at: BTreeMap<usize, (f64, f64)> = BTreeMap::new();
        for (_, stats) in all {
            let mut samples = 0.0;
            for s in stats {
                samples += s.samples;
                let e = bytes_at.entry(s.epoch).or_default();
                e.0 += s.bytes;
                e.1 += samples;
            }
        }
        for (epoch, (bytes, samples)) in bytes_at {
            if let Some(row) = rows.get_mut(&epoch) {
                row.insert("bytes_per_sample".into(), bytes / samples.max(1.0));
            }
        }
    }
}

/// What the lead gathers from the workers at the end.
struct Gathered {
    /// Each worker's rank and epoch statistics.
    all: Vec<(usize, Vec<EpochStats>)>,
    /// Every worker's skipped images, once each.
    skipped: Vec<String>,
    /// A multi-label run's training outputs of each epoch, every worker's.
    scores: BTreeMap<usize, ValScores>,
}

impl Gathered {
    fn keep(&mut self, part: Vec<(usize, ValScores)>) {
        for (epoch, s) in part {
            self.scores.entry(epoch).or_default().append(s);
        }
    }
}
