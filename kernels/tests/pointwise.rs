//! The pointwise path equals Burn's conv2d forward and backward (input, weight and bias
//! gradients) within 1e-4 relative, over random shapes (odd sizes, batch 1, one channel), and
//! the path choice follows the convolution's settings and the switch.

use burn::nn::PaddingConfig2d;
use burn::nn::conv::Conv2dConfig;
use burn::prelude::*;
use burn::tensor::Distribution;
use burn::tensor::ops::ConvOptions;
use hearth_kernels::{Path, fast_path, pointwise_strided};

mod common;
use common::{Shapes, close, values};

#[test]
fn pointwise_equals_burn_conv2d_forward_and_backward_over_random_shapes() {
    let device = Device::flex().autodiff();
    let mut g = Shapes(0x9e37_79b9_7f4a_7c15);
    let mut cases = vec![
        (1, 1, 1, 1, 1, 1),
        (1, 3, 2, 5, 7, 1),
        (2, 64, 32, 7, 7, 1),
        (2, 8, 16, 7, 7, 2),
        (1, 3, 4, 5, 8, 3),
    ];
    for _ in 0..30 {
        cases.push((
            g.next(1, 3),
            g.next(1, 9),
            g.next(1, 9),
            g.next(1, 8),
            g.next(1, 8),
            g.next(1, 3),
        ));
    }
    for (n, ci, co, h, w, stride) in cases {
        let what = format!("n{n} ci{ci} co{co} {h}x{w} stride {stride}");
        let (ho, wo) = ((h - 1) / stride + 1, (w - 1) / stride + 1);
        let x0 = Tensor::<4>::random([n, ci, h, w], Distribution::Normal(0.0, 1.0), &device);
        let w0 = Tensor::<4>::random([co, ci, 1, 1], Distribution::Normal(0.0, 1.0), &device);
        let b0 = Tensor::<1>::random([co], Distribution::Normal(0.0, 1.0), &device);
        let dy = Tensor::<4>::random([n, co, ho, wo], Distribution::Normal(0.0, 1.0), &device);
        let run = |fast: bool| {
            let x = x0.clone().detach().require_grad();
            let wt = w0.clone().detach().require_grad();
            let b = b0.clone().detach().require_grad();
            let y = if fast {
                pointwise_strided(x.clone(), wt.clone(), Some(b.clone()), [stride, stride])
            } else {
                burn::tensor::module::conv2d(
                    x.clone(),
                    wt.clone(),
                    Some(b.clone()),
                    ConvOptions::new([stride, stride], [0, 0], [1, 1], 1),
                )
            };
            let out = values(y.clone());
            let grads = (y * dy.clone()).sum().backward();
            (
                out,
                values(x.grad(&grads).unwrap()),
                values(wt.grad(&grads).unwrap()),
                values(b.grad(&grads).unwrap()),
            )
        };
        let (fast, reference) = (run(true), run(false));
        close(&fast.0, &reference.0, &format!("{what} forward"));
        close(&fast.1, &reference.1, &format!("{what} input grad"));
        close(&fast.2, &reference.2, &format!("{what} weight grad"));
        close(&fast.3, &reference.3, &format!("{what} bias grad"));
    }
}

#[test]
fn training_convolutions_on_the_cpu_take_the_fast_paths() {
    let device = Device::flex();
    let conv = |k: usize, stride: usize, pad: usize, groups: usize| {
        Conv2dConfig::new([4, 4], [k, k])
            .with_stride([stride, stride])
            .with_padding(PaddingConfig2d::Explicit(pad, pad, pad, pad))
            .with_groups(groups)
            .init(&device)
    };
    assert_eq!(
        fast_path(&conv(1, 1, 0, 1), &device, true),
        Path::Gemm,
        "inference takes the GEMM op (which keeps Flex's forward where it is faster)"
    );
    assert_eq!(fast_path(&conv(1, 2, 0, 1), &device, true), Path::Gemm);
    assert_eq!(
        fast_path(&conv(1, 1, 0, 1), &device, false),
        Path::Reference,
        "switched off"
    );
    let device = device.clone().autodiff();
    assert_eq!(fast_path(&conv(1, 1, 0, 1), &device, true), Path::Gemm);
    assert_eq!(
        fast_path(&conv(1, 1, 0, 1), &device, false),
        Path::Reference,
        "switched off"
    );
    assert_eq!(fast_path(&conv(3, 1, 1, 1), &device, true), Path::Gemm);
    assert_eq!(fast_path(&conv(3, 2, 1, 1), &device, true), Path::Gemm);
    assert_eq!(fast_path(&conv(1, 2, 0, 1), &device, true), Path::Pointwise);
    assert_eq!(fast_path(&conv(1, 1, 1, 1), &device, true), Path::Gemm);
    assert_eq!(
        fast_path(&conv(1, 1, 0, 2), &device, true),
        Path::Reference,
        "grouped convolutions keep Burn's path"
    );
    assert_eq!(fast_path(&conv(3, 1, 1, 2), &device, true), Path::Reference);
    let asymmetric = Conv2dConfig::new([4, 4], [3, 3])
        .with_padding(PaddingConfig2d::Explicit(1, 0, 2, 0))
        .init(&device);
    assert_eq!(fast_path(&asymmetric, &device, true), Path::Reference);
}

#[test]
fn the_strided_path_shrinks_the_image_on_plain_and_autodiff_devices() {
    for device in [Device::flex(), Device::flex().autodiff()] {
        let x = Tensor::<4>::random([1, 4, 56, 56], Distribution::Normal(0.0, 1.0), &device);
        let w = Tensor::<4>::random([8, 4, 1, 1], Distribution::Normal(0.0, 1.0), &device);
        let y = pointwise_strided(x, w, None, [2, 2]);
        assert_eq!(y.dims(), [1, 8, 28, 28], "{device:?}");
    }
}

#[test]
fn a_strided_pointwise_module_equals_its_reference_forward() {
    let device = Device::flex().autodiff();
    let conv = Conv2dConfig::new([6, 10], [1, 1])
        .with_stride([2, 2])
        .with_padding(PaddingConfig2d::Explicit(0, 0, 0, 0))
        .init(&device);
    let x = Tensor::<4>::random([2, 6, 9, 8], Distribution::Normal(0.0, 1.0), &device);
    let fast = hearth_kernels::conv2d(&conv, x.clone());
    let reference = conv.forward(x);
    assert_eq!(fast.dims(), reference.dims());
    close(&values(fast), &values(reference), "module forward");
}
