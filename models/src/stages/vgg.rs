//! VGG's units: each convolution with the pools around it, the classifier.

use std::ops::Range;

use burn::nn::pool::AdaptiveAvgPool2dConfig;
use burn::prelude::*;

use crate::ModelError;
use crate::layers::{HeadActivation, batch_norm, conv2d};

use super::Unit;
use super::parts::{VggConvUnit, VggHead};
use crate::layers::vgg_pool;
use crate::vgg::{Vgg, VggConfig, VggConv, VggLayer};

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
