//! The one-pass max pool for inference equals Burn's `MaxPool2d` exactly (a maximum is not
//! rounded): the stems' 3x3 stride 2 with padding 1, VGG's 2x2 stride 2, odd sides, dilation,
//! windows wider than their stride, NaN propagation; and it leaves training to Burn.

use burn::nn::PaddingConfig2d;
use burn::nn::pool::MaxPool2dConfig;
use burn::prelude::*;
use burn::tensor::Distribution;
use hearth_kernels::pool::{PoolGeometry, max_pool, max_pool2d};

mod common;
use common::values;

#[test]
fn inference_max_pool_equals_burns_exactly() {
    let device = Device::flex();
    // (n, c, h, w, kernel, stride, padding, dilation)
    let cases = [
        (2, 3, 12, 12, 3, 2, 1, 1),
        (1, 2, 13, 11, 3, 2, 1, 1),
        (2, 4, 10, 10, 2, 2, 0, 1),
        (1, 3, 9, 7, 2, 2, 0, 1),
        (2, 2, 9, 9, 3, 1, 1, 1),
        (1, 2, 11, 10, 3, 2, 1, 2),
        (3, 1, 5, 6, 3, 3, 0, 1),
        (1, 1, 1, 1, 1, 1, 0, 1),
    ];
    for (n, c, h, w, k, s, p, d) in cases {
        let what = format!("{n}x{c}x{h}x{w} k{k} s{s} p{p} d{d}");
        let pool = MaxPool2dConfig::new([k, k])
            .with_strides([s, s])
            .with_padding(PaddingConfig2d::Explicit(p, p, p, p))
            .with_dilation([d, d])
            .init();
        let x = Tensor::<4>::random([n, c, h, w], Distribution::Normal(0.0, 1.0), &device);
        let ours = max_pool(&pool, x.clone());
        let reference = pool.forward(x);
        assert_eq!(ours.dims(), reference.dims(), "{what}: shape");
        assert_eq!(values(ours), values(reference), "{what}");
    }
}

#[test]
fn nan_wins_and_padding_never_does() {
    let g = PoolGeometry {
        kernel: [3, 3],
        stride: [2, 2],
        padding: [1, 1],
        dilation: [1, 1],
    };
    // All negative: a padded -∞ must not win, and a NaN must.
    let mut x = vec![-5.0f32; 25];
    x[0] = -1.0;
    x[12] = f32::NAN;
    let y = max_pool2d(&x, [1, 1, 5, 5], &g);
    assert_eq!(y.len(), 9);
    assert_eq!(y[0], -1.0, "top-left window: the largest real value");
    assert!(y[4].is_nan(), "the centre window holds the NaN: {y:?}");
    assert_eq!(y[8], -5.0, "bottom-right window");
    assert_eq!(g.out_side(0, 5), Some(3));
    assert_eq!(
        g.out_side(0, 0),
        None,
        "a 3-wide window does not fit 0 + 2 padding"
    );
}

#[test]
fn training_keeps_burns_pool_and_its_gradient() {
    let device = Device::flex().autodiff();
    let pool = MaxPool2dConfig::new([3, 3])
        .with_strides([2, 2])
        .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
        .init();
    let x =
        Tensor::<4>::random([2, 3, 9, 9], Distribution::Normal(0.0, 1.0), &device).require_grad();
    let grads = max_pool(&pool, x.clone()).sum().backward();
    let g = values(x.grad(&grads).expect("the pool passes a gradient"));
    // Every output's gradient lands on one input: the total is the number of outputs.
    let total: f32 = g.iter().sum();
    assert_eq!(total, (2 * 3 * 5 * 5) as f32);
}
