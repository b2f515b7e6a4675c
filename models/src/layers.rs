//! Building blocks shared by the architectures, with torchvision's initialisation.

use burn::module::Param;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, Initializer, Linear, LinearConfig, PaddingConfig2d};
use burn::prelude::*;
use burn::tensor::activation::{sigmoid, softmax};

/// torchvision's BatchNorm2d defaults: eps 1e-5, momentum 0.1.
pub(crate) fn batch_norm(channels: usize, device: &Device) -> BatchNorm {
    BatchNormConfig::new(channels)
        .with_epsilon(1e-5)
        .with_momentum(0.1)
        .init(device)
}

/// A square convolution with symmetric padding. `fan_out` picks torchvision's
/// `kaiming_normal_(mode="fan_out", nonlinearity="relu")` (ResNet, VGG) instead of fan-in
/// (DenseNet).
#[allow(clippy::too_many_arguments)]
pub(crate) fn conv2d(
    in_ch: usize,
    out_ch: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
    groups: usize,
    bias: bool,
    fan_out: bool,
    device: &Device,
) -> Conv2d {
    let mut conv = Conv2dConfig::new([in_ch, out_ch], [kernel, kernel])
        .with_stride([stride, stride])
        .with_padding(PaddingConfig2d::Explicit(
            padding, padding, padding, padding,
        ))
        .with_groups(groups)
        .with_bias(bias)
        .with_initializer(Initializer::KaimingNormal {
            gain: 2f64.sqrt(),
            fan_out_only: fan_out,
        })
        .init(device);
    if bias {
        conv.bias = Some(Param::from_tensor(Tensor::zeros([out_ch], device)));
    }
    conv
}

/// How a classifier head turns logits into probabilities.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HeadActivation {
    /// One label per image: softmax over classes (cross-entropy training).
    #[default]
    Softmax,
    /// Any number of labels per image: an independent sigmoid per class (BCE training),
    /// as CheXNet's 14-way head.
    Sigmoid,
}

impl HeadActivation {
    /// Logits `[batch, classes]` to probabilities.
    pub fn probabilities(self, logits: Tensor<2>) -> Tensor<2> {
        match self {
            HeadActivation::Softmax => softmax(logits, 1),
            HeadActivation::Sigmoid => sigmoid(logits),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            HeadActivation::Softmax => "softmax",
            HeadActivation::Sigmoid => "sigmoid",
        }
    }
}

/// How to initialise the bias of a new classifier head.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BiasInit {
    /// PyTorch's `nn.Linear` default, U(-1/sqrt(in), 1/sqrt(in)).
    Default,
    /// Every bias set to this value (CheXNet sets ones; zero is a common choice too).
    Constant(f64),
}

/// A new classifier head: what [`crate::Classifier::replace_head`] builds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HeadConfig {
    pub num_classes: usize,
    pub activation: HeadActivation,
    pub bias: BiasInit,
}

impl HeadConfig {
    /// A softmax head of `num_classes` with PyTorch's default initialisation.
    pub fn new(num_classes: usize) -> Self {
        Self {
            num_classes,
            activation: HeadActivation::Softmax,
            bias: BiasInit::Default,
        }
    }
    pub fn with_activation(mut self, activation: HeadActivation) -> Self {
        self.activation = activation;
        self
    }
    pub fn with_bias(mut self, bias: BiasInit) -> Self {
        self.bias = bias;
        self
    }

    /// Builds the linear layer: PyTorch's default init for the weight, then the chosen bias.
    pub(crate) fn linear(&self, d_input: usize, device: &Device) -> Linear {
        let mut linear = LinearConfig::new(d_input, self.num_classes).init(device);
        if let BiasInit::Constant(value) = self.bias {
            linear.bias = Some(Param::from_tensor(Tensor::full(
                [self.num_classes],
                value,
                device,
            )));
        }
        linear
    }
}

/// Rejects inputs the network cannot take, instead of failing deep inside a kernel.
pub(crate) fn check_input(model: &str, input: &Tensor<4>, min_size: usize) -> crate::Result<()> {
    let dims = input.dims();
    if dims[1] != 3 || dims[2] < min_size || dims[3] < min_size || dims[0] == 0 {
        return Err(crate::ModelError::BadInput {
            model: model.to_string(),
            min_size,
            shape: dims.to_vec(),
        });
    }
    Ok(())
}

/// `module` with each batch norm's training flag off: it normalises by its running statistics
/// and leaves them as they are, while its scale and shift keep whatever gradient setting they
/// have (Keras's advice for fine-tuning a pretrained network, and what small per-worker
/// batches need: statistics of 4 images swing too far). Other layers' flags (dropout) stay.
pub fn keep_batch_norm_statistics<M: burn::module::Module>(module: M) -> M {
    use burn::module::{Flag, ModuleMapper, Param};
    /// Whether each module entered is a batch norm, innermost last.
    struct Keep(Vec<bool>);
    impl ModuleMapper for Keep {
        fn enter_module(&mut self, _name: &str, container_type: &str) {
            self.0.push(container_type == "Struct:BatchNorm");
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.0.pop();
        }
        fn map_flag(&mut self, flag: Param<Flag>) -> Param<Flag> {
            if self.0.last() == Some(&true) {
                flag.with_value(false)
            } else {
                flag
            }
        }
    }
    module.map(&mut Keep(Vec::new()))
}

/// ResNet's stem pool: 3x3, stride 2, padding 1.
pub(crate) fn stem_pool() -> MaxPool2d {
    MaxPool2dConfig::new([3, 3])
        .with_strides([2, 2])
        .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
        .init()
}

/// VGG's pool: 2x2, stride 2.
pub(crate) fn vgg_pool() -> MaxPool2d {
    MaxPool2dConfig::new([2, 2]).with_strides([2, 2]).init()
}
