//! Data parallel's files: the checkpoint of an epoch (rank 0 writes it) and the resume that
//! reads it on rank 0 and hands it to every rank over the wire.

use burn::module::Module;
use burn::store::ModuleRecord;
use burn::tensor::Bytes;

use super::Allreduce;
use crate::train::checkpoint::{Fed, model_checkpoint, save_epoch_weights, save_epoch_weights_fed};
use crate::train::ema::{Ema, ema_checkpoint};
use crate::train::epochs::Epochs;
use crate::train::model::optimizer;
use crate::train::precision::LossScaler;
use crate::train::run_dir;
use crate::train::trainee::{Net, Trainee};
use crate::{HearthError, Result};

/// `run_dir/checkpoint/optim-<epoch>.bpk`.
fn optim_checkpoint(run_dir: &std::path::Path, epoch: usize) -> std::path::PathBuf {
    run_dir
        .join("checkpoint")
        .join(format!("optim-{epoch}.bpk"))
}

impl<T: Trainee> Allreduce<'_, T> {
    /// `--resume`: rank 0 reads the last epoch with both checkpoint files (and its table) and
    /// sends epoch, weights and optimizer state to every rank; a fresh run records what it
    /// trains. Returns the epoch to start after.
    pub(super) fn resume(&mut self, epochs: &Epochs, log: &mut dyn FnMut(&str)) -> Result<usize> {
        let cfg = self.cfg;
        let hparams = cfg.hyperparameters();
        let mut state: Vec<u8> = Vec::new();
        // ZeRO stage 3: rank 0 keeps the checkpoint's weights to itself (the other ranks take
        // their segments of them from it, `start_sharding`), so they are not broadcast; it
        // loads what does not train into its skeleton and reads the trainable values from the
        // file a bucket at a time as it hands them out (never a tensor whole: VGG-16's 411 MB
        // weight).
        let stage_3 = cfg.exchange.zero == 3 && self.comm.is_some();
        let mut own_weights: Option<ModuleRecord> = None;
        if self.rank == 0 {
            if cfg.checkpoint.resume {
                let dir = cfg.run_dir.join("checkpoint");
                let parts: &[&str] = if cfg.optim.model_ema.is_some() {
                    &["model", "optim", "ema"]
                } else {
                    &["model", "optim"]
                };
                let epoch = run_dir::checkpoints_in(&dir, parts)
                    .last()
                    .copied()
                    .ok_or_else(|| {
                        HearthError::InvalidArgument(format!(
                            "cannot resume {}: no epoch in {} has all of its {} files",
                            cfg.run_dir.display(),
                            dir.display(),
                            parts.join(", ")
                        ))
                    })?;
                epochs.check_left(epoch)?;
                run_dir::check_resume_compatible(&cfg.run_dir, &self.trainee.describe(), &hparams)?;
                // What may change on a resume (`--epochs`, ...) is recorded as it is now.
                run_dir::record(&cfg.run_dir, &self.trainee.describe(), &hparams)?;
                crate::train::zero::check_resume(cfg, epoch)?;
                epochs.reload(epoch)?;
                let read = |path: std::path::PathBuf| {
                    std::fs::read(&path).map_err(|e| {
                        HearthError::Training(format!(
                            "epoch {epoch}'s checkpoint {}: {e}",
                            path.display()
                        ))
                    })
                };
                let weights = model_checkpoint(&cfg.run_dir, epoch);
                let model = match stage_3 {
                    true => {
                        let names = burn_dist::flat::module::trainable_names(self.model()?);
                        let (values, rest) = crate::train::zero::CheckpointValues::open(
                            &weights, &names,
                        )
                        .map_err(|e| HearthError::Training(format!("epoch {epoch}'s {e}")))?;
                        self.resumed_values = Some(values);
                        own_weights = Some(rest);
                        Vec::new()
                    }
                    false => read(weights)?,
                };
                let optim = read(optim_checkpoint(&cfg.run_dir, epoch))?;
                let ema = match cfg.optim.model_ema {
                    Some(_) => read(ema_checkpoint(&cfg.run_dir, epoch))?,
                    None => Vec::new(),
                };
                state = encode_state(epoch, &model, &optim, &ema);
                log(&format!("resuming after epoch {epoch}"));
            } else {
                run_dir::record(&cfg.run_dir, &self.trainee.describe(), &hparams)?;
            }
        }
        if let Some(comm) = &self.comm {
            let limit = crate::train::shared::state_limit(self.model()?.num_params());
            state = burn_dist::elastic::broadcast_bytes(comm, state, limit)?;
        }
        if self.scaler.is_some() && !state.is_empty() {
            self.scaler = Some(self.resumed_loss_scale(&state)?);
        }
        if state.is_empty() {
            // Every rank seeded the same weights; rank 0's go to all, as DDP starts (under
            // ZeRO stage 3 as the shards: `start_sharding` hands each rank its segments of
            // rank 0's values, never the whole model at once).
            let stage_3 = self.cfg.exchange.zero == 3;
            if let (Some(comm), false) = (&self.comm, stage_3) {
                let model = self.model.take().ok_or_else(super::lost_model)?;
                self.model = Some(burn_dist::ddp::broadcast_module(model, comm)?);
            }
            let model = self.model()?;
            self.ema = cfg.optim.model_ema.map(|d| Ema::new(model, d));
            return Ok(0);
        }
        let (epoch, model, optim, ema) = decode_state(&state)?;
        // Stage 3's ranks other than 0 keep their skeleton (built without values): their
        // segments come from rank 0's.
        let record = match (stage_3, own_weights) {
            (true, own) => own,
            (false, _) => Some(
                ModuleRecord::from_bytes(Bytes::from_bytes_vec(model.to_vec()))
                    .map_err(|e| HearthError::Training(format!("epoch {epoch}'s weights: {e}")))?,
            ),
        };
        if let Some(record) = record {
            let model = self.take_model()?;
            self.model = Some(model.try_load_record(record).map_err(|e| {
                HearthError::Training(format!("epoch {epoch}'s weights do not fit the model: {e}"))
            })?);
        }
        crate::device::check_burn_default(&self.device)?;
        self.optim = optimizer(self.cfg)
            .from_bytes(Bytes::from_bytes_vec(optim.to_vec()))
            .map_err(|e| HearthError::Training(format!("epoch {epoch}'s optimizer state: {e}")))?;
        if let Some(d) = cfg.optim.model_ema {
            let model = self.model()?;
            let mut average = Ema::new(model, d);
            average.load(model, ema.to_vec(), epoch)?;
            self.ema = Some(average);
        }
        Ok(epoch)
    }

    /// fp16's loss scale of the epoch the resume `state` goes on after: rank 0 reads it from
    /// the checkpoint and every rank takes it.
    fn resumed_loss_scale(&self, state: &[u8]) -> Result<LossScaler> {
        let mut text = Vec::new();
        if self.rank == 0 {
            let epoch = decode_state(state)?.0;
            let file = LossScaler::file(&self.cfg.run_dir, epoch);
            text = LossScaler::load(&file, epoch)?
                .to_json()
                .to_string()
                .into_bytes();
        }
        if let Some(comm) = &self.comm {
            // A loss scaler's JSON: a few numbers.
            text = burn_dist::elastic::broadcast_bytes(comm, text, 1 << 20)?;
        }
        serde_json::from_slice(&text)
            .ok()
            .and_then(|v| LossScaler::from_json(&v))
            .ok_or_else(|| HearthError::Training("rank 0's fp16 loss scale is malformed".into()))
    }

    /// Saves what `--resume` needs after `epoch`, keeping the weights of `best` and of the last
    /// epoch and the optimizer file of the last.
    pub(super) fn save_checkpoint(&mut self, epoch: usize, best: Option<usize>) -> Result<()> {
        // --zero: every rank's shard to rank 0 first, written before the optimizer file that
        // completes the epoch.
        if let (Some(z), Some(comm)) = (&self.zero, &self.comm) {
            crate::train::zero::save_state(&self.cfg.run_dir.join("checkpoint"), epoch, z, comm)?;
        }
        let dir = &self.cfg.run_dir;
        match self.gathering() {
            // `--zero 3`: the units gathered one at a time (every rank takes part), rank 0
            // writing each tensor as it comes.
            Some(g) => {
                let model = self.model()?;
                // Rank 0 alone reads the values: the others take part in the gathers and let
                // each tensor (each piece of a matrix cut into pieces) go at once.
                let gathered = |each: &mut dyn FnMut(u64, crate::pipeline::ReadBytes<'_>)| {
                    model
                        .gathered_tensors(&g, each)
                        .unwrap_or_else(|| Err(crate::train::net::no_units_to_gather()))
                };
                if self.rank != 0 {
                    return gathered(&mut |_, _| {});
                }
                let shape = |id: &burn::module::ParamId| g.params.shape_of(id).cloned();
                let mut feed = |send: &mut dyn FnMut(u64, Bytes) -> bool| {
                    let mut open = true;
                    gathered(&mut |id, read| open = open && send(id, read()))
                };
                let fed = Fed {
                    shape: &shape,
                    feed: &mut feed,
                };
                save_epoch_weights_fed(dir, epoch, model.clone(), &Default::default(), fed)?;
            }
            None if self.rank != 0 => return Ok(()),
            None => save_epoch_weights(dir, epoch, self.model()?.clone(), &Default::default())?,
        }
        if let Some(e) = &self.ema {
            e.save(&ema_checkpoint(dir, epoch))?;
        }
        // Written after the weights (and the average): an epoch with these files is complete.
        let path = optim_checkpoint(dir, epoch);
        let tmp = path.with_extension("bpk.tmp");
        self.optim
            .save(&tmp)
            .map_err(|e| HearthError::Training(format!("saving epoch {epoch}'s optimizer: {e}")))?;
        if let Some(s) = &self.scaler {
            // Before the optimizer file that completes the epoch.
            let file = LossScaler::file(dir, epoch);
            s.save(&file)
                .map_err(|source| HearthError::Write { path: file, source })?;
        }
        std::fs::rename(&tmp, &path).map_err(|source| HearthError::Write {
            path: path.clone(),
            source,
        })?;
        for old in 1..epoch {
            let _ = std::fs::remove_file(optim_checkpoint(dir, old));
            let _ = std::fs::remove_file(LossScaler::file(dir, old));
            if Some(old) != best {
                let _ = std::fs::remove_file(model_checkpoint(dir, old));
                let _ = std::fs::remove_file(ema_checkpoint(dir, old));
            }
        }
        Ok(())
    }
}

/// A resume's state on the wire: the epoch, the model file's bytes, the optimizer file's and
/// the weight average's (empty without `optim.model_ema`).
fn encode_state(epoch: usize, model: &[u8], optim: &[u8], ema: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 + model.len() + optim.len() + ema.len());
    out.extend_from_slice(&(epoch as u64).to_le_bytes());
    for part in [model, optim, ema] {
        out.extend_from_slice(&(part.len() as u64).to_le_bytes());
        out.extend_from_slice(part);
    }
    out
}

#[allow(clippy::type_complexity)]
fn decode_state(bytes: &[u8]) -> Result<(usize, &[u8], &[u8], &[u8])> {
    let bad = |what: &str| HearthError::Training(format!("resume state from rank 0: {what}"));
    let word = |at: usize| {
        bytes
            .get(at..at + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
            .ok_or_else(|| bad("truncated"))
    };
    let epoch = usize::try_from(word(0)?).map_err(|_| bad("an epoch past usize"))?;
    let parts = crate::train::shared::prefixed_parts(&bytes[8..], 3, "resume state from rank 0")?;
    Ok((epoch, parts[0], parts[1], parts[2]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_resume_state_round_trips_and_truncation_is_named() {
        let bytes = encode_state(7, b"model", b"optimizer", b"average");
        let (epoch, model, optim, ema) = decode_state(&bytes).unwrap();
        assert_eq!(
            (epoch, model, optim, ema),
            (7, &b"model"[..], &b"optimizer"[..], &b"average"[..])
        );
        let e = decode_state(&bytes[..bytes.len() - 1])
            .unwrap_err()
            .to_string();
        assert!(e.contains("truncated"), "{e}");
        let e = decode_state(&[1, 2]).unwrap_err().to_string();
        assert!(e.contains("resume state from rank 0"), "{e}");
    }
}
