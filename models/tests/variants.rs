//! Every named variant: torchvision's exact parameter count, and full-size networks accept
//! small inputs (adaptive pooling) with the right output shapes; heads, freezing and kept
//! statistics; DenseNet's batch statistics passed from layer to layer change no bit.

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::prelude::*;
use hearth_models::{
    Architecture, BiasInit, BlockKind, HeadActivation, HeadConfig, ModelConfig, ResNetConfig,
};

#[test]
fn parameter_counts_equal_torchvision_for_every_variant() {
    let device = Device::flex();
    assert_eq!(Architecture::ALL.len(), 17);
    for arch in Architecture::ALL {
        let model = arch.init(1000, &device).unwrap();
        assert_eq!(
            model.learnable_params(),
            arch.torchvision_params(),
            "{arch}: parameter count differs from torchvision"
        );
    }
    // Spot values from torchvision's documentation, independent of the table in the code.
    let count = |a: Architecture| a.init(1000, &device).unwrap().learnable_params();
    assert_eq!(count(Architecture::ResNet50), 25_557_032);
    assert_eq!(count(Architecture::Vgg16), 138_357_544);
    assert_eq!(count(Architecture::DenseNet121), 7_978_856);
    // Burn's num_params adds batch norm's running mean and variance: ResNet-18 has 4,800
    // batch-norm channels.
    let r18 = Architecture::ResNet18.init(1000, &device).unwrap();
    assert_eq!(r18.num_params() - r18.learnable_params(), 2 * 4_800);
}

#[test]
fn names_resolve_and_unknown_names_list_the_choices() {
    for arch in Architecture::ALL {
        assert_eq!(Architecture::from_name(arch.name()).unwrap(), *arch);
    }
    assert_eq!(
        Architecture::from_name("VGG16-BN").unwrap(),
        Architecture::Vgg16Bn
    );
    let err = Architecture::from_name("resnet51").unwrap_err().to_string();
    assert!(
        err.contains("resnet51") && err.contains("densenet121"),
        "{err}"
    );
}

#[test]
fn full_size_models_run_on_32x32_inputs() {
    let device = Device::flex();
    for arch in [
        Architecture::ResNet50,
        Architecture::DenseNet121,
        Architecture::Vgg16,
        Architecture::ResNet18,
    ] {
        let model = arch.init(7, &device).unwrap().valid();
        let x = Tensor::<4>::ones([2, 3, 32, 32], &device);
        assert_eq!(model.forward(x.clone()).dims(), [2, 7], "{arch}");
        let embed = model.embed(x.clone()).dims();
        let expected = match arch {
            Architecture::ResNet50 => 2048,
            Architecture::ResNet18 => 512,
            Architecture::DenseNet121 => 1024,
            _ => 4096,
        };
        assert_eq!(embed, [2, expected], "{arch} embed");
        assert_eq!(model.head_inputs(), expected);
        let features = model.features(x).dims();
        assert_eq!(features[0], 2);
    }
    // Non-square, larger input.
    let m = Architecture::ResNet18.init(3, &device).unwrap().valid();
    assert_eq!(
        m.forward(Tensor::<4>::ones([1, 3, 48, 64], &device)).dims(),
        [1, 3]
    );
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let device = Device::flex();
    let model = Architecture::ResNet18.init(3, &device).unwrap().valid();
    let err = model
        .try_forward(Tensor::<4>::ones([1, 1, 32, 32], &device))
        .unwrap_err()
        .to_string();
    assert!(err.contains("[1, 1, 32, 32]"), "{err}");
    assert!(
        model
            .try_forward(Tensor::<4>::ones([1, 3, 16, 64], &device))
            .is_err()
    );
    assert!(Architecture::ResNet18.init(0, &device).is_err());
    let bad = ResNetConfig::new(BlockKind::Basic, [1, 0, 1, 1], 3).init(&device);
    assert!(bad.unwrap_err().to_string().contains("every stage"));
}

fn small_resnet(device: &Device) -> hearth_models::Classifier {
    ModelConfig::ResNet(
        ResNetConfig::new(BlockKind::Basic, [1, 1, 1, 1], 4)
            .with_stem_width(8)
            .with_stage_widths([8, 8, 16, 16]),
    )
    .init(device)
    .unwrap()
}

#[test]
fn replacing_the_head_sets_classes_activation_and_bias() {
    let device = Device::flex();
    let model = small_resnet(&device)
        .replace_head(
            HeadConfig::new(14)
                .with_activation(HeadActivation::Sigmoid)
                .with_bias(BiasInit::Constant(1.0)),
            &device,
        )
        .unwrap();
    assert_eq!(model.num_classes(), 14);
    assert_eq!(model.head_activation(), HeadActivation::Sigmoid);
    let hearth_models::Classifier::ResNet(r) = &model else {
        panic!("still a ResNet")
    };
    let bias: Vec<f32> =
        r.fc.bias
            .as_ref()
            .unwrap()
            .val()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
    assert_eq!(bias, vec![1.0; 14]);
    let probs = model
        .valid()
        .predict(Tensor::<4>::ones([2, 3, 32, 32], &device));
    let p: Vec<f32> = probs.into_data().try_to_vec::<f32>().unwrap();
    // Sigmoid outputs need not sum to one, but lie in (0, 1).
    assert!(p.iter().all(|v| *v > 0.0 && *v < 1.0));
}

#[test]
fn a_frozen_backbone_gets_no_gradients_and_the_head_does() {
    let device = Device::flex().autodiff();
    let model = small_resnet(&device).freeze_backbone();
    let x = Tensor::<4>::ones([2, 3, 32, 32], &device);
    let loss = model.forward(x).sum();
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    // Only the head's weight and bias.
    assert_eq!(grads.len(), 2);
    let unfrozen = model.unfreeze_all();
    let loss = unfrozen
        .forward(Tensor::<4>::ones([2, 3, 32, 32], &device))
        .sum();
    let grads = GradientsParams::from_grads(loss.backward(), &unfrozen);
    assert!(grads.len() > 2);
}

#[test]
fn kept_batch_norm_statistics_stay_while_everything_trains() {
    let device = Device::flex().autodiff();
    let unfrozen = small_resnet(&device).unfreeze_all();
    // (A clone shares its running statistics: `unfrozen` runs last, as it updates them.)
    let kept = hearth_models::keep_batch_norm_statistics(unfrozen.clone());
    let before = every_value(&kept);
    let kept_trains = trained(&kept);
    // The running statistics did not move, and a forward on the training device gives what
    // inference gives.
    assert_eq!(before, every_value(&kept));
    let x = || Tensor::<4>::ones([2, 3, 32, 32], &Device::flex());
    let on_training_device = kept.forward(x().autodiff()).into_data();
    let infer = kept.valid().forward(x()).into_data();
    on_training_device
        .clone()
        .assert_approx_eq::<f32>(&infer, burn::tensor::Tolerance::rel_abs(1e-4, 1e-5));
    // Every parameter still trains, batch norm's scale and shift included ...
    assert_eq!(kept_trains, trained(&unfrozen));
    // ... and the plain unfrozen model normalises by the batch: another output.
    let (a, b) = (
        unfrozen.forward(x().autodiff()).into_data().to_vec_f32(),
        infer.to_vec_f32(),
    );
    assert!(
        a.iter().zip(&b).any(|(p, q)| (p - q).abs() > 1e-3),
        "{a:?} {b:?}"
    );
}

trait F32s {
    fn to_vec_f32(self) -> Vec<f32>;
}
impl F32s for TensorData {
    fn to_vec_f32(self) -> Vec<f32> {
        self.convert::<f32>().try_to_vec::<f32>().unwrap()
    }
}

/// Values that get a gradient from a forward pass of random images.
fn trained(model: &hearth_models::Classifier) -> usize {
    struct Count<'a>(&'a GradientsParams, usize);
    impl burn::module::ModuleVisitor for Count<'_> {
        fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<D>>) {
            if self.0.get::<D>(p.id).is_some() {
                self.1 += p.shape().num_elements();
            }
        }
    }
    let device = Device::flex().autodiff();
    let x = Tensor::<4>::random([4, 3, 32, 32], burn::tensor::Distribution::Default, &device);
    let grads = GradientsParams::from_grads(model.forward(x).sum().backward(), model);
    let mut c = Count(&grads, 0);
    model.visit(&mut c);
    c.1
}

/// Every float value of `model` (parameters and running statistics), in visiting order.
fn every_value<M: Module>(model: &M) -> Vec<f32> {
    struct All(Vec<f32>);
    impl burn::module::ModuleVisitor for All {
        fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<D>>) {
            self.0.extend(p.val().into_data().to_vec_f32());
        }
    }
    let _ = model.valid();
    let mut a = All(Vec::new());
    model.visit(&mut a);
    a.0
}

/// DenseNet's layers pass their input's batch statistics on to the next layer and the
/// transition (each input is the one before's with new channels after it): the features,
/// every parameter's gradient and the running statistics equal, bit for bit, those of each
/// batch norm computing its statistics afresh.
#[test]
fn densenet_passing_batch_statistics_on_changes_no_bit() {
    use burn::tensor::Distribution;
    use hearth_kernels::norm::batch_norm;
    use hearth_models::{DenseNet, DenseNetConfig};

    let device = Device::flex().autodiff();
    let config = DenseNetConfig::new(4, vec![3, 2], 8, 5).with_bn_size(2);
    let passing = config.init(&device).unwrap();
    let afresh: DenseNet = config
        .init(&device)
        .unwrap()
        .load_record(passing.clone().into_record());
    assert_eq!(every_value(&passing), every_value(&afresh));
    let x = Tensor::<4>::random([2, 3, 32, 32], Distribution::Normal(0.0, 1.0), &device);
    let stem = |m: &DenseNet, x: Tensor<4>| {
        let f = &m.features;
        hearth_kernels::pool::max_pool(
            &f.pool0,
            batch_norm(&f.norm0, hearth_kernels::conv2d(&f.conv0, x), true),
        )
    };
    // The same pieces as `DenseNet::features`, every batch norm on its own.
    let features_afresh = |m: &DenseNet, x: Tensor<4>| {
        let f = &m.features;
        let mut x = stem(m, x);
        for (i, block) in f.blocks.iter().enumerate() {
            let mut all = vec![x];
            for layer in &block.layers {
                let new = layer.new_features(Tensor::cat(all.clone(), 1));
                all.push(new);
            }
            x = Tensor::cat(all, 1);
            if let Some(t) = f.transitions.get(i) {
                x = t.forward(x);
            }
        }
        batch_norm(&f.norm5, x, false)
    };
    // Output, then every parameter's gradient in visiting order, of a weighted sum.
    let weights = Tensor::<4>::random([2, 18, 4, 4], Distribution::Normal(0.0, 1.0), &device);
    let outcome = |m: &DenseNet, y: Tensor<4>| {
        assert_eq!(y.dims(), [2, 18, 4, 4]);
        let out = y.clone().into_data().to_vec_f32();
        let grads = GradientsParams::from_grads((y * weights.clone()).sum().backward(), m);
        struct Collect<'a>(&'a GradientsParams, Vec<Vec<f32>>);
        impl burn::module::ModuleVisitor for Collect<'_> {
            fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<D>>) {
                if let Some(g) = self.0.get::<D>(p.id) {
                    self.1.push(g.into_data().to_vec_f32());
                }
            }
        }
        let mut c = Collect(&grads, Vec::new());
        m.visit(&mut c);
        assert!(c.1.len() > 10, "gradients of the parameters");
        (out, c.1)
    };
    let with_passing = outcome(&passing, passing.features(x.clone()));
    // The two models keep their own running statistics: the run above moved only its own.
    assert_ne!(every_value(&passing), every_value(&afresh));
    let without = outcome(&afresh, features_afresh(&afresh, x.clone()));
    assert_eq!(with_passing.0, without.0, "features");
    assert_eq!(with_passing.1, without.1, "gradients");
    assert_eq!(
        every_value(&passing),
        every_value(&afresh),
        "running statistics"
    );
    // The path under test took the statistics: a block hands its last layer's on.
    let f = &passing.features;
    assert!(
        f.blocks[0]
            .forward_with_stats(stem(&passing, x))
            .1
            .is_some()
    );
}

/// ZeRO stage 3 cuts convolution weights into pieces of output channels only where one group
/// computes them: a ResNeXt-shaped network names each block's grouped 3x3 weight, a ResNet
/// and a VGG none.
#[test]
fn grouped_convolution_weights_are_named() {
    let device = Device::flex();
    let bottleneck = |groups: usize| {
        ModelConfig::ResNet(
            ResNetConfig::new(BlockKind::Bottleneck, [1, 2, 1, 1], 4)
                .with_groups(groups)
                .with_stem_width(8)
                .with_stage_widths([8, 8, 16, 16]),
        )
        .init(&device)
        .unwrap()
    };
    let grouped = bottleneck(2);
    let hearth_models::Classifier::ResNet(r) = &grouped else {
        panic!("a ResNet configuration built {}", grouped.family());
    };
    let blocks: Vec<_> = [&r.layer1, &r.layer2, &r.layer3, &r.layer4]
        .into_iter()
        .flatten()
        .map(|b| b.conv2.weight.id)
        .collect();
    assert_eq!(blocks.len(), 5);
    assert_eq!(grouped.grouped_conv_weights(), blocks);
    assert!(bottleneck(1).grouped_conv_weights().is_empty());
    assert!(small_resnet(&device).grouped_conv_weights().is_empty());
}
