//! ResNet as in torchvision (`torchvision.models.resnet`): v1.5, with the stride of a
//! bottleneck block on its 3x3 convolution.
//!
//! Parameter names are torchvision's state_dict keys except `downsample.0` / `downsample.1`,
//! which are `downsample.conv` / `downsample.bn` here (see [`ResNet::torchvision_remaps`]), and
//! batch norm's `weight`/`bias`, which Burn calls `gamma`/`beta` (burn-store's PyTorch adapter
//! maps them).

use burn::config::Config;
use burn::module::Module;
use burn::nn::conv::Conv2d;
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig, MaxPool2d};
use burn::nn::{BatchNorm, Linear};
use burn::prelude::*;
// On a CPU, hearth-kernels' faster convolutions with their batch norm (+ ReLU, + residual) as
// one op for inference, fused batch norm + ReLU while training; elsewhere Burn's own
// `Conv2d::forward`, `BatchNorm::forward` and `relu`.
use hearth_kernels::infer::{After, conv2d_batch_norm};

use crate::ModelError;
use crate::layers::{HeadActivation, HeadConfig, batch_norm, conv2d};

/// Which residual block a ResNet stacks.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum BlockKind {
    /// Two 3x3 convolutions, expansion 1 (ResNet-18/34).
    Basic,
    /// 1x1, 3x3, 1x1 convolutions, expansion 4 (ResNet-50/101/152).
    Bottleneck,
}

impl BlockKind {
    pub fn expansion(self) -> usize {
        match self {
            BlockKind::Basic => 1,
            BlockKind::Bottleneck => 4,
        }
    }
}

/// Configuration of a [`ResNet`]; the defaults are torchvision's.
#[derive(Config, Debug)]
pub struct ResNetConfig {
    pub block: BlockKind,
    /// Blocks in each of the four stages (`layers` in torchvision).
    pub layers: [usize; 4],
    pub num_classes: usize,
    /// Output channels of the stem (torchvision: 64).
    #[config(default = 64)]
    pub stem_width: usize,
    /// `planes` of each stage (torchvision: 64, 128, 256, 512). Smaller values make test-size
    /// networks with the same structure.
    #[config(default = "[64, 128, 256, 512]")]
    pub stage_widths: [usize; 4],
    /// Groups of the 3x3 bottleneck convolution (ResNeXt).
    #[config(default = 1)]
    pub groups: usize,
    /// torchvision's `width_per_group` (64; 128 for wide ResNets).
    #[config(default = 64)]
    pub width_per_group: usize,
}

impl ResNetConfig {
    pub fn resnet18(num_classes: usize) -> Self {
        Self::new(BlockKind::Basic, [2, 2, 2, 2], num_classes)
    }
    pub fn resnet34(num_classes: usize) -> Self {
        Self::new(BlockKind::Basic, [3, 4, 6, 3], num_classes)
    }
    pub fn resnet50(num_classes: usize) -> Self {
        Self::new(BlockKind::Bottleneck, [3, 4, 6, 3], num_classes)
    }
    pub fn resnet101(num_classes: usize) -> Self {
        Self::new(BlockKind::Bottleneck, [3, 4, 23, 3], num_classes)
    }
    pub fn resnet152(num_classes: usize) -> Self {
        Self::new(BlockKind::Bottleneck, [3, 8, 36, 3], num_classes)
    }

    pub(crate) fn validate(&self) -> crate::Result<()> {
        let bad = |reason: String| ModelError::InvalidConfig {
            model: "ResNet",
            reason,
        };
        if self.num_classes == 0 {
            return Err(bad("num_classes must be at least 1".into()));
        }
        if self.layers.contains(&0) {
            return Err(bad(format!(
                "every stage needs a block, got {:?}",
                self.layers
            )));
        }
        if self.stem_width == 0 || self.stage_widths.contains(&0) || self.groups == 0 {
            return Err(bad("widths and groups must be positive".into()));
        }
        if self.block == BlockKind::Basic && (self.groups != 1 || self.width_per_group != 64) {
            return Err(bad(
                "basic blocks support only groups=1, width_per_group=64".into(),
            ));
        }
        Ok(())
    }

    /// Builds the network with torchvision's initialisation.
    pub fn init(&self, device: &Device) -> crate::Result<ResNet> {
        self.validate()?;
        let mut inplanes = self.stem_width;
        let mut stages = Vec::with_capacity(4);
        for (stage, (&blocks, &planes)) in self.layers.iter().zip(&self.stage_widths).enumerate() {
            let stride = if stage == 0 { 1 } else { 2 };
            let mut layer = Vec::with_capacity(blocks);
            for i in 0..blocks {
                let s = if i == 0 { stride } else { 1 };
                layer.push(ResidualBlock::new(self, inplanes, planes, s, device));
                inplanes = planes * self.block.expansion();
            }
            stages.push(layer);
        }
        let mut stages = stages.into_iter();
        let mut next = || stages.next().unwrap_or_default();
        Ok(ResNet {
            conv1: conv2d(3, self.stem_width, 7, 2, 3, 1, false, true, device),
            bn1: batch_norm(self.stem_width, device),
            maxpool: crate::layers::stem_pool(),
            layer1: next(),
            layer2: next(),
            layer3: next(),
            layer4: next(),
            avgpool: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
            fc: HeadConfig::new(self.num_classes).linear(inplanes, device),
            head: HeadActivation::Softmax,
        })
    }
}

/// torchvision's `downsample`: a strided 1x1 convolution and batch norm on the shortcut.
#[derive(Module, Debug)]
pub struct Downsample {
    pub conv: Conv2d,
    pub bn: BatchNorm,
}

/// A basic block (`conv3`/`bn3` absent) or a bottleneck block.
#[derive(Module, Debug)]
pub struct ResidualBlock {
    pub conv1: Conv2d,
    pub bn1: BatchNorm,
    pub conv2: Conv2d,
    pub bn2: BatchNorm,
    pub conv3: Option<Conv2d>,
    pub bn3: Option<BatchNorm>,
    pub downsample: Option<Downsample>,
}

impl ResidualBlock {
    pub(crate) fn new(
        cfg: &ResNetConfig,
        inplanes: usize,
        planes: usize,
        stride: usize,
        device: &Device,
    ) -> Self {
        let out = planes * cfg.block.expansion();
        let downsample = (stride != 1 || inplanes != out).then(|| Downsample {
            conv: conv2d(inplanes, out, 1, stride, 0, 1, false, true, device),
            bn: batch_norm(out, device),
        });
        match cfg.block {
            BlockKind::Basic => Self {
                conv1: conv2d(inplanes, planes, 3, stride, 1, 1, false, true, device),
                bn1: batch_norm(planes, device),
                conv2: conv2d(planes, planes, 3, 1, 1, 1, false, true, device),
                bn2: batch_norm(planes, device),
                conv3: None,
                bn3: None,
                downsample,
            },
            BlockKind::Bottleneck => {
                // torchvision: width = int(planes * (base_width / 64.)) * groups
                let width = planes * cfg.width_per_group / 64 * cfg.groups;
                Self {
                    conv1: conv2d(inplanes, width, 1, 1, 0, 1, false, true, device),
                    bn1: batch_norm(width, device),
                    conv2: conv2d(width, width, 3, stride, 1, cfg.groups, false, true, device),
                    bn2: batch_norm(width, device),
                    conv3: Some(conv2d(width, out, 1, 1, 0, 1, false, true, device)),
                    bn3: Some(batch_norm(out, device)),
                    downsample,
                }
            }
        }
    }

    /// Each convolution with its batch norm and what follows it as one op for inference on
    /// the CPU ([`conv2d_batch_norm`]: the last one's residual and ReLU too), the separate ops
    /// elsewhere.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let identity = match &self.downsample {
            Some(ds) => conv2d_batch_norm(&ds.conv, &ds.bn, x.clone(), After::Nothing),
            None => x.clone(),
        };
        let out = conv2d_batch_norm(&self.conv1, &self.bn1, x, After::Relu);
        match (&self.conv3, &self.bn3) {
            (Some(conv3), Some(bn3)) => {
                let out = conv2d_batch_norm(&self.conv2, &self.bn2, out, After::Relu);
                conv2d_batch_norm(conv3, bn3, out, After::AddRelu(identity))
            }
            _ => conv2d_batch_norm(&self.conv2, &self.bn2, out, After::AddRelu(identity)),
        }
    }
}

/// ResNet (He et al. 2015), torchvision's architecture.
#[derive(Module, Debug)]
pub struct ResNet {
    pub conv1: Conv2d,
    pub bn1: BatchNorm,
    pub maxpool: MaxPool2d,
    pub layer1: Vec<ResidualBlock>,
    pub layer2: Vec<ResidualBlock>,
    pub layer3: Vec<ResidualBlock>,
    pub layer4: Vec<ResidualBlock>,
    pub avgpool: AdaptiveAvgPool2d,
    pub fc: Linear,
    #[module(skip)]
    pub head: HeadActivation,
}

impl ResNet {
    /// The feature map before global pooling: `[batch, 512 * expansion, H/32, W/32]`.
    pub fn features(&self, x: Tensor<4>) -> Tensor<4> {
        let mut x = conv2d_batch_norm(&self.conv1, &self.bn1, x, After::Relu);
        x = hearth_kernels::pool::max_pool(&self.maxpool, x);
        for block in self
            .layer1
            .iter()
            .chain(&self.layer2)
            .chain(&self.layer3)
            .chain(&self.layer4)
        {
            x = block.forward(x);
        }
        x
    }

    /// Globally pooled features, the input of the head: `[batch, fc.in_features]`.
    pub fn embed(&self, x: Tensor<4>) -> Tensor<2> {
        self.avgpool.forward(self.features(x)).flatten(1, 3)
    }

    /// Logits `[batch, num_classes]`.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        hearth_kernels::linear(&self.fc, self.embed(x))
    }

    /// Key renames from a torchvision state_dict to this module (regex, replacement).
    pub fn torchvision_remaps() -> Vec<(String, String)> {
        vec![
            (
                r"^(layer\d+\.\d+\.downsample)\.0\.".into(),
                "$1.conv.".into(),
            ),
            (r"^(layer\d+\.\d+\.downsample)\.1\.".into(), "$1.bn.".into()),
        ]
    }

    /// The way back: this network's parameter paths to torchvision's keys
    /// ([`crate::export::export_torchvision`]).
    pub fn torchvision_export_remaps() -> Vec<(String, String)> {
        vec![
            (
                r"^(layer\d+\.\d+\.downsample)\.conv\.".into(),
                "$1.0.".into(),
            ),
            (r"^(layer\d+\.\d+\.downsample)\.bn\.".into(), "$1.1.".into()),
        ]
    }
}
