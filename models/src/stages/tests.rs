//! Units compose to their whole networks and count like torchvision.

use super::*;
use crate::resnet::BlockKind;
use crate::{DenseNetConfig, ResNetConfig, VggConfig};

/// Learnable parameters of built units.
fn total(units: crate::Result<Vec<Unit>>) -> usize {
    units.unwrap().iter().map(Unit::learnable_params).sum()
}

/// Runs `units` in turn, checking that each says the channels it is given.
fn run(units: &[Unit], x: Tensor<4>) -> Tensor<2> {
    let mut x = x;
    for (i, u) in units.iter().enumerate() {
        assert_eq!(u.in_channels(), x.dims()[1], "unit {i}: {}", u.kind());
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
        let x = Tensor::<4>::random([2, 3, 32, 32], burn::tensor::Distribution::Default, &device);
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
        let x = Tensor::<4>::random([1, 3, 32, 32], burn::tensor::Distribution::Default, &device);
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
