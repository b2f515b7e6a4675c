//! Weight EMA (`optim.model_ema`, `--model-ema`): an exponential moving average of the
//! model's weights and batch-norm statistics, updated after every optimizer step as timm's
//! `ModelEmaV2` does (`ema = decay * ema + (1 - decay) * model`, every parameter and buffer),
//! validated beside the model every epoch (`val_ema_loss`, `val_ema_accuracy`), kept with each
//! checkpoint (`checkpoint/ema-<epoch>.bpk`) so a resume continues it exactly, and exported
//! from the best epoch as `model_ema.bpk`. Below the modes that use it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::prelude::*;
use burn::store::ModuleRecord;

use crate::{HearthError, Result};

/// The average: a model of the live one's type, on the plain device (no autodiff).
#[derive(Clone)]
pub(super) struct Ema<M> {
    pub model: M,
    decay: f64,
}

impl<M: Module> Ema<M> {
    /// Starts at the live model's weights (timm's: the EMA begins as a copy).
    pub fn new(live: &M, decay: f64) -> Self {
        Self {
            // `valid` gives fresh batch-norm state: the average never writes into the model's.
            model: live.valid(),
            decay,
        }
    }

    /// The same average with its tensors replaced by `model`'s (rank 0's statistics, say).
    pub fn with_model(self, model: M) -> Self {
        Self { model, ..self }
    }

    /// One step: every float tensor moves `1 - decay` of the way to the live model's.
    pub fn update(&mut self, live: &M) {
        struct Collect(HashMap<ParamId, Tensor<1>>);
        impl ModuleVisitor for Collect {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let t = param.val();
                let n = t.shape().num_elements();
                self.0.insert(param.id, t.reshape([n]));
            }
        }
        struct Lerp {
            live: HashMap<ParamId, Tensor<1>>,
            decay: f32,
        }
        impl ModuleMapper for Lerp {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let Some(live) = self.live.remove(&param.id) else {
                    return param;
                };
                let decay = self.decay;
                param.map(|ema| {
                    let shape = ema.shape();
                    let live = live.reshape(shape).to_device(&ema.device());
                    ema.mul_scalar(decay) + live.mul_scalar(1.0 - decay)
                })
            }
        }
        let mut collect = Collect(HashMap::new());
        live.valid().visit(&mut collect);
        let mut lerp = Lerp {
            live: collect.0,
            decay: self.decay as f32,
        };
        self.model = self.model.clone().map(&mut lerp);
    }

    /// The average as a checkpoint file's bytes (what [`Self::load`] reads).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        self.model
            .clone()
            .into_record()
            .into_bytes()
            .map(|b| b.to_vec())
            .map_err(|e| HearthError::Training(format!("serialising the weight average: {e}")))
    }

    /// The average as a checkpoint file's bytes would hold it.
    pub fn save(&self, path: &Path) -> Result<()> {
        let tmp = super::gate::Gate::temp_for(path);
        if let Err(e) = self.model.clone().into_record().save(&tmp) {
            let _ = std::fs::remove_file(&tmp);
            return Err(HearthError::Training(format!(
                "saving the weight average {}: {e}",
                path.display()
            )));
        }
        std::fs::rename(&tmp, path).map_err(|source| HearthError::Write {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Replaces the average by a checkpoint's (`bytes` of an `ema-<epoch>.bpk`), on the shape
    /// of `live`.
    pub fn load(&mut self, live: &M, bytes: Vec<u8>, epoch: usize) -> Result<()> {
        let record = ModuleRecord::from_bytes(burn::tensor::Bytes::from_bytes_vec(bytes))
            .map_err(|e| HearthError::Training(format!("epoch {epoch}'s weight average: {e}")))?;
        self.model = live.valid().try_load_record(record).map_err(|e| {
            HearthError::Training(format!(
                "epoch {epoch}'s weight average does not fit the model: {e}"
            ))
        })?;
        Ok(())
    }
}

/// `run_dir/checkpoint/ema-<epoch>.bpk`.
pub(super) fn ema_checkpoint(run_dir: &Path, epoch: usize) -> PathBuf {
    run_dir.join("checkpoint").join(format!("ema-{epoch}.bpk"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};

    #[derive(Module, Debug)]
    struct Net {
        linear: Linear,
        norm: BatchNorm,
    }

    fn values<M: Module>(m: &M) -> Vec<Vec<f32>> {
        struct All(Vec<Vec<f32>>);
        impl ModuleVisitor for All {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                self.0
                    .push(param.val().into_data().try_to_vec::<f32>().unwrap());
            }
        }
        let mut all = All(Vec::new());
        m.visit(&mut all);
        all.0
    }

    /// After a step the average is `decay` of itself and `1 - decay` of the model, in every
    /// weight and batch-norm statistic; the model itself is untouched (its statistics live in
    /// shared cells, which the average must not write into); a saved average loads back.
    #[test]
    fn a_step_moves_every_tensor_by_one_minus_decay_and_leaves_the_model_alone() {
        let device = Device::flex();
        let net = Net {
            linear: LinearConfig::new(3, 2).init(&device),
            norm: BatchNormConfig::new(2).init(&device),
        };
        let mut ema = Ema::new(&net, 0.75);
        let start = values(&net);
        // The model moves: every tensor plus one, batch-norm statistics included (mapped in
        // their shared cells, as a training step updates them).
        struct Shift;
        impl ModuleMapper for Shift {
            fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
                p.map(|t| t.add_scalar(1.0))
            }
        }
        let moved = net.clone().map(&mut Shift);
        let after = values(&moved);
        assert_ne!(after, start);
        ema.update(&moved);
        let got = values(&ema.model);
        for ((g, s), a) in got.iter().zip(&start).zip(&after) {
            for ((g, s), a) in g.iter().zip(s).zip(a) {
                assert!(
                    (g - (0.75 * s + 0.25 * a)).abs() < 1e-6,
                    "{g} vs {s} -> {a}"
                );
            }
        }
        assert_eq!(values(&moved), after, "the model is left as it was");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ema-1.bpk");
        ema.save(&path).unwrap();
        let mut back = Ema::new(&moved, 0.75);
        back.load(&moved, std::fs::read(&path).unwrap(), 1).unwrap();
        assert_eq!(values(&back.model), got);
        let e = back
            .load(&moved, b"not a burnpack".to_vec(), 3)
            .unwrap_err()
            .to_string();
        assert!(e.contains("epoch 3's weight average"), "{e}");
    }
}
