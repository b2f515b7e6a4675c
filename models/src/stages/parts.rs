//! The units' own types (stems, heads, VGG's convolution units), below the [`super::Unit`]
//! enum that holds them and the builders that make them.

use burn::module::Module;
use burn::nn::conv::Conv2d;
use burn::nn::pool::{AdaptiveAvgPool2d, MaxPool2d};
use burn::nn::{BatchNorm, Linear};

use crate::layers::HeadActivation;
use crate::vgg::{VggClassifier, VggConv};

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
