//! Models cut at their natural boundaries, for pipeline parallelism: a list of units, each a
//! module that maps a feature map to the next one (the last unit maps it to logits).
//!
//! ResNet's units are the stem (convolution, batch norm, ReLU, max pool), each residual block,
//! and the head (global pooling and the classifier). A pipeline stage is a contiguous range of
//! units; [`ResNetConfig::init_units`] builds only that range, so a rank never holds the other
//! stages' parameters, and [`ResNet::into_units`] cuts an existing model (for weights loaded
//! whole, and for tests). This module knows nothing about networks or ranks.
//!
//! VGG's units are each convolution (with its batch norm, ReLU and the max pools around it) and
//! the classifier (pooling and the three linear layers, which hold most of VGG's parameters).
//!
//! DenseNet's units are the stem, each dense layer (it maps the block's concatenation so far
//! to that concatenation with its own `growth_rate` channels appended, so a block can be cut
//! between any two layers), each transition, and the head (`norm5`, ReLU, pooling, the
//! classifier). A block with its transition is the natural stage; the per-layer units let a
//! split balance DenseNet's very uneven blocks.

use std::ops::Range;

use burn::module::Module;
use burn::nn::conv::Conv2d;
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig, MaxPool2d, MaxPool2dConfig};
use burn::nn::{BatchNorm, Linear, PaddingConfig2d};
use burn::prelude::*;
use burn::tensor::activation::relu;

use crate::ModelError;
use crate::densenet::{DenseLayer, DenseNet, DenseNetConfig, DensePiece, Transition};
use crate::layers::{HeadActivation, HeadConfig, batch_norm, conv2d};
use crate::resnet::{ResNet, ResNetConfig, ResidualBlock};
use crate::vgg::{Vgg, VggClassifier, VggConfig, VggConv, VggLayer};

/// ResNet's stem: `conv1`, `bn1`, ReLU, `maxpool`.
#[derive(Module, Debug)]
pub struct ResNetStem {
    pub conv1: Conv2d,
    pub bn1: BatchNorm,
    pub maxpool: MaxPool2d,
}

/// ResNet's head: global average pooling, flatten, `fc`.
#[derive(Module, Debug)]
pub struct ResNetHead {
    pub avgpool: AdaptiveAvgPool2d,
    pub fc: Linear,
    #[module(skip)]
    pub head: HeadActivation,
}

/// One VGG convolution with what surrounds it: an optional max pool before (a layer table
/// starting with a pool), batch norm, ReLU, and an optional max pool after.
#[derive(Module, Debug)]
pub struct VggConvUnit {
    pub layer: VggConv,
    pub maxpool: MaxPool2d,
    #[module(skip)]
    pub pool_before: bool,
    #[module(skip)]
    pub pool_after: bool,
}

/// VGG's head: adaptive average pooling, flatten, the classifier.
#[derive(Module, Debug)]
pub struct VggHead {
    pub avgpool: AdaptiveAvgPool2d,
    pub classifier: VggClassifier,
    #[module(skip)]
    pub head: HeadActivation,
}

/// DenseNet's stem: `conv0`, `norm0`, ReLU, `pool0`.
#[derive(Module, Debug)]
pub struct DenseStem {
    pub conv0: Conv2d,
    pub norm0: BatchNorm,
    pub pool0: MaxPool2d,
}

/// DenseNet's head: `norm5`, ReLU, global average pooling, flatten, `classifier`.
#[derive(Module, Debug)]
pub struct DenseHead {
    pub norm5: BatchNorm,
    pub avgpool: AdaptiveAvgPool2d,
    pub classifier: Linear,
    #[module(skip)]
    pub head: HeadActivation,
}

/// One unit of a model's natural split.
#[derive(Module, Debug)]
pub enum Unit {
    ResNetStem(ResNetStem),
    ResNetBlock(ResidualBlock),
    ResNetHead(ResNetHead),
    VggConv(VggConvUnit),
    VggHead(VggHead),
    DenseStem(DenseStem),
    DenseLayer(DenseLayer),
    DenseTransition(Transition),
    DenseHead(DenseHead),
}

/// What a unit gives: the next feature map, or (the last unit) logits.
#[derive(Debug, Clone)]
pub enum UnitOutput {
    Features(Tensor<4>),
    Logits(Tensor<2>),
}

impl Unit {
    pub fn forward(&self, x: Tensor<4>) -> UnitOutput {
        match self {
            Unit::ResNetStem(s) => {
                UnitOutput::Features(s.maxpool.forward(relu(s.bn1.forward(s.conv1.forward(x)))))
            }
            Unit::ResNetBlock(b) => UnitOutput::Features(b.forward(x)),
            Unit::ResNetHead(h) => {
                UnitOutput::Logits(h.fc.forward(h.avgpool.forward(x).flatten(1, 3)))
            }
            Unit::VggConv(u) => {
                let mut x = if u.pool_before {
                    u.maxpool.forward(x)
                } else {
                    x
                };
                x = u.layer.conv.forward(x);
                if let Some(bn) = &u.layer.bn {
                    x = bn.forward(x);
                }
                x = relu(x);
                UnitOutput::Features(if u.pool_after {
                    u.maxpool.forward(x)
                } else {
                    x
                })
            }
            Unit::VggHead(h) => {
                let c = &h.classifier;
                let x = h.avgpool.forward(x).flatten(1, 3);
                let x = c.dropout.forward(relu(c.fc1.forward(x)));
                let x = c.dropout.forward(relu(c.fc2.forward(x)));
                UnitOutput::Logits(c.fc3.forward(x))
            }
            Unit::DenseStem(s) => {
                UnitOutput::Features(s.pool0.forward(relu(s.norm0.forward(s.conv0.forward(x)))))
            }
            Unit::DenseLayer(l) => {
                let new = l.new_features(x.clone());
                UnitOutput::Features(Tensor::cat(vec![x, new], 1))
            }
            Unit::DenseTransition(t) => UnitOutput::Features(t.forward(x)),
            Unit::DenseHead(h) => {
                let x = h.avgpool.forward(relu(h.norm5.forward(x))).flatten(1, 3);
                UnitOutput::Logits(h.classifier.forward(x))
            }
        }
    }

    /// What the unit is, in words (`hearth units`).
    pub fn kind(&self) -> &'static str {
        match self {
            Unit::ResNetStem(_) => "ResNet stem (conv1, bn1, ReLU, max pool)",
            Unit::ResNetBlock(_) => "residual block",
            Unit::ResNetHead(_) => "ResNet head (pooling, fc)",
            Unit::VggConv(_) => "VGG convolution",
            Unit::VggHead(_) => "VGG classifier (pooling, 3 linear layers)",
            Unit::DenseStem(_) => "DenseNet stem (conv0, norm0, ReLU, pool0)",
            Unit::DenseLayer(_) => "dense layer",
            Unit::DenseTransition(_) => "transition",
            Unit::DenseHead(_) => "DenseNet head (norm5, pooling, classifier)",
        }
    }

    /// Learnable parameters (batch-norm running statistics excluded, as torchvision counts).
    pub fn learnable_params(&self) -> usize {
        crate::zoo::learnable_params_of(self)
    }
}

/// The (inplanes, planes, stride) of every residual block, in order.
fn blocks(cfg: &ResNetConfig) -> Vec<(usize, usize, usize)> {
    let mut inplanes = cfg.stem_width;
    let mut out = Vec::new();
    for (stage, (&n, &planes)) in cfg.layers.iter().zip(&cfg.stage_widths).enumerate() {
        for i in 0..n {
            let stride = if stage > 0 && i == 0 { 2 } else { 1 };
            out.push((inplanes, planes, stride));
            inplanes = planes * cfg.block.expansion();
        }
    }
    out
}

impl ResNetConfig {
    /// How many units the network has: the stem, every block, the head.
    pub fn units(&self) -> usize {
        self.layers.iter().sum::<usize>() + 2
    }

    /// Builds units `range` only (torchvision's initialisation, drawn for these units alone).
    pub fn init_units(&self, range: Range<usize>, device: &Device) -> crate::Result<Vec<Unit>> {
        self.validate()?;
        let n = self.units();
        if range.start >= range.end || range.end > n {
            return Err(ModelError::InvalidConfig {
                model: "ResNet",
                reason: format!("units {range:?} of a network of {n}"),
            });
        }
        let blocks = blocks(self);
        let last_width = self.stage_widths[3] * self.block.expansion();
        Ok(range
            .map(|u| {
                if u == 0 {
                    Unit::ResNetStem(ResNetStem {
                        conv1: conv2d(3, self.stem_width, 7, 2, 3, 1, false, true, device),
                        bn1: batch_norm(self.stem_width, device),
                        maxpool: stem_pool(),
                    })
                } else if u == n - 1 {
                    Unit::ResNetHead(ResNetHead {
                        avgpool: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
                        fc: HeadConfig::new(self.num_classes).linear(last_width, device),
                        head: HeadActivation::Softmax,
                    })
                } else {
                    let (inplanes, planes, stride) = blocks[u - 1];
                    Unit::ResNetBlock(ResidualBlock::new(self, inplanes, planes, stride, device))
                }
            })
            .collect())
    }
}

pub(crate) fn stem_pool() -> MaxPool2d {
    MaxPool2dConfig::new([3, 3])
        .with_strides([2, 2])
        .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
        .init()
}

impl ResNet {
    /// The network cut into its units (the same parameters, moved).
    pub fn into_units(self) -> Vec<Unit> {
        let mut units = vec![Unit::ResNetStem(ResNetStem {
            conv1: self.conv1,
            bn1: self.bn1,
            maxpool: self.maxpool,
        })];
        units.extend(
            self.layer1
                .into_iter()
                .chain(self.layer2)
                .chain(self.layer3)
                .chain(self.layer4)
                .map(Unit::ResNetBlock),
        );
        units.push(Unit::ResNetHead(ResNetHead {
            avgpool: self.avgpool,
            fc: self.fc,
            head: self.head,
        }));
        units
    }
}

fn vgg_pool() -> MaxPool2d {
    MaxPool2dConfig::new([2, 2]).with_strides([2, 2]).init()
}

impl VggConfig {
    /// How many units the network has: every convolution, then the classifier.
    pub fn units(&self) -> usize {
        self.layers
            .iter()
            .filter(|l| matches!(l, VggLayer::Conv(_)))
            .count()
            + 1
    }

    /// Builds units `range` only.
    pub fn init_units(&self, range: Range<usize>, device: &Device) -> crate::Result<Vec<Unit>> {
        let last_channels = self.validate()?;
        let n = self.units();
        if range.start >= range.end || range.end > n {
            return Err(ModelError::InvalidConfig {
                model: "VGG",
                reason: format!("units {range:?} of a network of {n}"),
            });
        }
        // (in, out, pool before, pool after) of every convolution.
        let mut convs: Vec<(usize, usize, bool, bool)> = Vec::new();
        let (mut in_ch, mut leading) = (3, false);
        for layer in &self.layers {
            match *layer {
                VggLayer::Conv(out) => {
                    convs.push((in_ch, out, leading && convs.is_empty(), false));
                    in_ch = out;
                }
                VggLayer::Pool => match convs.last_mut() {
                    Some(last) => last.3 = true,
                    None => leading = true,
                },
            }
        }
        Ok(range
            .map(|u| match convs.get(u) {
                Some(&(cin, cout, pool_before, pool_after)) => Unit::VggConv(VggConvUnit {
                    layer: VggConv {
                        conv: conv2d(cin, cout, 3, 1, 1, 1, true, true, device),
                        bn: self.batch_norm.then(|| batch_norm(cout, device)),
                    },
                    maxpool: vgg_pool(),
                    pool_before,
                    pool_after,
                }),
                None => Unit::VggHead(VggHead {
                    avgpool: AdaptiveAvgPool2dConfig::new([self.pool_size, self.pool_size]).init(),
                    classifier: self.classifier(last_channels, device),
                    head: HeadActivation::Softmax,
                }),
            })
            .collect())
    }
}

impl Vgg {
    /// The network cut into its units (the same parameters, moved).
    pub fn into_units(self) -> Vec<Unit> {
        let n = self.features.len();
        let mut units: Vec<Unit> = self
            .features
            .into_iter()
            .zip(self.pool_after)
            .enumerate()
            .map(|(i, (layer, pool_after))| {
                Unit::VggConv(VggConvUnit {
                    layer,
                    maxpool: vgg_pool(),
                    pool_before: i == 0 && self.leading_pool,
                    pool_after,
                })
            })
            .collect();
        debug_assert_eq!(units.len(), n);
        units.push(Unit::VggHead(VggHead {
            avgpool: self.avgpool,
            classifier: self.classifier,
            head: self.head,
        }));
        units
    }
}

impl DenseNetConfig {
    /// How many units the network has: the stem, every dense layer, every transition, the head.
    pub fn units(&self) -> usize {
        self.block_config.iter().sum::<usize>() + self.block_config.len() + 1
    }

    /// Builds units `range` only.
    pub fn init_units(&self, range: Range<usize>, device: &Device) -> crate::Result<Vec<Unit>> {
        self.validate()?;
        let plan = self.plan();
        debug_assert_eq!(plan.len(), self.units());
        if range.start >= range.end || range.end > plan.len() {
            return Err(ModelError::InvalidConfig {
                model: "DenseNet",
                reason: format!("units {range:?} of a network of {}", plan.len()),
            });
        }
        Ok(plan[range]
            .iter()
            .map(|piece| match *piece {
                DensePiece::Stem => {
                    let (conv0, norm0, pool0) = self.stem(device);
                    Unit::DenseStem(DenseStem {
                        conv0,
                        norm0,
                        pool0,
                    })
                }
                DensePiece::Layer { channels, .. } => {
                    Unit::DenseLayer(self.layer(channels, device))
                }
                DensePiece::Transition { channels } => {
                    Unit::DenseTransition(DenseNetConfig::transition(channels, device))
                }
                DensePiece::Head { channels } => {
                    let (norm5, classifier) = self.head(channels, device);
                    Unit::DenseHead(DenseHead {
                        norm5,
                        avgpool: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
                        classifier,
                        head: HeadActivation::Softmax,
                    })
                }
            })
            .collect())
    }
}

impl DenseNet {
    /// The network cut into its units (the same parameters, moved).
    pub fn into_units(self) -> Vec<Unit> {
        let f = self.features;
        let mut units = vec![Unit::DenseStem(DenseStem {
            conv0: f.conv0,
            norm0: f.norm0,
            pool0: f.pool0,
        })];
        let mut transitions = f.transitions.into_iter();
        for block in f.blocks {
            units.extend(block.layers.into_iter().map(Unit::DenseLayer));
            if let Some(t) = transitions.next() {
                units.push(Unit::DenseTransition(t));
            }
        }
        units.push(Unit::DenseHead(DenseHead {
            norm5: f.norm5,
            avgpool: self.avgpool,
            classifier: self.classifier,
            head: self.head,
        }));
        units
    }
}

impl crate::ModelConfig {
    /// How many units the network has ([`Unit`]).
    pub fn units(&self) -> usize {
        match self {
            crate::ModelConfig::ResNet(c) => c.units(),
            crate::ModelConfig::Vgg(c) => c.units(),
            crate::ModelConfig::DenseNet(c) => c.units(),
        }
    }

    /// Builds units `range` only.
    pub fn init_units(&self, range: Range<usize>, device: &Device) -> crate::Result<Vec<Unit>> {
        match self {
            crate::ModelConfig::ResNet(c) => c.init_units(range, device),
            crate::ModelConfig::Vgg(c) => c.init_units(range, device),
            crate::ModelConfig::DenseNet(c) => c.init_units(range, device),
        }
    }

    /// Learnable parameters of every unit, in order, without allocating any (Burn's parameters
    /// are initialised lazily, on first use).
    pub fn unit_params(&self, device: &Device) -> crate::Result<Vec<usize>> {
        Ok(self
            .init_units(0..self.units(), device)?
            .iter()
            .map(Unit::learnable_params)
            .collect())
    }
}

impl crate::Classifier {
    /// The network cut into its units (the same parameters, moved).
    pub fn into_units(self) -> Vec<Unit> {
        match self {
            crate::Classifier::ResNet(m) => m.into_units(),
            crate::Classifier::Vgg(m) => m.into_units(),
            crate::Classifier::DenseNet(m) => m.into_units(),
        }
    }

    /// The whole network from all its units in order (the inverse of [`Self::into_units`]);
    /// an error naming the first unit that does not belong where it stands.
    pub fn from_units(config: &crate::ModelConfig, units: Vec<Unit>) -> crate::Result<Self> {
        let n = config.units();
        let bad = |reason: String| ModelError::InvalidConfig {
            model: "units",
            reason,
        };
        if units.len() != n {
            return Err(bad(format!(
                "{} units given for a network of {n}",
                units.len()
            )));
        }
        let mut it = units.into_iter().enumerate();
        let mut next = || it.next().ok_or_else(|| bad("too few units".into()));
        let wrong = |i: usize, want: &str| bad(format!("unit {i} is not {want}"));
        Ok(match config {
            crate::ModelConfig::ResNet(cfg) => {
                let (i, u) = next()?;
                let Unit::ResNetStem(stem) = u else {
                    return Err(wrong(i, "a ResNet stem"));
                };
                let mut layers: [Vec<ResidualBlock>; 4] = Default::default();
                for (stage, &count) in cfg.layers.iter().enumerate() {
                    for _ in 0..count {
                        let (i, u) = next()?;
                        let Unit::ResNetBlock(b) = u else {
                            return Err(wrong(i, "a residual block"));
                        };
                        layers[stage].push(b);
                    }
                }
                let (i, u) = next()?;
                let Unit::ResNetHead(head) = u else {
                    return Err(wrong(i, "a ResNet head"));
                };
                let [layer1, layer2, layer3, layer4] = layers;
                crate::Classifier::ResNet(ResNet {
                    conv1: stem.conv1,
                    bn1: stem.bn1,
                    maxpool: stem.maxpool,
                    layer1,
                    layer2,
                    layer3,
                    layer4,
                    avgpool: head.avgpool,
                    fc: head.fc,
                    head: head.head,
                })
            }
            crate::ModelConfig::Vgg(_) => {
                let (mut features, mut pool_after, mut leading_pool) =
                    (Vec::new(), Vec::new(), false);
                for _ in 0..n - 1 {
                    let (i, u) = next()?;
                    let Unit::VggConv(c) = u else {
                        return Err(wrong(i, "a VGG convolution"));
                    };
                    leading_pool |= i == 0 && c.pool_before;
                    pool_after.push(c.pool_after);
                    features.push(c.layer);
                }
                let (i, u) = next()?;
                let Unit::VggHead(head) = u else {
                    return Err(wrong(i, "a VGG classifier"));
                };
                crate::Classifier::Vgg(Vgg {
                    features,
                    pool_after,
                    leading_pool,
                    maxpool: vgg_pool(),
                    avgpool: head.avgpool,
                    classifier: head.classifier,
                    head: head.head,
                })
            }
            crate::ModelConfig::DenseNet(cfg) => {
                let (i, u) = next()?;
                let Unit::DenseStem(stem) = u else {
                    return Err(wrong(i, "a DenseNet stem"));
                };
                let (mut blocks, mut transitions) = (Vec::new(), Vec::new());
                for (b, &count) in cfg.block_config.iter().enumerate() {
                    let mut layers = Vec::new();
                    for _ in 0..count {
                        let (i, u) = next()?;
                        let Unit::DenseLayer(l) = u else {
                            return Err(wrong(i, "a dense layer"));
                        };
                        layers.push(l);
                    }
                    blocks.push(crate::densenet::DenseBlock { layers });
                    if b + 1 != cfg.block_config.len() {
                        let (i, u) = next()?;
                        let Unit::DenseTransition(t) = u else {
                            return Err(wrong(i, "a transition"));
                        };
                        transitions.push(t);
                    }
                }
                let (i, u) = next()?;
                let Unit::DenseHead(head) = u else {
                    return Err(wrong(i, "a DenseNet head"));
                };
                crate::Classifier::DenseNet(DenseNet {
                    features: crate::densenet::DenseFeatures {
                        conv0: stem.conv0,
                        norm0: stem.norm0,
                        pool0: stem.pool0,
                        blocks,
                        transitions,
                        norm5: head.norm5,
                    },
                    avgpool: head.avgpool,
                    classifier: head.classifier,
                    head: head.head,
                })
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resnet::BlockKind;

    /// Learnable parameters of built units.
    fn total(units: crate::Result<Vec<Unit>>) -> usize {
        units.unwrap().iter().map(Unit::learnable_params).sum()
    }

    fn run(units: &[Unit], x: Tensor<4>) -> Tensor<2> {
        let mut x = x;
        for u in units {
            match u.forward(x) {
                UnitOutput::Features(f) => x = f,
                UnitOutput::Logits(l) => return l,
            }
        }
        panic!("no head");
    }

    #[test]
    fn units_compose_to_the_whole_network() {
        let device = Device::flex();
        let cfg = ResNetConfig::new(BlockKind::Bottleneck, [2, 1, 1, 1], 5)
            .with_stem_width(8)
            .with_stage_widths([4, 8, 8, 16]);
        let model = cfg.init(&device).unwrap();
        let x = Tensor::<4>::random([2, 3, 32, 32], burn::tensor::Distribution::Default, &device);
        let whole: Vec<f32> = model.forward(x.clone()).into_data().iter().collect();
        let units = model.into_units();
        assert_eq!(units.len(), cfg.units());
        let cut: Vec<f32> = run(&units, x).into_data().iter().collect();
        assert_eq!(whole, cut);
    }

    #[test]
    fn vgg_units_compose_to_the_whole_network_and_count_like_torchvision() {
        use crate::vgg::VggLayer::{Conv, Pool};
        let device = Device::flex();
        // A layer table starting with a pool, with and without batch norm.
        for bn in [false, true] {
            let cfg = VggConfig::new(vec![Pool, Conv(4), Pool, Conv(8), Conv(8), Pool], bn, 3)
                .with_hidden(16)
                .with_pool_size(2);
            let model = cfg.init(&device).unwrap();
            let x =
                Tensor::<4>::random([2, 3, 32, 32], burn::tensor::Distribution::Default, &device);
            let whole: Vec<f32> = model.forward(x.clone()).into_data().iter().collect();
            let units = model.into_units();
            assert_eq!(units.len(), cfg.units());
            let cut: Vec<f32> = run(&units, x).into_data().iter().collect();
            assert_eq!(whole, cut, "batch norm {bn}");
        }
        let cfg = crate::Architecture::from_name("vgg16")
            .unwrap()
            .config(1000);
        let crate::ModelConfig::Vgg(cfg) = cfg else {
            panic!("vgg16 is a VGG");
        };
        let n = cfg.units();
        assert_eq!(n, 14);
        let count = |r: Range<usize>| total(cfg.init_units(r, &device));
        assert_eq!(
            count(0..7) + count(7..n),
            138_357_544,
            "torchvision's vgg16"
        );
    }

    #[test]
    fn whole_networks_come_back_from_their_units() {
        use crate::vgg::VggLayer::{Conv, Pool};
        let device = Device::flex();
        let configs = [
            crate::ModelConfig::ResNet(
                ResNetConfig::new(BlockKind::Basic, [1, 2, 1, 1], 3)
                    .with_stem_width(4)
                    .with_stage_widths([4, 4, 8, 8]),
            ),
            crate::ModelConfig::Vgg(
                VggConfig::new(vec![Pool, Conv(4), Pool, Conv(4)], true, 3)
                    .with_hidden(8)
                    .with_pool_size(1),
            ),
            crate::ModelConfig::DenseNet(DenseNetConfig::new(2, vec![1, 2], 4, 3).with_bn_size(1)),
        ];
        for config in configs {
            let model = config.init(&device).unwrap().valid();
            let x =
                Tensor::<4>::random([1, 3, 32, 32], burn::tensor::Distribution::Default, &device);
            let before: Vec<f32> = model.forward(x.clone()).into_data().iter().collect();
            let units = model.into_units();
            let back = crate::Classifier::from_units(&config, units).unwrap();
            let after: Vec<f32> = back.forward(x).into_data().iter().collect();
            assert_eq!(before, after, "{config:?}");
            // Units in the wrong order are an error, not a panic.
            let mut units = config.init(&device).unwrap().into_units();
            let last = units.len() - 1;
            units.swap(0, last);
            assert!(crate::Classifier::from_units(&config, units).is_err());
        }
    }

    #[test]
    fn densenet_units_compose_to_the_whole_network_and_count_like_torchvision() {
        let device = Device::flex();
        let cfg = DenseNetConfig::new(4, vec![2, 3], 8, 5).with_bn_size(2);
        let model = cfg.init(&device).unwrap();
        let x = Tensor::<4>::random([2, 3, 32, 32], burn::tensor::Distribution::Default, &device);
        let whole: Vec<f32> = model.forward(x.clone()).into_data().iter().collect();
        let units = model.into_units();
        // stem, 2 layers, transition, 3 layers, head
        assert_eq!(units.len(), 8);
        assert_eq!(units.len(), cfg.units());
        let cut: Vec<f32> = run(&units, x).into_data().iter().collect();
        assert_eq!(whole, cut);

        let cfg = DenseNetConfig::densenet121(1000);
        let n = cfg.units();
        assert_eq!(n, 1 + 58 + 3 + 1);
        let count = |r: Range<usize>| total(cfg.init_units(r, &device));
        assert_eq!(
            count(0..20) + count(20..45) + count(45..n),
            7_978_856,
            "torchvision's densenet121"
        );
        assert!(cfg.init_units(0..n + 1, &device).is_err());
    }

    #[test]
    fn ranges_hold_only_their_parameters_and_add_up_to_torchvision_s_count() {
        let device = Device::flex();
        let cfg = ResNetConfig::resnet50(1000);
        let n = cfg.units();
        assert_eq!(n, 18);
        let count = |r: Range<usize>| total(cfg.init_units(r, &device));
        let (a, b, c) = (count(0..6), count(6..12), count(12..n));
        assert_eq!(a + b + c, 25_557_032, "torchvision's resnet50");
        assert!(a < b && b < c, "later blocks are wider: {a} {b} {c}");
        assert!(cfg.init_units(5..5, &device).is_err());
        assert!(cfg.init_units(0..19, &device).is_err());
    }
}
