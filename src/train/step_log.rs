//! `checkpoint.log_every` (`--log-every N`): TensorBoard scalars every N optimizer steps, below
//! every mode that logs them. At each N-th step of the run (counted from 1 over the whole run,
//! as the learning-rate schedule counts them) the writer appends one record to
//! [`crate::tensorboard::STEPS_FILE_NAME`]: `step/train_loss` and `step/train_accuracy` (the
//! mean over the samples of the steps since the last record, the window starting afresh at each
//! epoch, so that a resumed run writes the straight run's records) and `step/train_lr` (the
//! step's rate). Where the ranks train in lockstep the sums are the whole job's (the caller's
//! `total`); a resume drops the records past the steps it keeps, so a crash between checkpoints
//! leaves no step twice.

use std::io::Write;
use std::path::PathBuf;

use super::objective::Sums;
use crate::tensorboard::{Event, STEPS_FILE_NAME, file_head, read, scalar_record};
use crate::{HearthError, Result};

/// One run's step scalars: the window's sums on every rank, the file on the writer.
pub(super) struct StepLog {
    every: u64,
    /// The writer's file (`None` on the other ranks, which only add their sums).
    path: Option<PathBuf>,
    window: Sums,
    /// The epoch the window's steps belong to.
    epoch: usize,
}

impl StepLog {
    /// The log of a run with `log_every` (`None` without it). On the writer, the file starts
    /// afresh, or on a resume keeps the records of the first `done` steps (a damaged file is
    /// said in `log` and started afresh: it is a log, the metrics live in `metrics.csv`).
    pub fn open(
        log_every: Option<usize>,
        run_dir: &std::path::Path,
        writer: bool,
        done: u64,
        log: &mut dyn FnMut(&str),
    ) -> Result<Option<Self>> {
        let Some(every) = log_every.filter(|&n| n > 0) else {
            return Ok(None);
        };
        let path = writer.then(|| run_dir.join(STEPS_FILE_NAME));
        if let Some(p) = &path {
            let kept: Vec<Event> = match std::fs::read(p) {
                Ok(bytes) if done > 0 => match read(&bytes, p) {
                    Ok(events) => events
                        .into_iter()
                        .filter(|e| !e.scalars.is_empty() && (e.step as u64) <= done)
                        .collect(),
                    Err(e) => {
                        log(&format!("warning: {e}; the step log starts afresh"));
                        Vec::new()
                    }
                },
                _ => Vec::new(),
            };
            let start = kept.first().map_or_else(unix_now, |e| e.wall_time);
            let mut bytes = file_head(start);
            for e in &kept {
                bytes.extend(scalar_record(e));
            }
            super::run_dir::write_atomic(p, bytes)?;
        }
        Ok(Some(Self {
            every: every as u64,
            path,
            window: Sums::default(),
            epoch: 0,
        }))
    }

    /// A batch's sums of `epoch` (this rank's, or the job's where each rank knows them); the
    /// first of an epoch starts a new window.
    pub fn add(&mut self, epoch: usize, sums: Sums) {
        if epoch != self.epoch {
            self.epoch = epoch;
            self.window = Sums::default();
        }
        self.window.add(sums);
    }

    /// After optimizer step `step` (from 1 over the run) at rate `lr`: on every N-th, the
    /// window's sums over the job (`total` turns this rank's into them; every rank calls it at
    /// the same steps) written by the writer, and a new window.
    pub fn stepped(
        &mut self,
        step: u64,
        lr: f64,
        total: impl FnOnce(Sums) -> Result<Sums>,
    ) -> Result<()> {
        if !step.is_multiple_of(self.every) {
            return Ok(());
        }
        let sums = total(std::mem::take(&mut self.window))?;
        let Some(path) = &self.path else {
            return Ok(());
        };
        let mut scalars = vec![("step/train_lr".to_string(), lr as f32)];
        if sums.samples > 0.0 {
            scalars.push(("step/train_loss".into(), sums.mean_loss() as f32));
            scalars.push(("step/train_accuracy".into(), sums.accuracy() as f32));
        }
        let record = scalar_record(&Event {
            wall_time: unix_now(),
            step: step as i64,
            scalars,
            other_tags: Vec::new(),
        });
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::OpenOptions::new().append(true).open(path)?;
            f.write_all(&record)?;
            f.flush()
        };
        write().map_err(|source| HearthError::Write {
            path: path.clone(),
            source,
        })
    }
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sums(loss: f64, hits: f64, samples: f64) -> Sums {
        Sums {
            loss,
            hits,
            samples,
            top5: 0.0,
        }
    }

    /// Every N-th step writes the window's mean (the job's, through `total`); a resume keeps
    /// the records of the steps it keeps and drops the rest; another rank writes nothing.
    #[test]
    fn every_nth_step_is_a_record_and_a_resume_drops_what_follows_its_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(STEPS_FILE_NAME);
        let mut log = StepLog::open(Some(2), dir.path(), true, 0, &mut |_| {})
            .unwrap()
            .unwrap();
        for step in 1..=6u64 {
            log.add(1, sums(2.0 * step as f64, 1.0, 2.0));
            // Doubled "over the job": the mean is unchanged, the samples doubled.
            log.stepped(step, 0.1 * step as f64, |s| {
                Ok(sums(2.0 * s.loss, 2.0 * s.hits, 2.0 * s.samples))
            })
            .unwrap();
        }
        let events = read(&std::fs::read(&path).unwrap(), &path).unwrap();
        let steps: Vec<_> = events
            .iter()
            .filter(|e| !e.scalars.is_empty())
            .map(|e| e.step)
            .collect();
        assert_eq!(steps, vec![2, 4, 6]);
        let at4 = &events.iter().find(|e| e.step == 4).unwrap().scalars;
        let get = |tag: &str| at4.iter().find(|(t, _)| t == tag).unwrap().1;
        // Steps 3 and 4: losses 6 and 8 over 2 samples each: mean (6 + 8) / 4.
        assert!((get("step/train_loss") - 3.5).abs() < 1e-6, "{at4:?}");
        assert!((get("step/train_accuracy") - 50.0).abs() < 1e-4);
        assert!((get("step/train_lr") - 0.4).abs() < 1e-6);
        // A resume after step 4 keeps steps 2 and 4.
        StepLog::open(Some(2), dir.path(), true, 4, &mut |_| {}).unwrap();
        let kept = read(&std::fs::read(&path).unwrap(), &path).unwrap();
        let kept: Vec<_> = kept.iter().filter(|e| !e.scalars.is_empty()).collect();
        assert_eq!(kept.len(), 2);
        assert_eq!(kept[1].scalars, at4.clone());
        // A damaged file is said and started afresh; a rank that does not write adds no file.
        std::fs::write(&path, b"garbage").unwrap();
        let mut said = Vec::new();
        StepLog::open(Some(2), dir.path(), true, 4, &mut |l| {
            said.push(l.to_string())
        })
        .unwrap();
        assert!(said.iter().any(|l| l.contains("starts afresh")), "{said:?}");
        let other = tempfile::tempdir().unwrap();
        let mut quiet = StepLog::open(Some(1), other.path(), false, 0, &mut |_| {})
            .unwrap()
            .unwrap();
        quiet.add(1, sums(1.0, 1.0, 1.0));
        quiet.stepped(1, 0.1, Ok).unwrap();
        assert!(!other.path().join(STEPS_FILE_NAME).exists());
        assert!(
            StepLog::open(None, dir.path(), true, 0, &mut |_| {})
                .unwrap()
                .is_none()
        );
    }
}
