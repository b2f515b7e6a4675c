//! Models cut at their natural boundaries, for pipeline parallelism: a list of units, each a
//! module that maps a feature map to the next one (the last unit maps it to logits).
//!
//! ResNet's units are the stem (convolution, batch norm, ReLU, max pool), each residual block,
//! and the head (global pooling and the classifier). A pipeline stage is a contiguous range of
//! units; [`ResNetConfig::init_units`](crate::ResNetConfig::init_units) builds only that range, so a rank never holds the other
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
//!
//! One file per family: `resnet.rs`, `vgg.rs`, `densenet.rs`; this file holds the [`Unit`]
//! they share and the dispatch over [`crate::ModelConfig`] and [`crate::Classifier`].

mod densenet;
mod parts;
mod resnet;
#[cfg(test)]
mod tests;
mod vgg;

pub use parts::{DenseHead, DenseStem, ResNetHead, ResNetStem, VggConvUnit, VggHead};

use std::ops::Range;

use burn::module::Module;
use burn::prelude::*;
use burn::tensor::activation::relu;
use hearth_kernels::conv2d as fast_conv2d;
use hearth_kernels::infer::{After, conv2d_batch_norm};
use hearth_kernels::norm::batch_norm as fast_batch_norm;
use hearth_kernels::pool::max_pool;

use crate::ModelError;
use crate::densenet::{DenseLayer, DenseNet, Transition};
use crate::resnet::{ResNet, ResidualBlock};
use crate::vgg::Vgg;

/// One unit of a model's natural split.
#[derive(Module, Debug)]
// A model's units are built once and moved a few times: boxing the largest would add an
// indirection to every match for no measurable gain.
#[allow(clippy::large_enum_variant)]
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
            // The same kernels as the whole networks' forward (hearth-kernels on the CPU), so
            // that a split network computes what the whole one does, to the last bit.
            Unit::ResNetStem(s) => UnitOutput::Features(max_pool(
                &s.maxpool,
                conv2d_batch_norm(&s.conv1, &s.bn1, x, After::Relu),
            )),
            Unit::ResNetBlock(b) => UnitOutput::Features(b.forward(x)),
            Unit::ResNetHead(h) => UnitOutput::Logits(hearth_kernels::linear(
                &h.fc,
                h.avgpool.forward(x).flatten(1, 3),
            )),
            Unit::VggConv(u) => {
                let mut x = if u.pool_before {
                    max_pool(&u.maxpool, x)
                } else {
                    x
                };
                x = fast_conv2d(&u.layer.conv, x);
                x = match &u.layer.bn {
                    Some(bn) => fast_batch_norm(bn, x, true),
                    None => relu(x),
                };
                UnitOutput::Features(if u.pool_after {
                    max_pool(&u.maxpool, x)
                } else {
                    x
                })
            }
            Unit::VggHead(h) => {
                let c = &h.classifier;
                let x = h.avgpool.forward(x).flatten(1, 3);
                let x = c.dropout.forward(relu(hearth_kernels::linear(&c.fc1, x)));
                let x = c.dropout.forward(relu(hearth_kernels::linear(&c.fc2, x)));
                UnitOutput::Logits(hearth_kernels::linear(&c.fc3, x))
            }
            Unit::DenseStem(s) => UnitOutput::Features(max_pool(
                &s.pool0,
                fast_batch_norm(&s.norm0, fast_conv2d(&s.conv0, x), true),
            )),
            Unit::DenseLayer(l) => {
                let new = l.new_features(x.clone());
                UnitOutput::Features(hearth_kernels::cat::cat(x, new, 1))
            }
            Unit::DenseTransition(t) => UnitOutput::Features(t.forward(x)),
            Unit::DenseHead(h) => {
                let x = h
                    .avgpool
                    .forward(relu(fast_batch_norm(&h.norm5, x, false)))
                    .flatten(1, 3);
                UnitOutput::Logits(hearth_kernels::linear(&h.classifier, x))
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

    /// The channels of the feature map the unit takes (dimension 1 of its input).
    /// Read from the parameters' shapes without drawing their values (Burn makes a lazy
    /// parameter on first use, from the process's one random generator).
    pub fn in_channels(&self) -> usize {
        match self {
            Unit::ResNetStem(s) => s.conv1.weight.lazy_shape().dims::<4>()[1],
            Unit::ResNetBlock(b) => b.conv1.weight.lazy_shape().dims::<4>()[1],
            // Burn's linear weights are [inputs, outputs]; pooling leaves one value per
            // channel.
            Unit::ResNetHead(h) => h.fc.weight.lazy_shape().dims::<2>()[0],
            Unit::VggConv(u) => u.layer.conv.weight.lazy_shape().dims::<4>()[1],
            // The classifier takes the pooled map's values (7 x 7 in torchvision) per channel.
            Unit::VggHead(h) => {
                let [a, b] = h.avgpool.output_size;
                h.classifier.fc1.weight.lazy_shape().dims::<2>()[0] / (a * b).max(1)
            }
            Unit::DenseStem(s) => s.conv0.weight.lazy_shape().dims::<4>()[1],
            Unit::DenseLayer(l) => l.norm1.gamma.lazy_shape().dims::<1>()[0],
            Unit::DenseTransition(t) => t.norm.gamma.lazy_shape().dims::<1>()[0],
            Unit::DenseHead(h) => h.norm5.gamma.lazy_shape().dims::<1>()[0],
        }
    }

    /// Learnable parameters (batch-norm running statistics excluded, as torchvision counts).
    pub fn learnable_params(&self) -> usize {
        crate::zoo::learnable_params_of(self)
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
        if units.len() != n {
            return Err(bad_units(format!(
                "{} units given for a network of {n}",
                units.len()
            )));
        }
        let mut it = units.into_iter().enumerate();
        let mut next = || it.next().ok_or_else(|| bad_units("too few units".into()));
        Ok(match config {
            crate::ModelConfig::ResNet(cfg) => resnet_from_units(&cfg.layers, &mut next)?,
            crate::ModelConfig::Vgg(_) => vgg_from_units(n, &mut next)?,
            crate::ModelConfig::DenseNet(cfg) => densenet_from_units(&cfg.block_config, &mut next)?,
        })
    }
}

/// The next unit and its position, or an error when none is left.
type NextUnit<'a> = dyn FnMut() -> crate::Result<(usize, Unit)> + 'a;

fn bad_units(reason: String) -> crate::ModelError {
    ModelError::InvalidConfig {
        model: "units",
        reason,
    }
}

fn wrong_unit(i: usize, want: &str) -> crate::ModelError {
    bad_units(format!("unit {i} is not {want}"))
}

/// A ResNet from its stem, its `layers` of residual blocks per stage, and its head.
fn resnet_from_units(layers: &[usize], next: &mut NextUnit) -> crate::Result<crate::Classifier> {
    let (i, u) = next()?;
    let Unit::ResNetStem(stem) = u else {
        return Err(wrong_unit(i, "a ResNet stem"));
    };
    let mut stages: [Vec<ResidualBlock>; 4] = Default::default();
    for (stage, &count) in layers.iter().enumerate() {
        for _ in 0..count {
            let (i, u) = next()?;
            let Unit::ResNetBlock(b) = u else {
                return Err(wrong_unit(i, "a residual block"));
            };
            stages[stage].push(b);
        }
    }
    let (i, u) = next()?;
    let Unit::ResNetHead(head) = u else {
        return Err(wrong_unit(i, "a ResNet head"));
    };
    let [layer1, layer2, layer3, layer4] = stages;
    Ok(crate::Classifier::ResNet(ResNet {
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
    }))
}

/// A VGG from its `n - 1` convolutions and its classifier.
fn vgg_from_units(n: usize, next: &mut NextUnit) -> crate::Result<crate::Classifier> {
    let (mut features, mut pool_after, mut leading_pool) = (Vec::new(), Vec::new(), false);
    for _ in 0..n - 1 {
        let (i, u) = next()?;
        let Unit::VggConv(c) = u else {
            return Err(wrong_unit(i, "a VGG convolution"));
        };
        leading_pool |= i == 0 && c.pool_before;
        pool_after.push(c.pool_after);
        features.push(c.layer);
    }
    let (i, u) = next()?;
    let Unit::VggHead(head) = u else {
        return Err(wrong_unit(i, "a VGG classifier"));
    };
    Ok(crate::Classifier::Vgg(Vgg {
        features,
        pool_after,
        leading_pool,
        maxpool: crate::layers::vgg_pool(),
        avgpool: head.avgpool,
        classifier: head.classifier,
        head: head.head,
    }))
}

/// A DenseNet from its stem, its dense blocks (`block_config` layers each) with the
/// transitions between them, and its head.
fn densenet_from_units(
    block_config: &[usize],
    next: &mut NextUnit,
) -> crate::Result<crate::Classifier> {
    let (i, u) = next()?;
    let Unit::DenseStem(stem) = u else {
        return Err(wrong_unit(i, "a DenseNet stem"));
    };
    let (mut blocks, mut transitions) = (Vec::new(), Vec::new());
    for (b, &count) in block_config.iter().enumerate() {
        let mut layers = Vec::new();
        for _ in 0..count {
            let (i, u) = next()?;
            let Unit::DenseLayer(l) = u else {
                return Err(wrong_unit(i, "a dense layer"));
            };
            layers.push(l);
        }
        blocks.push(crate::densenet::DenseBlock { layers });
        if b + 1 != block_config.len() {
            let (i, u) = next()?;
            let Unit::DenseTransition(t) = u else {
                return Err(wrong_unit(i, "a transition"));
            };
            transitions.push(t);
        }
    }
    let (i, u) = next()?;
    let Unit::DenseHead(head) = u else {
        return Err(wrong_unit(i, "a DenseNet head"));
    };
    Ok(crate::Classifier::DenseNet(DenseNet {
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
    }))
}
