//! Named variants, a single [`Classifier`] type over all architectures, and head surgery.

use burn::config::Config;
use burn::module::Module;
use burn::prelude::*;

use crate::ModelError;
use crate::densenet::{DenseNet, DenseNetConfig};
use crate::layers::{HeadActivation, HeadConfig, check_input};
use crate::resnet::{ResNet, ResNetConfig};
use crate::vgg::{Vgg, VggConfig};

/// Smallest input side every architecture accepts (adaptive pooling does the rest).
pub const MIN_INPUT_SIZE: usize = 32;

/// The configuration of any supported network.
#[derive(Config, Debug)]
pub enum ModelConfig {
    ResNet(ResNetConfig),
    Vgg(VggConfig),
    DenseNet(DenseNetConfig),
}

impl ModelConfig {
    pub fn init(&self, device: &Device) -> crate::Result<Classifier> {
        Ok(match self {
            ModelConfig::ResNet(c) => Classifier::ResNet(c.init(device)?),
            ModelConfig::Vgg(c) => Classifier::Vgg(c.init(device)?),
            ModelConfig::DenseNet(c) => Classifier::DenseNet(c.init(device)?),
        })
    }

    pub fn num_classes(&self) -> usize {
        match self {
            ModelConfig::ResNet(c) => c.num_classes,
            ModelConfig::Vgg(c) => c.num_classes,
            ModelConfig::DenseNet(c) => c.num_classes,
        }
    }

    /// The same network with another class count.
    pub fn with_classes(mut self, num_classes: usize) -> Self {
        match &mut self {
            ModelConfig::ResNet(c) => c.num_classes = num_classes,
            ModelConfig::Vgg(c) => c.num_classes = num_classes,
            ModelConfig::DenseNet(c) => c.num_classes = num_classes,
        }
        self
    }

    pub fn to_json(&self) -> String {
        burn::config::config_to_json(self)
    }

    pub fn from_json(json: &str) -> std::result::Result<Self, String> {
        Self::load_binary(json.as_bytes()).map_err(|e| e.to_string())
    }
}

macro_rules! architectures {
    ($( $variant:ident => $name:literal, $params:literal, $gmacs:literal, $cfg:expr; )*) => {
        /// Every named variant, with torchvision's name.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Architecture { $( $variant, )* }

        impl Architecture {
            pub const ALL: &'static [Architecture] = &[ $( Architecture::$variant, )* ];

            /// torchvision's name, e.g. `resnet50`, `vgg16_bn`, `densenet121`.
            pub fn name(self) -> &'static str {
                match self { $( Architecture::$variant => $name, )* }
            }

            /// The parameter count torchvision reports for 1000 classes.
            pub fn torchvision_params(self) -> usize {
                match self { $( Architecture::$variant => $params, )* }
            }

            /// Multiply-accumulates of one 224x224 forward pass, in billions, as torchvision's
            /// model table lists them (its "GFLOPS" column counts multiply-adds).
            pub fn torchvision_gmacs(self) -> f64 {
                match self { $( Architecture::$variant => $gmacs, )* }
            }

            /// The configuration of this variant with `num_classes` outputs.
            pub fn config(self, num_classes: usize) -> ModelConfig {
                let n = num_classes;
                match self { $( Architecture::$variant => $cfg(n), )* }
            }
        }
    };
}

architectures! {
    ResNet18 => "resnet18", 11_689_512, 1.81, |n| ModelConfig::ResNet(ResNetConfig::resnet18(n));
    ResNet34 => "resnet34", 21_797_672, 3.66, |n| ModelConfig::ResNet(ResNetConfig::resnet34(n));
    ResNet50 => "resnet50", 25_557_032, 4.09, |n| ModelConfig::ResNet(ResNetConfig::resnet50(n));
    ResNet101 => "resnet101", 44_549_160, 7.80, |n| ModelConfig::ResNet(ResNetConfig::resnet101(n));
    ResNet152 => "resnet152", 60_192_808, 11.51, |n| ModelConfig::ResNet(ResNetConfig::resnet152(n));
    Vgg11 => "vgg11", 132_863_336, 7.61, |n| ModelConfig::Vgg(VggConfig::vgg11(n, false));
    Vgg11Bn => "vgg11_bn", 132_868_840, 7.61, |n| ModelConfig::Vgg(VggConfig::vgg11(n, true));
    Vgg13 => "vgg13", 133_047_848, 11.31, |n| ModelConfig::Vgg(VggConfig::vgg13(n, false));
    Vgg13Bn => "vgg13_bn", 133_053_736, 11.31, |n| ModelConfig::Vgg(VggConfig::vgg13(n, true));
    Vgg16 => "vgg16", 138_357_544, 15.47, |n| ModelConfig::Vgg(VggConfig::vgg16(n, false));
    Vgg16Bn => "vgg16_bn", 138_365_992, 15.47, |n| ModelConfig::Vgg(VggConfig::vgg16(n, true));
    Vgg19 => "vgg19", 143_667_240, 19.63, |n| ModelConfig::Vgg(VggConfig::vgg19(n, false));
    Vgg19Bn => "vgg19_bn", 143_678_248, 19.63, |n| ModelConfig::Vgg(VggConfig::vgg19(n, true));
    DenseNet121 => "densenet121", 7_978_856, 2.83, |n| ModelConfig::DenseNet(DenseNetConfig::densenet121(n));
    DenseNet161 => "densenet161", 28_681_000, 7.73, |n| ModelConfig::DenseNet(DenseNetConfig::densenet161(n));
    DenseNet169 => "densenet169", 14_149_480, 3.36, |n| ModelConfig::DenseNet(DenseNetConfig::densenet169(n));
    DenseNet201 => "densenet201", 20_013_928, 4.29, |n| ModelConfig::DenseNet(DenseNetConfig::densenet201(n));
}

impl Architecture {
    /// Looks a variant up by torchvision's name (case-insensitive, `-` accepted for `_`).
    pub fn from_name(name: &str) -> crate::Result<Self> {
        let wanted = name.trim().to_ascii_lowercase().replace('-', "_");
        Self::ALL
            .iter()
            .copied()
            .find(|a| a.name() == wanted)
            .ok_or_else(|| ModelError::UnknownModel {
                name: name.to_string(),
                known: Self::ALL
                    .iter()
                    .map(|a| a.name())
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    /// Builds the variant with `num_classes` outputs.
    pub fn init(self, num_classes: usize, device: &Device) -> crate::Result<Classifier> {
        self.config(num_classes).init(device)
    }
}

impl std::fmt::Display for Architecture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Any supported image classifier. Inputs are `[batch, 3, H, W]` with H, W >= 32, normalised
/// as torchvision does (ImageNet mean and std); outputs are logits `[batch, classes]`.
#[derive(Module, Debug)]
// Built once per run: boxing the largest variant would add an indirection to every match.
#[allow(clippy::large_enum_variant)]
pub enum Classifier {
    ResNet(ResNet),
    Vgg(Vgg),
    DenseNet(DenseNet),
}

/// Counts learnable parameters the way torchvision does (`sum(p.numel() for p in
/// model.parameters())`): Burn's `num_params` also counts batch norm's running mean and variance.
struct LearnableCounter {
    path: Vec<String>,
    count: usize,
}

impl burn::module::ModuleVisitor for LearnableCounter {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
        let running = self
            .path
            .last()
            .is_some_and(|n| n == "running_mean" || n == "running_var");
        if !running {
            self.count += param.lazy_shape().num_elements();
        }
    }
}

/// Learnable parameters of any module, as torchvision counts them (batch-norm running
/// statistics excluded). Allocates nothing.
pub(crate) fn learnable_params_of<M: Module>(module: &M) -> usize {
    let mut counter = LearnableCounter {
        path: Vec::new(),
        count: 0,
    };
    module.visit(&mut counter);
    counter.count
}

impl Classifier {
    /// Learnable parameters, as torchvision counts them (batch-norm running statistics
    /// excluded; Burn's [`Module::num_params`] includes them). Allocates nothing.
    pub fn learnable_params(&self) -> usize {
        learnable_params_of(self)
    }

    /// The weights of its convolutions of more than one group (ResNeXt's 3x3s), which a
    /// product taking a weight a piece of output channels at a time (ZeRO stage 3's pieces of
    /// rows, `hearth_kernels::keyed`) does not cover.
    pub fn grouped_conv_weights(&self) -> Vec<burn::module::ParamId> {
        match self {
            Classifier::ResNet(m) => [&m.layer1, &m.layer2, &m.layer3, &m.layer4]
                .into_iter()
                .flatten()
                .filter(|b| b.conv2.groups != 1)
                .map(|b| b.conv2.weight.id)
                .collect(),
            Classifier::Vgg(_) | Classifier::DenseNet(_) => Vec::new(),
        }
    }

    pub fn family(&self) -> &'static str {
        match self {
            Classifier::ResNet(_) => "ResNet",
            Classifier::Vgg(_) => "VGG",
            Classifier::DenseNet(_) => "DenseNet",
        }
    }

    /// Logits `[batch, num_classes]`.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        match self {
            Classifier::ResNet(m) => m.forward(x),
            Classifier::Vgg(m) => m.forward(x),
            Classifier::DenseNet(m) => m.forward(x),
        }
    }

    /// Logits in f32, computed in `dtype`: with bf16 or f16 the input is cast, every
    /// convolution, linear layer and activation runs in that type over f32 parameters cast on
    /// the way in (their gradients come back f32), batch norm normalises in f32, and the
    /// logits are cast back for the loss (mixed precision; see `hearth_kernels::precision`).
    pub fn forward_in(&self, x: Tensor<4>, dtype: burn::tensor::FloatDType) -> Tensor<2> {
        use burn::tensor::FloatDType;
        match dtype {
            FloatDType::BF16 | FloatDType::F16 => {
                let x = hearth_kernels::cast(x, dtype);
                hearth_kernels::cast(self.forward(x), FloatDType::F32)
            }
            _ => self.forward(x),
        }
    }

    /// [`Classifier::forward`] after checking the input shape: an error instead of a panic.
    pub fn try_forward(&self, x: Tensor<4>) -> crate::Result<Tensor<2>> {
        check_input(self.family(), &x, MIN_INPUT_SIZE)?;
        Ok(self.forward(x))
    }

    /// The convolutional feature map, before global pooling and the classifier.
    pub fn features(&self, x: Tensor<4>) -> Tensor<4> {
        match self {
            Classifier::ResNet(m) => m.features(x),
            Classifier::Vgg(m) => m.features(x),
            Classifier::DenseNet(m) => m.features(x),
        }
    }

    /// Features-only forward: the input of the head, `[batch, head_inputs]`.
    pub fn embed(&self, x: Tensor<4>) -> Tensor<2> {
        match self {
            Classifier::ResNet(m) => m.embed(x),
            Classifier::Vgg(m) => m.embed(x),
            Classifier::DenseNet(m) => m.embed(x),
        }
    }

    fn head(&self) -> &burn::nn::Linear {
        match self {
            Classifier::ResNet(m) => &m.fc,
            Classifier::Vgg(m) => &m.classifier.fc3,
            Classifier::DenseNet(m) => &m.classifier,
        }
    }

    /// Module path prefix of the head's parameters (`fc.`, `classifier.fc3.`, `classifier.`).
    pub fn head_prefix(&self) -> &'static str {
        match self {
            Classifier::ResNet(_) => "fc.",
            Classifier::Vgg(_) => "classifier.fc3.",
            Classifier::DenseNet(_) => "classifier.",
        }
    }

    /// The head's outputs, from its weight's shape: a lazy head is not made (made, its values
    /// would be drawn from the process's one random generator, taking the draws of a seeded
    /// initialisation running beside it).
    pub fn num_classes(&self) -> usize {
        self.head().weight.lazy_shape().dims::<2>()[1]
    }

    /// The head's inputs, read as [`Self::num_classes`] is.
    pub fn head_inputs(&self) -> usize {
        self.head().weight.lazy_shape().dims::<2>()[0]
    }

    pub fn head_activation(&self) -> HeadActivation {
        match self {
            Classifier::ResNet(m) => m.head,
            Classifier::Vgg(m) => m.head,
            Classifier::DenseNet(m) => m.head,
        }
    }

    /// Probabilities through the head's activation (softmax or sigmoid).
    pub fn predict(&self, x: Tensor<4>) -> Tensor<2> {
        self.head_activation().probabilities(self.forward(x))
    }

    /// Replaces the classifier head with a fresh one (transfer learning). The new head is
    /// trainable even if the backbone is frozen.
    pub fn replace_head(self, head: HeadConfig, device: &Device) -> crate::Result<Self> {
        if head.num_classes == 0 {
            return Err(ModelError::InvalidConfig {
                model: self.family(),
                reason: "a head needs at least 1 class".into(),
            });
        }
        let linear = head.linear(self.head_inputs(), device);
        Ok(match self {
            Classifier::ResNet(mut m) => {
                m.fc = linear;
                m.head = head.activation;
                Classifier::ResNet(m)
            }
            Classifier::Vgg(mut m) => {
                m.classifier.fc3 = linear;
                m.head = head.activation;
                Classifier::Vgg(m)
            }
            Classifier::DenseNet(mut m) => {
                m.classifier = linear;
                m.head = head.activation;
                Classifier::DenseNet(m)
            }
        })
    }

    /// Sets the head activation without touching the weights (used when loading).
    pub fn with_head_activation(self, activation: HeadActivation) -> Self {
        match self {
            Classifier::ResNet(mut m) => {
                m.head = activation;
                Classifier::ResNet(m)
            }
            Classifier::Vgg(mut m) => {
                m.head = activation;
                Classifier::Vgg(m)
            }
            Classifier::DenseNet(mut m) => {
                m.head = activation;
                Classifier::DenseNet(m)
            }
        }
    }

    /// Freezes everything but the head: no gradients, batch norm statistics fixed.
    pub fn freeze_backbone(self) -> Self {
        match self.freeze() {
            Classifier::ResNet(mut m) => {
                m.fc = m.fc.unfreeze();
                Classifier::ResNet(m)
            }
            Classifier::Vgg(mut m) => {
                m.classifier.fc3 = m.classifier.fc3.unfreeze();
                Classifier::Vgg(m)
            }
            Classifier::DenseNet(mut m) => {
                m.classifier = m.classifier.unfreeze();
                Classifier::DenseNet(m)
            }
        }
    }

    /// Makes every parameter trainable again (fine-tuning).
    pub fn unfreeze_all(self) -> Self {
        self.unfreeze()
    }

    /// Key renames from a torchvision state_dict (regex, replacement), applied in order.
    pub fn torchvision_remaps(&self) -> Vec<(String, String)> {
        let mut remaps = vec![
            // nn.DataParallel / DDP checkpoints prefix every key with "module.".
            (r"^module\.".to_string(), String::new()),
        ];
        remaps.extend(match self {
            Classifier::ResNet(_) => ResNet::torchvision_remaps(),
            Classifier::Vgg(m) => m.torchvision_remaps(),
            Classifier::DenseNet(m) => m.torchvision_remaps(),
        });
        remaps
    }

    /// Regex remaps (pattern, replacement) from this network's parameter paths to
    /// torchvision's state_dict keys: [`Self::torchvision_remaps`] the other way.
    pub fn torchvision_export_remaps(&self) -> Vec<(String, String)> {
        match self {
            Classifier::ResNet(_) => ResNet::torchvision_export_remaps(),
            Classifier::Vgg(m) => m.torchvision_export_remaps(),
            Classifier::DenseNet(m) => m.torchvision_export_remaps(),
        }
    }
}
