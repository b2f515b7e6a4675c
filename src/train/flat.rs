//! The run's optimizer as a loop over a flat vector of the model's trainable values
//! (burn-dist's [`ShardOptimizer`]), for the modes that hold the values apart from a Burn
//! optimizer: the parameter servers (`ps`: a server's shard, a worker's local steps) and data
//! parallel's sharded optimizer (`--zero`). The arithmetic is burn-optim's and Hearth's LARS,
//! operation for operation (the tests below hold the two side by side).

use std::ops::Range;
use std::sync::Arc;

use burn::module::Module;
use burn_dist::flat::module::{matrix_ranges, trainable_extents, trainable_names};
use burn_dist::flat::optim::{ShardOptimizer, Update};

use super::{OptimizerKind, TrainConfig};
use crate::Result;

/// The run's optimizer and schedule over a flat vector (a server's shard, or a worker's whole
/// vector for its local steps): `decay` the ranges weight decay applies to, the rate by the
/// number of optimizer steps before (an epoch of `batches_per_epoch` loader batches has
/// [`TrainConfig::optimizer_steps`] of them: a K-th with `--grad-accum K`).
pub(super) fn flat_optimizer(
    cfg: &TrainConfig,
    lr: f64,
    batches_per_epoch: usize,
    decay: Vec<Range<usize>>,
) -> Result<ShardOptimizer> {
    let update = match cfg.optim.optimizer {
        OptimizerKind::Sgd => Update::Sgd {
            momentum: cfg.momentum() as f32,
            nesterov: cfg.optim.nesterov,
        },
        OptimizerKind::Adam => Update::adam(),
        OptimizerKind::AdamW => Update::adamw(),
        // hearth::optim::LarsConfig's constants (trust 0.001, epsilon 1e-9, 1-d tensors plain):
        // a shard gets each tensor's whole norms from the caller (burn-dist's zero).
        OptimizerKind::Lars => {
            let l = crate::optim::LarsConfig::new();
            Update::Lars {
                momentum: cfg.momentum() as f32,
                trust: l.trust_coefficient as f32,
                epsilon: l.epsilon as f32,
                exclude_1d: l.exclude_1d,
            }
        }
    };
    // The schedule counts optimizer steps, as burn-train's does.
    let schedule = Arc::new(cfg.lr_schedule(lr, batches_per_epoch)?);
    Ok(ShardOptimizer {
        update,
        weight_decay: cfg.optim.weight_decay as f32,
        decay,
        lr: Arc::new(move |step| schedule.lr_at(step as usize) as f32),
        tensors: Vec::new(),
        origin: 0,
        born: Vec::new(),
    })
}

/// The value ranges of `model`'s trainable vector that weight decay applies to: the weights of
/// layers (as data parallel's optimizer), or everything for AdamW (Burn's decays every tensor).
pub(super) fn decay_ranges<M: Module>(cfg: &TrainConfig, model: &M) -> Vec<Range<usize>> {
    if cfg.optim.optimizer == OptimizerKind::AdamW {
        let total: usize = trainable_names(model).iter().map(|t| t.1).sum();
        return std::iter::once(0..total).collect();
    }
    matrix_ranges(model)
}

/// [`flat_optimizer`] for the whole trainable vector of `model`: its decay ranges and, for
/// LARS, its tensors' extents.
pub(super) fn model_optimizer<M: Module>(
    cfg: &TrainConfig,
    lr: f64,
    batches_per_epoch: usize,
    model: &M,
) -> Result<ShardOptimizer> {
    let mut o = flat_optimizer(cfg, lr, batches_per_epoch, decay_ranges(cfg, model))?;
    o.tensors = trainable_extents(model);
    Ok(o)
}

#[cfg(test)]
mod tests {
    use burn::module::Module;
    use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
    use burn::optim::GradientsParams;
    use burn::prelude::*;
    use burn_dist::flat::module::{trainable_grads, trainable_values};

    use super::*;

    #[derive(Module, Debug)]
    struct Net {
        fc: Linear,
        bn: BatchNorm,
        out: Linear,
    }

    impl Net {
        fn forward(&self, x: Tensor<2>) -> Tensor<2> {
            let h = self.fc.forward(x);
            let h = self.bn.forward(h.unsqueeze_dim::<3>(2)).squeeze_dim::<2>(2);
            self.out.forward(burn::tensor::activation::relu(h))
        }
    }

    #[test]
    fn the_flat_optimizer_follows_the_runs_schedule() {
        let mut cfg = TrainConfig::new("unused".into());
        cfg.epochs = 4;
        cfg.optim.warmup_epochs = 1;
        cfg.optim.lr = 0.4;
        let o = flat_optimizer(&cfg, cfg.optim.lr, 10, std::iter::once(0..2).collect()).unwrap();
        let s = cfg.lr_schedule(cfg.optim.lr, 10).unwrap();
        for step in [0u64, 3, 9, 10, 25, 39] {
            assert_eq!(o.lr_at(step), s.lr_at(step as usize) as f32, "step {step}");
        }
        assert!(o.lr_at(0) < o.lr_at(9), "warmup rises");
        assert!(o.lr_at(39) < o.lr_at(10), "cosine decays");
        assert_eq!(
            o.update,
            Update::Sgd {
                momentum: 0.9,
                nesterov: false
            }
        );
    }

    /// Every optimizer Hearth offers, three steps on a small network with weight decay: the flat
    /// loop ends where burn-optim's (and Hearth's LARS) end, the decay on the same tensors.
    #[test]
    fn the_flat_optimizers_equal_the_burn_optimizers_of_data_parallel() {
        let device = Device::flex().autodiff();
        for kind in [
            OptimizerKind::Sgd,
            OptimizerKind::Adam,
            OptimizerKind::AdamW,
            OptimizerKind::Lars,
        ] {
            for nesterov in [false, true] {
                if nesterov && kind != OptimizerKind::Sgd {
                    continue;
                }
                let mut cfg = TrainConfig::new("unused".into());
                cfg.optim.optimizer = kind;
                cfg.optim.nesterov = nesterov;
                cfg.optim.weight_decay = 0.01;
                let lr = 0.05;
                let net = Net {
                    fc: LinearConfig::new(5, 4).init(&device),
                    bn: BatchNormConfig::new(4).init(&device),
                    out: LinearConfig::new(4, 3).init(&device),
                };
                let flat_opt = model_optimizer(&cfg, lr, 1, &net).unwrap();
                let mut burn_opt = super::super::model::optimizer(&cfg);
                let mut ours = trainable_values(&net);
                let mut state = Vec::new();
                let mut theirs = net;
                for step in 0..3u64 {
                    let x = Tensor::<2>::from_data(
                        TensorData::new(
                            (0..20)
                                .map(|i| ((i * 7 + step as usize) % 11) as f32 / 5.0 - 1.0)
                                .collect::<Vec<_>>(),
                            [4, 5],
                        ),
                        &device,
                    );
                    // Both take the gradient at burn's current values, which the flat loop
                    // tracks (checked below).
                    let loss = theirs.forward(x).powf_scalar(2.0).mean();
                    let grads = GradientsParams::from_grads(loss.backward(), &theirs);
                    let g = trainable_grads(&theirs, &grads);
                    let before = ours.clone();
                    flat_opt.step_at(step, lr as f32, &mut ours, &g, &mut state, None);
                    theirs = burn_opt.step(burn::optim::LearningRate::from(lr), theirs, grads);
                    let now = trainable_values(&theirs);
                    // The moves compared, not only the values: LARS's are small.
                    let mut moved = 0.0f32;
                    for (i, ((a, b), p)) in ours.iter().zip(&now).zip(&before).enumerate() {
                        let (da, db) = (a - p, b - p);
                        moved = moved.max(db.abs());
                        assert!(
                            (da - db).abs() <= 2e-3 * db.abs() + 2e-7,
                            "{kind:?} nesterov {nesterov} step {step} value {i}: flat moved {da}, burn {db}"
                        );
                    }
                    assert!(moved > 1e-6, "{kind:?}: nothing moved");
                    ours = now;
                }
            }
        }
    }
}
