//! DenseNet's units: the stem, each dense layer, each transition, the head.

use std::ops::Range;

use burn::nn::pool::AdaptiveAvgPool2dConfig;
use burn::prelude::*;

use crate::ModelError;
use crate::layers::HeadActivation;

use super::Unit;
use super::parts::{DenseHead, DenseStem};
use crate::densenet::{DenseNet, DenseNetConfig, DensePiece};

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
