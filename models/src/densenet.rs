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
// Training on a CPU takes hearth-kernels' faster convolutions and fused batch norm + ReLU.
use hearth_kernels::conv2d as fast_conv2d;
use hearth_kernels::infer::{After, conv2d_batch_norm};
use hearth_kernels::norm::{BatchStats, batch_norm as fast_batch_norm, batch_norm_after};

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

    /// Checks the configuration.
    pub(crate) fn validate(&self) -> crate::Result<()> {
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
        Ok(())
    }

    /// The network's pieces in order, each with its input channels.
    pub(crate) fn plan(&self) -> Vec<DensePiece> {
        let mut channels = self.num_init_features;
        let mut out = vec![DensePiece::Stem];
        for (i, &num_layers) in self.block_config.iter().enumerate() {
            for l in 0..num_layers {
                out.push(DensePiece::Layer {
                    block: i,
                    channels: channels + l * self.growth_rate,
                });
            }
            channels += num_layers * self.growth_rate;
            if i + 1 != self.block_config.len() {
                out.push(DensePiece::Transition { channels });
                channels /= 2;
            }
        }
        out.push(DensePiece::Head { channels });
        out
    }

    pub(crate) fn stem(&self, device: &Device) -> (Conv2d, BatchNorm, MaxPool2d) {
        (
            conv2d(3, self.num_init_features, 7, 2, 3, 1, false, false, device),
            batch_norm(self.num_init_features, device),
            MaxPool2dConfig::new([3, 3])
                .with_strides([2, 2])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(),
        )
    }

    /// A dense layer taking `channels` input channels.
    pub(crate) fn layer(&self, channels: usize, device: &Device) -> DenseLayer {
        let width = self.bn_size * self.growth_rate;
        DenseLayer {
            norm1: batch_norm(channels, device),
            conv1: conv2d(channels, width, 1, 1, 0, 1, false, false, device),
            norm2: batch_norm(width, device),
            conv2: conv2d(width, self.growth_rate, 3, 1, 1, 1, false, false, device),
            dropout: DropoutConfig::new(self.drop_rate).init(),
        }
    }

    /// A transition taking `channels` input channels (and giving half).
    pub(crate) fn transition(channels: usize, device: &Device) -> Transition {
        Transition {
            norm: batch_norm(channels, device),
            conv: conv2d(channels, channels / 2, 1, 1, 0, 1, false, false, device),
            pool: AvgPool2dConfig::new([2, 2]).with_strides([2, 2]).init(),
        }
    }

    /// The final batch norm and the classifier, on `channels` features.
    pub(crate) fn head(&self, channels: usize, device: &Device) -> (BatchNorm, Linear) {
        let mut classifier = HeadConfig::new(self.num_classes).linear(channels, device);
        classifier.bias = Some(Param::from_tensor(Tensor::zeros(
            [self.num_classes],
            device,
        )));
        (batch_norm(channels, device), classifier)
    }

    pub fn init(&self, device: &Device) -> crate::Result<DenseNet> {
        self.validate()?;
        let (conv0, norm0, pool0) = self.stem(device);
        let mut blocks: Vec<DenseBlock> = Vec::new();
        let mut transitions = Vec::new();
        let mut head = None;
        for piece in self.plan() {
            match piece {
                DensePiece::Stem => {}
                DensePiece::Layer { block, channels } => {
                    if blocks.len() == block {
                        blocks.push(DenseBlock { layers: Vec::new() });
                    }
                    blocks[block].layers.push(self.layer(channels, device));
                }
                DensePiece::Transition { channels } => {
                    transitions.push(Self::transition(channels, device));
                }
                DensePiece::Head { channels } => head = Some(self.head(channels, device)),
            }
        }
        let (norm5, classifier) = head.ok_or_else(|| ModelError::InvalidConfig {
            model: "DenseNet",
            reason: "no head".into(),
        })?;
        Ok(DenseNet {
            features: DenseFeatures {
                conv0,
                norm0,
                pool0,
                blocks,
                transitions,
                norm5,
            },
            avgpool: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
            classifier,
            head: HeadActivation::Softmax,
        })
    }
}

/// One piece of a DenseNet, in the order the network applies them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DensePiece {
    Stem,
    Layer { block: usize, channels: usize },
    Transition { channels: usize },
    Head { channels: usize },
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

impl DenseLayer {
    /// The `growth_rate` new channels computed from all the channels so far.
    pub fn new_features(&self, input: Tensor<4>) -> Tensor<4> {
        self.new_features_after(input, None).0
    }

    /// [`Self::new_features`] where `input`'s first channels are the previous layer's input,
    /// whose batch statistics that layer returned (`known`): its first batch norm takes them
    /// instead of computing them again (the same bits). Returns the statistics of `input` for
    /// the next layer, while training on the CPU's fused path.
    pub fn new_features_after(
        &self,
        input: Tensor<4>,
        known: Option<&BatchStats>,
    ) -> (Tensor<4>, Option<BatchStats>) {
        let (out, stats) = batch_norm_after(&self.norm1, input, true, known);
        let out = fast_conv2d(&self.conv1, out);
        let out = fast_conv2d(&self.conv2, fast_batch_norm(&self.norm2, out, true));
        (self.dropout.forward(out), stats)
    }
}

impl Transition {
    pub fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        self.forward_after(x, None)
    }

    /// [`Self::forward`] with the batch statistics of `x`'s first channels known (the block's
    /// last layer's input), as [`DenseLayer::new_features_after`].
    pub fn forward_after(&self, x: Tensor<4>, known: Option<&BatchStats>) -> Tensor<4> {
        let (x, _) = batch_norm_after(&self.norm, x, true, known);
        hearth_kernels::pool::avg_pool(&self.pool, fast_conv2d(&self.conv, x))
    }
}

impl DenseBlock {
    pub fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        self.forward_with_stats(x).0
    }

    /// [`Self::forward`], each layer's first batch norm taking the statistics of the channels
    /// the layer before saw from it; also returns the last layer's input statistics, the first
    /// channels of the block's output (for the transition after it).
    pub fn forward_with_stats(&self, x: Tensor<4>) -> (Tensor<4>, Option<BatchStats>) {
        // Each layer's input is the one before and that layer's new channels, joined: the
        // same values as joining every piece so far, two parents to an op (hearth-kernels'
        // parallel join takes two) and the gradients summed in the order the pipeline's
        // units, one layer each, sum them.
        let mut input = x;
        let mut known: Option<BatchStats> = None;
        for layer in &self.layers {
            let (new, stats) = layer.new_features_after(input.clone(), known.as_ref());
            known = stats;
            input = hearth_kernels::cat::cat(input, new, 1);
        }
        (input, known)
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
        let mut x = hearth_kernels::pool::max_pool(
            &f.pool0,
            conv2d_batch_norm(&f.conv0, &f.norm0, x, After::Relu),
        );
        for (i, block) in f.blocks.iter().enumerate() {
            let (out, stats) = block.forward_with_stats(x);
            x = match f.transitions.get(i) {
                Some(t) => t.forward_after(out, stats.as_ref()),
                None => out,
            };
        }
        fast_batch_norm(&f.norm5, x, false)
    }

    pub fn embed(&self, x: Tensor<4>) -> Tensor<2> {
        self.avgpool.forward(relu(self.features(x))).flatten(1, 3)
    }

    pub fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        hearth_kernels::linear(&self.classifier, self.embed(x))
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

    /// The way back: this network's parameter paths to torchvision's keys
    /// ([`crate::export::export_torchvision`]).
    pub fn torchvision_export_remaps(&self) -> Vec<(String, String)> {
        let mut remaps = Vec::new();
        for (i, block) in self.features.blocks.iter().enumerate() {
            for j in 0..block.layers.len() {
                remaps.push((
                    format!(r"^features\.blocks\.{i}\.layers\.{j}\."),
                    format!("features.denseblock{}.denselayer{}.", i + 1, j + 1),
                ));
            }
        }
        for i in 0..self.features.transitions.len() {
            remaps.push((
                format!(r"^features\.transitions\.{i}\."),
                format!("features.transition{}.", i + 1),
            ));
        }
        remaps
    }
}
