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
