//! ResNet's units: the stem, each residual block, the head.

use std::ops::Range;

use burn::nn::pool::AdaptiveAvgPool2dConfig;
use burn::prelude::*;

use crate::ModelError;
use crate::layers::{HeadActivation, HeadConfig, batch_norm, conv2d};

use super::Unit;
use super::parts::{ResNetHead, ResNetStem};
use crate::layers::stem_pool;
use crate::resnet::{ResNet, ResNetConfig, ResidualBlock};

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
