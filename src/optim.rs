//! LARS (You, Gitman, Ginsburg 2017, "Large Batch Training of Convolutional Networks"), which
//! burn-optim lacks, as a burn-optim [`Optimizer`] usable wherever Burn's own are.
//!
//! Per parameter tensor (a layer's weight), with learning rate `lr`, trust coefficient `eta`,
//! weight decay `beta` and momentum `m`:
//!
//! ```text
//! local_lr = eta * ||w|| / (||g|| + beta * ||w|| + eps)     (1 when either norm is 0)
//! v        = m * v + lr * local_lr * (g + beta * w)
//! w        = w - v
//! ```
//!
//! One-dimensional tensors (biases, batch-norm scale and shift) are updated with plain SGD with
//! momentum and no weight decay, the usual LARS practice (`exclude_1d`).

use burn::config::Config;
use burn::optim::{LearningRate, ModuleOptimizer, Optimizer, RecordState, StateSink, StateSource};
use burn::prelude::*;

#[derive(Config, Debug)]
pub struct LarsConfig {
    #[config(default = 0.9)]
    pub momentum: f64,
    #[config(default = 0.0)]
    pub weight_decay: f64,
    /// eta in the paper.
    #[config(default = 0.001)]
    pub trust_coefficient: f64,
    #[config(default = 1e-9)]
    pub epsilon: f64,
    /// Plain SGD (no trust ratio, no weight decay) for 1-d tensors.
    #[config(default = true)]
    pub exclude_1d: bool,
}

impl LarsConfig {
    pub fn init(&self) -> ModuleOptimizer {
        ModuleOptimizer::from(Lars {
            momentum: self.momentum,
            weight_decay: self.weight_decay,
            trust: self.trust_coefficient,
            epsilon: self.epsilon,
            exclude_1d: self.exclude_1d,
        })
    }
}

#[derive(Clone, Debug)]
pub struct Lars {
    momentum: f64,
    weight_decay: f64,
    trust: f64,
    epsilon: f64,
    exclude_1d: bool,
}

/// The momentum buffer of one parameter tensor.
#[derive(Clone)]
pub struct LarsState<const D: usize> {
    pub velocity: Tensor<D>,
}

impl<const D: usize> RecordState for LarsState<D> {
    fn state_flatten(&self, prefix: &str, out: &mut StateSink) {
        out.push_tensor(prefix, "velocity", self.velocity.clone().into_data());
    }

    fn state_unflatten(prefix: &str, src: &mut StateSource, device: &Device) -> Option<Self> {
        let data = src.take_tensor(prefix, "velocity")?;
        Some(Self {
            velocity: Tensor::from_data(data, device),
        })
    }
}

fn l2(t: &Tensor<1>) -> f64 {
    t.clone().into_scalar::<f64>()
}

impl Optimizer for Lars {
    type State<const D: usize> = LarsState<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let plain = self.exclude_1d && D == 1;
        let update = if plain {
            grad.mul_scalar(lr)
        } else {
            let w_norm = l2(&tensor.clone().square().sum().sqrt());
            let g_norm = l2(&grad.clone().square().sum().sqrt());
            let local = if w_norm > 0.0 && g_norm > 0.0 {
                self.trust * w_norm / (g_norm + self.weight_decay * w_norm + self.epsilon)
            } else {
                1.0
            };
            let g = if self.weight_decay > 0.0 {
                grad + tensor.clone().mul_scalar(self.weight_decay)
            } else {
                grad
            };
            g.mul_scalar(lr * local)
        };
        let velocity = match state {
            Some(s) if self.momentum > 0.0 => s.velocity.mul_scalar(self.momentum) + update,
            _ => update,
        };
        (tensor - velocity.clone(), Some(LarsState { velocity }))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        LarsState {
            velocity: state.velocity.to_device(device),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::{Module, Param};
    use burn::optim::GradientsParams;

    #[derive(Module, Debug)]
    struct Weights {
        w: Param<Tensor<2>>,
        b: Param<Tensor<1>>,
    }

    fn values(t: Tensor<2>) -> Vec<f64> {
        t.into_data().iter::<f64>().collect()
    }

    /// One step by hand: w = diag(3, 4) (norm 5), g = diag(0.6, 0.8) (norm 1), wd 0.01,
    /// eta 0.001, lr 0.1: local = 0.001 * 5 / (1 + 0.05) and the update is
    /// 0.1 * local * (g + 0.01 w) = diag(0.0003, 0.0004).
    #[test]
    fn matches_a_hand_computed_step_then_applies_momentum() {
        let device = Device::flex().autodiff();
        let mut model = Weights {
            w: Param::from_tensor(Tensor::from_floats([[3.0, 0.0], [0.0, 4.0]], &device)),
            b: Param::from_tensor(Tensor::from_floats([1.0, -1.0], &device)),
        };
        let g = Tensor::<2>::from_floats([[0.6, 0.0], [0.0, 0.8]], &device);
        let gb = Tensor::<1>::from_floats([0.5, 0.25], &device);
        let mut optim = LarsConfig::new()
            .with_weight_decay(0.01)
            .with_momentum(0.9)
            .init();
        let step = |m: Weights, optim: &mut ModuleOptimizer| {
            let loss = (m.w.val() * g.clone()).sum() + (m.b.val() * gb.clone()).sum();
            let grads = GradientsParams::from_grads(loss.backward(), &m);
            optim.step(0.1, m, grads)
        };
        model = step(model, &mut optim);
        let w1 = values(model.w.val().inner());
        let expect = [2.9997, 0.0, 0.0, 3.9996];
        for (a, b) in w1.iter().zip(expect) {
            assert!((a - b).abs() < 1e-6, "{w1:?} vs {expect:?}");
        }
        // 1-d: plain SGD, no weight decay: b - 0.1 * gb.
        let b1: Vec<f64> = model.b.val().inner().into_data().iter::<f64>().collect();
        assert!(
            (b1[0] - 0.95).abs() < 1e-6 && (b1[1] + 1.025).abs() < 1e-6,
            "{b1:?}"
        );

        // Second step, computed independently in f64: v2 = 0.9 v1 + lr * local2 * (g + wd w1).
        let v1 = [0.0003, 0.0, 0.0, 0.0004];
        let gv = [0.6, 0.0, 0.0, 0.8];
        let wn: f64 = w1.iter().map(|x| x * x).sum::<f64>().sqrt();
        let local2 = 0.001 * wn / (1.0 + 0.01 * wn + 1e-9);
        let expect2: Vec<f64> = (0..4)
            .map(|i| w1[i] - (0.9 * v1[i] + 0.1 * local2 * (gv[i] + 0.01 * w1[i])))
            .collect();
        model = step(model, &mut optim);
        let w2 = values(model.w.val().inner());
        for (a, b) in w2.iter().zip(&expect2) {
            assert!((a - b).abs() < 1e-6, "{w2:?} vs {expect2:?}");
        }
    }

    #[test]
    fn zero_weights_fall_back_to_a_trust_ratio_of_one() {
        let lars = Lars {
            momentum: 0.0,
            weight_decay: 0.0,
            trust: 0.001,
            epsilon: 1e-9,
            exclude_1d: true,
        };
        let device = Device::flex();
        let w = Tensor::<2>::zeros([2, 2], &device);
        let g = Tensor::<2>::ones([2, 2], &device);
        let (w1, _) = lars.step(0.5, w, g, None);
        assert_eq!(values(w1), vec![-0.5; 4]);
    }
}
