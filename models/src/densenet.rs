//! DenseNet-BC as in torchvision (`torchvision.models.densenet`).
//!
//! torchvision names blocks `features.denseblock{i}.denselayer{j}` and transitions
//! `features.transition{i}` (1-based); here they are `features.blocks.{i-1}.layers.{j-1}` and
//! `features.transitions.{i-1}` ([`DenseNet::torchvision_remaps`]). The old checkpoint key
//! style `norm.1` / `conv.2` (torchvision's published DenseNet files) is accepted too.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::conv::Conv2d;
use burn::nn::pool::{
    AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig, AvgPool2d, AvgPool2dConfig, MaxPool2d,
    MaxPool2dConfig,
};
use burn::nn::{BatchNorm, Dropout, DropoutConfig, Linear, PaddingConfig2d};
use burn::prelude::*;
use burn::tensor::activation::relu;

use crate::ModelError;
use crate::layers::{HeadActivation, HeadConfig, batch_norm, conv2d};

/// Configuration of a [`DenseNet`]; the defaults are torchvision's.
#[derive(Config, Debug)]
pub struct DenseNetConfig {
    /// Channels each dense layer adds (k in the paper).
    pub growth_rate: usize,
    /// Dense layers in each block.
    pub block_config: Vec<usize>,
    /// Output channels of the stem convolution.
    pub num_init_features: usize,
    pub num_classes: usize,
    /// Bottleneck width multiplier: a dense layer's 1x1 conv has `bn_size * growth_rate` outputs.
    #[config(default = 4)]
    pub bn_size: usize,
    /// Dropout after each dense layer (torchvision: 0).
    #[config(default = 0.0)]
    pub drop_rate: f64,
}

impl DenseNetConfig {
    pub fn densenet121(num_classes: usize) -> Self {
        Self::new(32, vec![6, 12, 24, 16], 64, num_classes)
    }
    pub fn densenet161(num_classes: usize) -> Self {
        Self::new(48, vec![6, 12, 36, 24], 96, num_classes)
    }
    pub fn densenet169(num_classes: usize) -> Self {
        Self::new(32, vec![6, 12, 32, 32], 64, num_classes)
    }
    pub fn densenet201(num_classes: usize) -> Self {
        Self::new(32, vec![6, 12, 48, 32], 64, num_classes)
    }

    pub fn init(&self, device: &Device) -> crate::Result<DenseNet> {
        let bad = |reason: &str| ModelError::InvalidConfig {
            model: "DenseNet",
            reason: reason.to_string(),
        };
        if self.num_classes == 0 || self.growth_rate == 0 || self.num_init_features == 0 {
            return Err(bad(
                "num_classes, growth_rate, num_init_features must be positive",
            ));
        }
        if self.block_config.is_empty() || self.block_config.contains(&0) || self.bn_size == 0 {
            return Err(bad(
                "block_config needs at least one non-empty block, bn_size > 0",
            ));
        }
        if !(0.0..1.0).contains(&self.drop_rate) {
            return Err(bad("drop_rate must be in [0, 1)"));
        }
        let mut channels = self.num_init_features;
        let mut blocks = Vec::new();
        let mut transitions = Vec::new();
        for (i, &num_layers) in self.block_config.iter().enumerate() {
            let layers = (0..num_layers)
                .map(|l| DenseLayer {
                    norm1: batch_norm(channels + l * self.growth_rate, device),
                    conv1: conv2d(
                        channels + l * self.growth_rate,
                        self.bn_size * self.growth_rate,
                        1,
                        1,
                        0,
                        1,
                        false,
                        false,
                        device,
                    ),
                    norm2: batch_norm(self.bn_size * self.growth_rate, device),
                    conv2: conv2d(
                        self.bn_size * self.growth_rate,
                        self.growth_rate,
                        3,
                        1,
                        1,
                        1,
                        false,
                        false,
                        device,
                    ),
                    dropout: DropoutConfig::new(self.drop_rate).init(),
                })
                .collect();
            blocks.push(DenseBlock { layers });
            channels += num_layers * self.growth_rate;
            if i + 1 != self.block_config.len() {
                transitions.push(Transition {
                    norm: batch_norm(channels, device),
                    conv: conv2d(channels, channels / 2, 1, 1, 0, 1, false, false, device),
                    pool: AvgPool2dConfig::new([2, 2]).with_strides([2, 2]).init(),
                });
                channels /= 2;
            }
        }
        let mut classifier = HeadConfig::new(self.num_classes).linear(channels, device);
        classifier.bias = Some(Param::from_tensor(Tensor::zeros(
            [self.num_classes],
            device,
        )));
        Ok(DenseNet {
            features: DenseFeatures {
                conv0: conv2d(3, self.num_init_features, 7, 2, 3, 1, false, false, device),
                norm0: batch_norm(self.num_init_features, device),
                pool0: MaxPool2dConfig::new([3, 3])
                    .with_strides([2, 2])
                    .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                    .init(),
                blocks,
                transitions,
                norm5: batch_norm(channels, device),
            },
            avgpool: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
            classifier,
            head: HeadActivation::Softmax,
        })
    }
}

/// BN, ReLU, 1x1 conv, BN, ReLU, 3x3 conv: adds `growth_rate` channels.
#[derive(Module, Debug)]
pub struct DenseLayer {
    pub norm1: BatchNorm,
    pub conv1: Conv2d,
    pub norm2: BatchNorm,
    pub conv2: Conv2d,
    pub dropout: Dropout,
}

#[derive(Module, Debug)]
pub struct DenseBlock {
    pub layers: Vec<DenseLayer>,
}

impl DenseBlock {
    pub fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let mut features = vec![x];
        for layer in &self.layers {
            let input = Tensor::cat(features.clone(), 1);
            let out = layer.conv1.forward(relu(layer.norm1.forward(input)));
            let out = layer.conv2.forward(relu(layer.norm2.forward(out)));
            features.push(layer.dropout.forward(out));
        }
        Tensor::cat(features, 1)
    }
}

/// BN, ReLU, 1x1 conv halving the channels, 2x2 average pool.
#[derive(Module, Debug)]
pub struct Transition {
    pub norm: BatchNorm,
    pub conv: Conv2d,
    pub pool: AvgPool2d,
}

#[derive(Module, Debug)]
pub struct DenseFeatures {
    pub conv0: Conv2d,
    pub norm0: BatchNorm,
    pub pool0: MaxPool2d,
    pub blocks: Vec<DenseBlock>,
    pub transitions: Vec<Transition>,
    pub norm5: BatchNorm,
}

/// DenseNet-BC (Huang et al. 2016), torchvision's architecture.
#[derive(Module, Debug)]
pub struct DenseNet {
    pub features: DenseFeatures,
    pub avgpool: AdaptiveAvgPool2d,
    pub classifier: Linear,
    #[module(skip)]
    pub head: HeadActivation,
}

impl DenseNet {
    /// torchvision's `features` output (after `norm5`, before the final ReLU).
    pub fn features(&self, x: Tensor<4>) -> Tensor<4> {
        let f = &self.features;
        let mut x = f.pool0.forward(relu(f.norm0.forward(f.conv0.forward(x))));
        for (i, block) in f.blocks.iter().enumerate() {
            x = block.forward(x);
            if let Some(t) = f.transitions.get(i) {
                x = t.pool.forward(t.conv.forward(relu(t.norm.forward(x))));
            }
        }
        f.norm5.forward(x)
    }

    pub fn embed(&self, x: Tensor<4>) -> Tensor<2> {
        self.avgpool.forward(relu(self.features(x))).flatten(1, 3)
    }

    pub fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        self.classifier.forward(self.embed(x))
    }

    pub fn torchvision_remaps(&self) -> Vec<(String, String)> {
        // Old-style keys first: "denselayer1.norm.1.weight" -> "denselayer1.norm1.weight".
        let mut remaps = vec![(
            r"^(.*denselayer\d+\.(?:norm|relu|conv))\.([12])\.".to_string(),
            "$1$2.".to_string(),
        )];
        for (i, block) in self.features.blocks.iter().enumerate() {
            for j in 0..block.layers.len() {
                remaps.push((
                    format!(r"^features\.denseblock{}\.denselayer{}\.", i + 1, j + 1),
                    format!("features.blocks.{i}.layers.{j}."),
                ));
            }
        }
        for i in 0..self.features.transitions.len() {
            remaps.push((
                format!(r"^features\.transition{}\.", i + 1),
                format!("features.transitions.{i}."),
            ));
        }
        remaps
    }
}
