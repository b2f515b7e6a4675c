//! `optim.model_ema` with parameter servers: the lead worker keeps the weight average of the
//! model it holds after each of its steps that was taken. In sync mode that is the servers'
//! model after every round (with the lead's batch-norm statistics, the ones it validates and
//! exports), so the average is data parallel's; in the asynchronous modes it is the lead's own
//! model (its local steps and what it pulls from the servers), as a timm run on that worker
//! would average it. Validated beside the servers' model at each epoch's end (`val_ema_*`),
//! kept as `checkpoint/ema-<epoch>.bpk` before the state file that completes the epoch, read
//! back on `--resume`, and exported from the best epoch as `model_ema.bpk`.

use crate::Result;
use crate::train::ema::{Ema, ema_checkpoint};
use crate::train::epochs::Row;
use crate::train::trainee::Trainee;

use super::worker::Worker;

impl<T: Trainee> Worker<'_, T> {
    /// The lead starts its average of the model it holds now: afresh, or with `--resume`
    /// after `first` epochs from that epoch's checkpoint.
    pub(super) fn start_average(&mut self, first: usize) -> Result<()> {
        let (0, Some(decay)) = (self.rank, self.cfg.optim.model_ema) else {
            return Ok(());
        };
        let mut average = Ema::new(&self.model, decay);
        if first > 0 {
            let path = ema_checkpoint(&self.cfg.run_dir, first);
            let bytes = std::fs::read(&path).map_err(|source| crate::HearthError::Read {
                path: path.clone(),
                source,
            })?;
            average.load(&self.model, bytes, first)?;
        }
        self.ema = Some(average);
        Ok(())
    }

    /// After a step that was taken: the average follows the model this worker holds.
    pub(super) fn average_step(&mut self) {
        if let Some(e) = &mut self.ema {
            e.update(&self.model);
        }
    }

    /// The lead at an epoch's end: the average validated on the whole validation set, its
    /// columns into `row`.
    pub(super) fn validate_average(&self, row: &mut Row) -> Result<()> {
        let Some(e) = &self.ema else {
            return Ok(());
        };
        let val =
            self.objective
                .validate(&e.model, self.trainee.full_val(&self.plain_device), None)?;
        row.insert("val_ema_loss".into(), val.sums.mean_loss());
        row.insert("val_ema_accuracy".into(), val.sums.accuracy());
        if let Some(a) = val.auroc {
            row.insert("val_ema_auroc".into(), a);
        }
        Ok(())
    }

    /// The lead's checkpoint of the average after `epoch` (before the state file that
    /// completes the epoch); the ones of epochs other than `best` and the last are removed.
    pub(super) fn save_average(&self, epoch: usize, best: Option<usize>) -> Result<()> {
        let Some(e) = &self.ema else {
            return Ok(());
        };
        let dir = &self.cfg.run_dir;
        e.save(&ema_checkpoint(dir, epoch))?;
        for old in 1..epoch {
            if Some(old) != best {
                let _ = std::fs::remove_file(ema_checkpoint(dir, old));
            }
        }
        Ok(())
    }
}
