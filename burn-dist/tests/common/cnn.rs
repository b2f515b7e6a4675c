//! The small CNN the pipeline and segmented-backward tests split: 3x4x4 inputs, 4-channel
//! 3x3 convolutions with ReLU, and a linear head, each a [`PipelineStage`] of its own.

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{Linear, LinearConfig, PaddingConfig2d};
use burn::prelude::*;
use burn::tensor::TensorData;
use burn::tensor::activation::relu;
use burn_dist::pipeline::{Activation, PipelineStage};

/// Images per micro-batch.
pub const MB: usize = 2;

#[derive(Module, Debug)]
pub struct Conv {
    pub conv: Conv2d,
}

#[derive(Module, Debug)]
pub struct Head {
    pub fc: Linear,
}

/// A stage of the test network.
#[derive(Module, Debug)]
pub enum Part {
    Conv(Conv),
    Head(Head),
}

impl Part {
    pub fn apply(&self, x: Activation) -> burn_dist::Result<Activation> {
        Ok(match self {
            Part::Conv(c) => Activation::Rank4(relu(c.conv.forward(x.rank4("conv")?))),
            Part::Head(h) => {
                let x = x.rank4("head")?;
                let [n, c, hh, w] = x.dims();
                Activation::Rank2(h.fc.forward(x.reshape([n, c * hh * w])))
            }
        })
    }
}

impl PipelineStage for Part {
    fn forward(&self, x: Activation) -> burn_dist::Result<Activation> {
        self.apply(x)
    }
}

/// The network's stages: `convs` convolutions (3->4, then 4->4 channels) and the head.
pub fn parts(convs: usize, device: &Device) -> Vec<Part> {
    let mut v: Vec<Part> = (0..convs)
        .map(|i| {
            let cin = if i == 0 { 3 } else { 4 };
            Part::Conv(Conv {
                conv: Conv2dConfig::new([cin, 4], [3, 3])
                    .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                    .init(device),
            })
        })
        .collect();
    v.push(Part::Head(Head {
        fc: LinearConfig::new(4 * 4 * 4, 3).init(device),
    }));
    v
}

/// Micro-batch `m` of step `s`: inputs `[MB, 3, 4, 4]` and targets `[MB, 3]`.
pub fn micro(s: usize, m: usize, device: &Device) -> (Tensor<4>, Tensor<2>) {
    let x: Vec<f32> = (0..MB * 48)
        .map(|i| (((s * 97 + m * 31 + i * 7) % 19) as f32 - 9.0) / 9.0)
        .collect();
    let y: Vec<f32> = (0..MB * 3)
        .map(|i| (((s * 13 + m * 5 + i * 3) % 7) as f32 - 3.0) / 3.0)
        .collect();
    (
        Tensor::from_data(TensorData::new(x, [MB, 3, 4, 4]), device),
        Tensor::from_data(TensorData::new(y, [MB, 3]), device),
    )
}

pub fn mse(out: Tensor<2>, target: Tensor<2>) -> Tensor<1> {
    (out - target).powi_scalar(2).mean()
}

/// Held by every test for its whole run: the backend's random stream is the process's (and
/// parameters initialise lazily, at their first forward), and a test that reseeds it and must see only its own draws.
static RANDOM: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub fn random_lock() -> std::sync::MutexGuard<'static, ()> {
    RANDOM.lock().unwrap_or_else(|e| e.into_inner())
}

/// Each tensor of `a` within `tol` (relative, plus an absolute `tol`) of `b`'s.
pub fn assert_close(what: &str, a: &[Vec<f32>], b: &[Vec<f32>], tol: f32) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.len(), y.len(), "{what}: tensor {i}");
        for (u, v) in x.iter().zip(y) {
            assert!(
                (u - v).abs() <= tol * (1.0 + v.abs()),
                "{what}: tensor {i}: {u} against {v}"
            );
        }
    }
}

/// One backward through the whole chain: the reference for the segmented ones.
pub fn whole_backward(model: &[Part], x: Tensor<4>, y: Tensor<2>) -> burn::optim::GradientsParams {
    let mut a = Activation::Rank4(x);
    for part in model {
        a = part.apply(a).unwrap();
    }
    let grads = mse(a.rank2("out").unwrap(), y).backward();
    burn::optim::GradientsParams::from_grads(grads, &model.to_vec())
}
