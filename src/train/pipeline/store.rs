//! A pipeline run's files: each stage's checkpoints (replica 0 writes them), the epoch every
//! stage can resume from, and the export that assembles the stages into `model.bpk`.

use super::*;
use files::{
    complete_pipeline_checkpoints, ema_file, loss_scale_file, model_file, optim_file, stage_dir,
    stage_epochs,
};

impl PipelineRun<'_> {
    /// The last epoch every stage has a complete checkpoint of, agreed by all ranks (each sees
    /// its own disk).
    /// This stage's model and optimizer state of `epoch`'s checkpoint.
    pub(super) fn load_checkpoint(
        &self,
        model: StageModel,
        optim: ModuleOptimizer,
        epoch: usize,
    ) -> Result<(StageModel, ModuleOptimizer)> {
        let fail =
            |e: String| HearthError::Training(format!("stage {} epoch {epoch}: {e}", self.stage));
        let record = ModuleRecord::load(model_file(&self.cfg.run_dir, self.stage, epoch))
            .map_err(|e| fail(e.to_string()))?;
        let optim_record = OptimizerRecord::load(optim_file(&self.cfg.run_dir, self.stage, epoch))
            .map_err(|e| fail(e.to_string()))?;
        crate::device::check_burn_default(&self.device)?;
        Ok((model.load_record(record), optim.load_record(optim_record)))
    }

    /// fp16's loss scale saved with `epoch`'s checkpoint of this stage.
    pub(super) fn load_loss_scale(&self, epoch: usize) -> Result<LossScaler> {
        LossScaler::load(
            &loss_scale_file(&self.cfg.run_dir, self.stage, epoch),
            epoch,
        )
    }

    pub(super) fn agreed_resume_epoch(&self) -> Result<usize> {
        let mine = complete_pipeline_checkpoints(&self.cfg.run_dir, self.grid.stages)
            .last()
            .copied()
            .unwrap_or(0);
        // The smallest over the ranks (exact in f32 for epoch counts).
        let all = self.comm.all_gather(&[mine as f32])?;
        let epoch = all.into_iter().fold(f32::MAX, f32::min) as usize;
        if epoch == 0 {
            return Err(HearthError::InvalidArgument(format!(
                "`checkpoint.resume`: {} has no epoch checkpointed by every pipeline stage",
                self.cfg.run_dir.display()
            )));
        }
        Ok(epoch)
    }

    /// Replica 0 of each stage writes its part of `epoch` and keeps only the best and the last
    /// epochs.
    pub(super) fn checkpoint(
        &self,
        model: &StageModel,
        optim: &ModuleOptimizer,
        scaler: Option<&LossScaler>,
        epoch: usize,
        best: Option<usize>,
    ) -> Result<()> {
        if self.replica == 0 {
            let dir = stage_dir(&self.cfg.run_dir, self.stage);
            std::fs::create_dir_all(&dir).map_err(|source| HearthError::Write {
                path: dir.clone(),
                source,
            })?;
            let fail = |what: &str, e: String| {
                HearthError::Training(format!(
                    "saving stage {}'s {what} of epoch {epoch}: {e}",
                    self.stage
                ))
            };
            // Loss scale and optimizer first: a model file is the sign that the epoch's files
            // are complete.
            if let Some(s) = scaler {
                let file = loss_scale_file(&self.cfg.run_dir, self.stage, epoch);
                s.save(&file)
                    .map_err(|e| fail("fp16 loss scale", e.to_string()))?;
            }
            optim
                .to_record()
                .save(optim_file(&self.cfg.run_dir, self.stage, epoch))
                .map_err(|e| fail("optimizer state", e.to_string()))?;
            if let Some(e) = self.ema.borrow().as_ref() {
                e.save(&ema_file(&self.cfg.run_dir, self.stage, epoch))?;
            }
            // The record holds batch norm's latest statistics, not the ones a step behind.
            burn_dist::ddp::sync_running_stats(model);
            model
                .clone()
                .into_record()
                .save(model_file(&self.cfg.run_dir, self.stage, epoch))
                .map_err(|e| fail("weights", e.to_string()))?;
            for old in stage_epochs(&self.cfg.run_dir, self.stage)
                .into_iter()
                .filter(|&e| e != epoch && Some(e) != best)
            {
                let _ = std::fs::remove_file(model_file(&self.cfg.run_dir, self.stage, old));
                let _ = std::fs::remove_file(optim_file(&self.cfg.run_dir, self.stage, old));
                let _ = std::fs::remove_file(loss_scale_file(&self.cfg.run_dir, self.stage, old));
                let _ = std::fs::remove_file(ema_file(&self.cfg.run_dir, self.stage, old));
            }
        }
        // Every stage's files exist before any rank goes on (and before a resume could look).
        self.comm.barrier()?;
        Ok(())
    }

    /// The export: `model.bpk` assembled from the best epoch's stages (their weight average's
    /// where `checkpoint.monitor` reads the average), and with `optim.model_ema`
    /// `model_ema.bpk` from their averages. Returns the model on rank 0.
    pub(super) fn export(
        &self,
        best: usize,
        log: &mut dyn FnMut(&str),
    ) -> Result<Option<Classifier>> {
        let averaged = self.cfg.checkpoint.monitor.averaged();
        let source = if averaged { ema_file } else { model_file };
        let model = self.assemble(best, source, 0, "model.bpk", log)?;
        if self.cfg.optim.model_ema.is_some() {
            self.assemble(best, ema_file, 1, "model_ema.bpk", log)?;
        }
        Ok(model)
    }

    /// Replica 0 of every stage sends its best-epoch part (`file` of the stage and epoch) to
    /// rank 0, which assembles the whole model and writes `run_dir/name`; `round` keeps each
    /// assembly's messages apart. Returns the model on rank 0.
    fn assemble(
        &self,
        best: usize,
        file: fn(&std::path::Path, usize, usize) -> std::path::PathBuf,
        round: u64,
        name: &str,
        log: &mut dyn FnMut(&str),
    ) -> Result<Option<Classifier>> {
        let transport = self.comm.transport().clone();
        let tag = |stage: usize, tensor: usize, chunk: usize| {
            ((stage as u64) << 48) | (round << 44) | ((tensor as u64) << 20) | chunk as u64
        };
        let load = |stage: usize| -> Result<StageModel> {
            let units = self
                .config
                .init_units(self.ranges[stage].clone(), &self.plain_device)?;
            let record = ModuleRecord::load(file(&self.cfg.run_dir, stage, best)).map_err(|e| {
                HearthError::Training(format!(
                    "the best epoch's ({best}) checkpoint of stage {stage} for {name}: {e}"
                ))
            })?;
            Ok(StageModel::new(units).load_record(record))
        };
        let rank = self.comm.rank();
        if self.replica == 0 && rank != 0 {
            for (t, values) in module_values(&load(self.stage)?).into_iter().enumerate() {
                for (c, chunk) in values.chunks(EXPORT_CHUNK).enumerate() {
                    transport.send(
                        0,
                        Kind::User,
                        tag(self.stage, t, c),
                        burn_dist::wire::f32_to_bytes(chunk),
                    )?;
                }
            }
            return Ok(None);
        }
        if rank != 0 {
            return Ok(None);
        }
        let mut units = load(0)?.units;
        for stage in 1..self.grid.stages {
            let from = self.grid.pipeline(0)[stage];
            let empty = StageModel::new(
                self.config
                    .init_units(self.ranges[stage].clone(), &self.plain_device)?,
            );
            let mut values = module_values(&empty);
            for (t, v) in values.iter_mut().enumerate() {
                let mut at = 0;
                for c in 0..v.len().div_ceil(EXPORT_CHUNK) {
                    let bytes = transport.recv(
                        from,
                        Kind::User,
                        tag(stage, t, c),
                        Instant::now() + collective_timeout(),
                    )?;
                    let expect = (v.len() - at).min(EXPORT_CHUNK);
                    let piece = burn_dist::wire::bytes_to_f32(&bytes, expect).map_err(|e| {
                        HearthError::Training(format!("stage {stage}'s tensor {t} at export: {e}"))
                    })?;
                    v[at..at + expect].copy_from_slice(&piece);
                    at += expect;
                }
            }
            units.extend(with_module_values(empty, values)?.units);
        }
        let mut model = Classifier::from_units(&self.config, units)?;
        if self.objective.multi_label() {
            // The activation is no parameter: the stages' units carry the default one.
            model = model.with_head_activation(HeadActivation::Sigmoid);
        }
        save_model_with(
            &model,
            &self.config,
            Some(&self.classes),
            Some(&Preprocessing::eval(self.cfg.data.image_size)),
            &self.cfg.run_dir.join(name),
        )?;
        log(&format!(
            "exported the best epoch ({best}, by {}) assembled from {} stages into {}",
            self.cfg.checkpoint.monitor.column(),
            self.grid.stages,
            self.cfg.run_dir.join(name).display()
        ));
        Ok(Some(model))
    }
}
