//! `optim.model_ema` in a pipeline: each rank keeps the weight average of its stage, moved after
//! every step that was taken (the replicas' steps are equal; their batch-norm statistics are
//! replica 0's after each epoch, the average's too), validated through the pipeline beside the
//! model (`val_ema_*`, the last stages' sums over the job), kept by replica 0 as
//! `checkpoint/stage-<s>/ema-<epoch>.bpk` with the stage's other files, read back on
//! `--resume`, and assembled from the best epoch's stages into `model_ema.bpk` (`store.rs`).

use super::*;
use crate::train::ema::Ema;

impl PipelineRun<'_> {
    /// The stage's average of `model`: afresh, or with `--resume` after `resume` epochs from
    /// that epoch's file.
    pub(super) fn start_average(&self, model: &StageModel, resume: usize) -> Result<()> {
        let Some(decay) = self.cfg.optim.model_ema else {
            return Ok(());
        };
        let mut average = Ema::new(model, decay);
        if resume > 0 {
            let path = files::ema_file(&self.cfg.run_dir, self.stage, resume);
            let bytes = std::fs::read(&path).map_err(|source| HearthError::Read {
                path: path.clone(),
                source,
            })?;
            average.load(model, bytes, resume)?;
        }
        *self.ema.borrow_mut() = Some(average);
        Ok(())
    }

    /// After a step that was taken: the average follows the stage.
    pub(super) fn average_step(&self, model: &StageModel) {
        if let Some(e) = self.ema.borrow_mut().as_mut() {
            e.update(model);
        }
    }

    /// The epoch's end: the replicas' averages take replica 0's batch-norm statistics, as the
    /// model does.
    pub(super) fn settle_average(&self) -> Result<()> {
        let Some(replicas) = &self.replicas else {
            return Ok(());
        };
        let Some(e) = self.ema.borrow_mut().take() else {
            return Ok(());
        };
        let average = broadcast_module(e.model.clone(), replicas)?;
        *self.ema.borrow_mut() = Some(e.with_model(average));
        Ok(())
    }

    /// The average validated through the pipeline (every rank calls it): its columns in `row`,
    /// the last stages' sums over the job.
    pub(super) fn validate_average(&self, pipe: &mut Pipeline, row: &mut Row) -> Result<()> {
        let Some(average) = self.ema.borrow().as_ref().map(|e| e.model.clone()) else {
            return Ok(());
        };
        let (val, scores) = self.validate(pipe, &average)?;
        let mut v = [val.loss as f32, val.correct as f32, val.count as f32];
        self.comm.allreduce(&mut v, ReduceOp::Sum)?;
        let per = |a: f32| {
            if v[2] > 0.0 {
                f64::from(a / v[2])
            } else {
                f64::NAN
            }
        };
        row.insert("val_ema_loss".into(), per(v[0]));
        row.insert("val_ema_accuracy".into(), 100.0 * per(v[1]));
        if self.objective.multi_label()
            && let Some(a) = scores.gather(&self.comm)?.auroc()
        {
            row.insert("val_ema_auroc".into(), a);
        }
        Ok(())
    }
}
