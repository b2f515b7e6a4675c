//! `optim.model_ema` in elastic training: the weight average lives in the commit, moves after
//! every step that was taken, travels with the state a new world receives (so a joiner and a
//! resume go on with it), is validated beside the model at each epoch's end with rank 0's
//! batch-norm statistics (as data parallel does), kept as `checkpoint/ema-<epoch>.bpk` through
//! the run's fence, and exported from the best epoch as `model_ema.bpk`.

use super::*;
use crate::train::ema::{Ema, ema_checkpoint};

impl<T: Trainee> ElasticRun<'_, T> {
    /// A fresh average of `model`, where the run keeps one.
    pub(super) fn fresh_average(&self, model: &T::Model) -> Option<Ema<T::Model>> {
        self.cfg.optim.model_ema.map(|d| Ema::new(model, d))
    }

    /// The average as it travels in the state (empty where the run keeps none).
    pub(super) fn encode_average(c: &Commit<T::Model>) -> Result<Vec<u8>> {
        match &c.ema {
            Some(e) => e.to_bytes(),
            None => Ok(Vec::new()),
        }
    }

    /// The average read back from a state's `bytes` on `model`'s shape; a state from before
    /// the run kept one (no bytes) starts it afresh from `model`.
    pub(super) fn decode_average(
        &self,
        model: &T::Model,
        bytes: Option<&[u8]>,
        epoch: usize,
    ) -> Result<Option<Ema<T::Model>>> {
        let Some(mut average) = self.fresh_average(model) else {
            return Ok(None);
        };
        if let Some(b) = bytes.filter(|b| !b.is_empty()) {
            average.load(model, b.to_vec(), epoch)?;
        }
        Ok(Some(average))
    }

    /// After a step that was taken: the average follows the committed model.
    pub(super) fn average_step(c: &mut Commit<T::Model>) {
        if let Some(e) = &mut c.ema {
            e.update(&c.model);
        }
    }

    /// The epoch's end: the average validated over the world (every member calls it), its
    /// columns in `row`, and every member's average takes rank 0's batch-norm statistics.
    pub(super) fn validate_average(
        &self,
        world: &World,
        c: &mut Commit<T::Model>,
        parts: Vec<Vec<usize>>,
        row: &mut Row,
    ) -> Result<()> {
        let Some(e) = c.ema.take() else {
            return Ok(());
        };
        let average = burn_dist::ddp::broadcast_module(e.model.clone(), &world.comm)?;
        let val = self.objective.validate(
            &average.valid(),
            self.trainee.val_batches(parts, &self.plain_device),
            Some(&world.comm),
        )?;
        c.ema = Some(e.with_model(average));
        row.insert("val_ema_loss".into(), val.sums.mean_loss());
        row.insert("val_ema_accuracy".into(), val.sums.accuracy());
        if let Some(a) = val.auroc {
            row.insert("val_ema_auroc".into(), a);
        }
        Ok(())
    }

    /// Rank 0's file of epoch `epoch`'s average, through the run's fence (the best and the
    /// last epoch's kept), before the state that names the epoch.
    pub(super) fn save_average(
        &self,
        c: &Commit<T::Model>,
        gate: &Gate,
        epoch: usize,
        best: Option<usize>,
    ) -> Result<()> {
        let Some(e) = &c.ema else {
            return Ok(());
        };
        let dir = &self.cfg.run_dir;
        gate.write(&ema_checkpoint(dir, epoch), &e.to_bytes()?)?;
        for old in 1..epoch {
            if Some(old) != best {
                gate.remove(&ema_checkpoint(dir, old))?;
            }
        }
        Ok(())
    }
}
