//! VGG as in torchvision (`torchvision.models.vgg`), with and without batch norm.
//!
//! torchvision keeps the convolutions, batch norms, ReLUs and pools in one `nn.Sequential`
//! (`features.0`, `features.1`, ...) and the classifier in another (`classifier.0/3/6`). Here
//! each convolution and its optional batch norm form one [`VggConv`] (`features.{j}.conv`,
//! `features.{j}.bn`), and the classifier's linear layers are `fc1`/`fc2`/`fc3`.
//! [`Vgg::torchvision_remaps`] gives the exact key mapping for a configuration.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::conv::Conv2d;
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig, MaxPool2d, MaxPool2dConfig};
use burn::nn::{BatchNorm, Dropout, DropoutConfig, Initializer, Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::activation::relu;

use crate::ModelError;
use crate::layers::{HeadActivation, batch_norm, conv2d};

/// One entry of torchvision's VGG `cfgs`: a 3x3 convolution to this many channels, or a 2x2
/// max pool (`"M"`).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum VggLayer {
    Conv(usize),
    Pool,
}

/// Configuration of a [`Vgg`]; the defaults are torchvision's.
#[derive(Config, Debug)]
pub struct VggConfig {
    pub layers: Vec<VggLayer>,
    pub batch_norm: bool,
    pub num_classes: usize,
    /// Width of the two hidden classifier layers (torchvision: 4096).
    #[config(default = 4096)]
    pub hidden: usize,
    /// Side of the adaptive average pool before the classifier (torchvision: 7).
    #[config(default = 7)]
    pub pool_size: usize,
    #[config(default = 0.5)]
    pub dropout: f64,
}

fn cfg(spec: &[usize]) -> Vec<VggLayer> {
    // 0 stands for "M" in these tables.
    spec.iter()
        .map(|&c| {
            if c == 0 {
                VggLayer::Pool
            } else {
                VggLayer::Conv(c)
            }
        })
        .collect()
}

const A: &[usize] = &[64, 0, 128, 0, 256, 256, 0, 512, 512, 0, 512, 512, 0];
const B: &[usize] = &[
    64, 64, 0, 128, 128, 0, 256, 256, 0, 512, 512, 0, 512, 512, 0,
];
const D: &[usize] = &[
    64, 64, 0, 128, 128, 0, 256, 256, 256, 0, 512, 512, 512, 0, 512, 512, 512, 0,
];
const E: &[usize] = &[
    64, 64, 0, 128, 128, 0, 256, 256, 256, 256, 0, 512, 512, 512, 512, 0, 512, 512, 512, 512, 0,
];

impl VggConfig {
    pub fn vgg11(num_classes: usize, batch_norm: bool) -> Self {
        Self::new(cfg(A), batch_norm, num_classes)
    }
    pub fn vgg13(num_classes: usize, batch_norm: bool) -> Self {
        Self::new(cfg(B), batch_norm, num_classes)
    }
    pub fn vgg16(num_classes: usize, batch_norm: bool) -> Self {
        Self::new(cfg(D), batch_norm, num_classes)
    }
    pub fn vgg19(num_classes: usize, batch_norm: bool) -> Self {
        Self::new(cfg(E), batch_norm, num_classes)
    }

    pub(crate) fn validate(&self) -> crate::Result<usize> {
        let bad = |reason: &str| ModelError::InvalidConfig {
            model: "VGG",
            reason: reason.to_string(),
        };
        if self.num_classes == 0 || self.hidden == 0 || self.pool_size == 0 {
            return Err(bad("num_classes, hidden and pool_size must be positive"));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(bad("dropout must be in [0, 1)"));
        }
        let mut channels = 0;
        for layer in &self.layers {
            match layer {
                VggLayer::Conv(0) => return Err(bad("a convolution needs at least 1 channel")),
                VggLayer::Conv(c) => channels = *c,
                VggLayer::Pool => {}
            }
        }
        if channels == 0 {
            return Err(bad("the feature config has no convolution"));
        }
        Ok(channels)
    }

    pub fn init(&self, device: &Device) -> crate::Result<Vgg> {
        let last_channels = self.validate()?;
        let mut features = Vec::new();
        let mut pool_after = Vec::new();
        let mut in_ch = 3;
        for layer in &self.layers {
            match *layer {
                VggLayer::Conv(out) => {
                    features.push(VggConv {
                        conv: conv2d(in_ch, out, 3, 1, 1, 1, true, true, device),
                        bn: self.batch_norm.then(|| batch_norm(out, device)),
                    });
                    pool_after.push(false);
                    in_ch = out;
                }
                VggLayer::Pool => {
                    if let Some(last) = pool_after.last_mut() {
                        *last = true;
                    }
                }
            }
        }
        Ok(Vgg {
            features,
            pool_after,
            leading_pool: self.layers.first() == Some(&VggLayer::Pool),
            maxpool: MaxPool2dConfig::new([2, 2]).with_strides([2, 2]).init(),
            avgpool: AdaptiveAvgPool2dConfig::new([self.pool_size, self.pool_size]).init(),
            classifier: self.classifier(last_channels, device),
            head: HeadActivation::Softmax,
        })
    }

    /// torchvision's classifier after `last_channels` feature maps: every layer N(0, 0.01) with
    /// zero bias (a head built later by `replace_head` uses the init it is given instead).
    pub(crate) fn classifier(&self, last_channels: usize, device: &Device) -> VggClassifier {
        let flat = last_channels * self.pool_size * self.pool_size;
        let normal = |d_in, d_out| {
            let mut l = LinearConfig::new(d_in, d_out)
                .with_initializer(Initializer::Normal {
                    mean: 0.0,
                    std: 0.01,
                })
                .init(device);
            l.bias = Some(Param::from_tensor(Tensor::zeros([d_out], device)));
            l
        };
        // fc3 first: the order torchvision-seeded runs have always drawn in.
        let fc3 = normal(self.hidden, self.num_classes);
        VggClassifier {
            fc1: normal(flat, self.hidden),
            fc2: normal(self.hidden, self.hidden),
            fc3,
            dropout: DropoutConfig::new(self.dropout).init(),
        }
    }
}

/// A 3x3 convolution (padding 1) and, in the `_bn` variants, its batch norm.
#[derive(Module, Debug)]
pub struct VggConv {
    pub conv: Conv2d,
    pub bn: Option<BatchNorm>,
}

/// torchvision's VGG classifier: Linear, ReLU, Dropout, Linear, ReLU, Dropout, Linear.
#[derive(Module, Debug)]
pub struct VggClassifier {
    pub fc1: Linear,
    pub fc2: Linear,
    pub fc3: Linear,
    pub dropout: Dropout,
}

/// VGG (Simonyan and Zisserman 2014), torchvision's architecture.
#[derive(Module, Debug)]
pub struct Vgg {
    pub features: Vec<VggConv>,
    /// Whether a 2x2 max pool follows convolution `i`.
    #[module(skip)]
    pub pool_after: Vec<bool>,
    /// A max pool before the first convolution (a config starting with "M").
    #[module(skip)]
    pub leading_pool: bool,
    pub maxpool: MaxPool2d,
    pub avgpool: AdaptiveAvgPool2d,
    pub classifier: VggClassifier,
    #[module(skip)]
    pub head: HeadActivation,
}

impl Vgg {
    /// The output of `features` (before the adaptive pool).
    pub fn features(&self, x: Tensor<4>) -> Tensor<4> {
        let mut x = if self.leading_pool {
            hearth_kernels::pool::max_pool(&self.maxpool, x)
        } else {
            x
        };
        for (layer, &pool) in self.features.iter().zip(&self.pool_after) {
            x = hearth_kernels::conv2d(&layer.conv, x);
            x = match &layer.bn {
                Some(bn) => hearth_kernels::norm::batch_norm(bn, x, true),
                None => relu(x),
            };
            if pool {
                x = hearth_kernels::pool::max_pool(&self.maxpool, x);
            }
        }
        x
    }

    /// The input of the last linear layer (after fc2, its ReLU and dropout): `[batch, hidden]`.
    pub fn embed(&self, x: Tensor<4>) -> Tensor<2> {
        let c = &self.classifier;
        let x = self.avgpool.forward(self.features(x)).flatten(1, 3);
        let x = c.dropout.forward(relu(hearth_kernels::linear(&c.fc1, x)));
        c.dropout.forward(relu(hearth_kernels::linear(&c.fc2, x)))
    }

    pub fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        hearth_kernels::linear(&self.classifier.fc3, self.embed(x))
    }

    /// Exact key renames from torchvision's sequential indices to this module.
    pub fn torchvision_remaps(&self) -> Vec<(String, String)> {
        let mut remaps = Vec::new();
        // Walk torchvision's nn.Sequential: conv, [bn], relu, then "M" if a pool follows.
        let mut index = usize::from(self.leading_pool);
        for (j, (layer, &pool)) in self.features.iter().zip(&self.pool_after).enumerate() {
            remaps.push((
                format!(r"^features\.{index}\.(weight|bias)$"),
                format!("features.{j}.conv.$1"),
            ));
            index += 1;
            if layer.bn.is_some() {
                remaps.push((
                    format!(r"^features\.{index}\.(weight|bias|running_mean|running_var|num_batches_tracked)$"),
                    format!("features.{j}.bn.$1"),
                ));
                index += 1;
            }
            index += 1; // ReLU
            if pool {
                index += 1;
            }
        }
        for (from, to) in [(0, "fc1"), (3, "fc2"), (6, "fc3")] {
            remaps.push((
                format!(r"^classifier\.{from}\."),
                format!("classifier.{to}."),
            ));
        }
        remaps
    }

    /// The way back: this network's parameter paths to torchvision's `nn.Sequential` indices
    /// ([`crate::export::export_torchvision`]).
    pub fn torchvision_export_remaps(&self) -> Vec<(String, String)> {
        let mut remaps = Vec::new();
        let mut index = usize::from(self.leading_pool);
        for (j, (layer, &pool)) in self.features.iter().zip(&self.pool_after).enumerate() {
            remaps.push((
                format!(r"^features\.{j}\.conv\."),
                format!("features.{index}."),
            ));
            index += 1;
            if layer.bn.is_some() {
                remaps.push((
                    format!(r"^features\.{j}\.bn\."),
                    format!("features.{index}."),
                ));
                index += 1;
            }
            index += 1 + usize::from(pool);
        }
        for (to, from) in [(0, "fc1"), (3, "fc2"), (6, "fc3")] {
            remaps.push((
                format!(r"^classifier\.{from}\."),
                format!("classifier.{to}."),
            ));
        }
        remaps
    }
}
