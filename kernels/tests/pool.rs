//! The one-pass max pool for inference equals Burn's `MaxPool2d` exactly (a maximum is not
//! rounded): the stems' 3x3 stride 2 with padding 1, VGG's 2x2 stride 2, odd sides, dilation,
//! windows wider than their stride, NaN propagation; in training too, where its gradient
//! lands where Burn's does.

use burn::nn::PaddingConfig2d;
use burn::nn::pool::MaxPool2dConfig;
use burn::prelude::*;
use burn::tensor::Distribution;
use hearth_kernels::pool::{PoolGeometry, max_pool, max_pool2d};

mod common;
use common::values;

/// (n, c, h, w, kernel, stride, padding, dilation)
type Case = (usize, usize, usize, usize, usize, usize, usize, usize);

const CASES: [Case; 9] = [
    (2, 3, 12, 12, 3, 2, 1, 1),
    // Every window cut by the padding (no column of windows wholly inside).
    (1, 2, 5, 2, 3, 1, 1, 1),
    (1, 2, 13, 11, 3, 2, 1, 1),
    (2, 4, 10, 10, 2, 2, 0, 1),
    (1, 3, 9, 7, 2, 2, 0, 1),
    (2, 2, 9, 9, 3, 1, 1, 1),
    (1, 2, 11, 10, 3, 2, 1, 2),
    (3, 1, 5, 6, 3, 3, 0, 1),
    (1, 1, 1, 1, 1, 1, 0, 1),
];

fn pool(k: usize, s: usize, p: usize, d: usize) -> burn::nn::pool::MaxPool2d {
    MaxPool2dConfig::new([k, k])
        .with_strides([s, s])
        .with_padding(PaddingConfig2d::Explicit(p, p, p, p))
        .with_dilation([d, d])
        .init()
}

#[test]
fn inference_max_pool_equals_burns_exactly() {
    let device = Device::flex();
    for (n, c, h, w, k, s, p, d) in CASES {
        let what = format!("{n}x{c}x{h}x{w} k{k} s{s} p{p} d{d}");
        let pool = pool(k, s, p, d);
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

/// Training: the forward equals Burn's exactly and the gradient lands where Burn's does (the
/// argmax found again in the backward, with Flex's rule for ties), including windows of equal
/// values (a ReLU's zeros), overlapping windows (added in the same order: exact) and a NaN.
#[test]
fn training_pool_and_its_gradient_equal_burns() {
    let device = Device::flex().autodiff();
    for (n, c, h, w, k, s, p, d) in CASES {
        for relu in [false, true] {
            let what = format!("{n}x{c}x{h}x{w} k{k} s{s} p{p} d{d} relu {relu}");
            let pool = pool(k, s, p, d);
            let x0 = Tensor::<4>::random([n, c, h, w], Distribution::Normal(0.0, 1.0), &device);
            // Rounded to a few values so that windows hold ties, and after a ReLU many zeros.
            let x0 = x0.mul_scalar(2.0).round().div_scalar(2.0);
            let x0 = if relu {
                burn::tensor::activation::relu(x0)
            } else {
                x0
            };
            let run = |ours: bool| {
                let x = x0.clone().detach().require_grad();
                let y = if ours {
                    max_pool(&pool, x.clone())
                } else {
                    pool.forward(x.clone())
                };
                let dy = Tensor::<4>::random(y.dims(), Distribution::Normal(0.0, 1.0), &device);
                // The same output gradient for both: seeded by the output's shape.
                let dy = dy.mul_scalar(0.0).add(
                    Tensor::<1, Int>::arange(0..y.dims().iter().product::<usize>() as i64, &device)
                        .float()
                        .reshape(y.dims())
                        .div_scalar(7.0)
                        .sin(),
                );
                let out = values(y.clone());
                let grads = (y * dy).sum().backward();
                (
                    out,
                    values(x.grad(&grads).expect("the pool passes a gradient")),
                )
            };
            let (ours, theirs) = (run(true), run(false));
            assert_eq!(ours.0, theirs.0, "{what}: forward");
            assert_eq!(ours.1, theirs.1, "{what}: gradient");
        }
    }
}

#[test]
fn backward_sends_a_nan_windows_gradient_to_its_nan() {
    let g = PoolGeometry {
        kernel: [2, 2],
        stride: [2, 2],
        padding: [0, 0],
        dilation: [1, 1],
    };
    // One 2x2 window: 3 is the largest real value, but the NaN takes the gradient.
    let x = [3.0, f32::NAN, 1.0, 3.0];
    assert_eq!(
        hearth_kernels::pool::max_pool2d_backward(&x, &[5.0], [1, 1, 2, 2], &g),
        [0.0, 5.0, 0.0, 0.0]
    );
    // Ties: the first in row-major order.
    let x = [1.0, 3.0, 3.0, 3.0];
    assert_eq!(
        hearth_kernels::pool::max_pool2d_backward(&x, &[5.0], [1, 1, 2, 2], &g),
        [0.0, 5.0, 0.0, 0.0]
    );
}

/// (n, c, h, w, kernel, stride) of the average pools: DenseNet's 2x2 stride 2 transition,
/// odd sides (a row and a column no window covers), windows wider than their stride (inputs
/// shared by several windows), a 1x1 window.
const AVG_CASES: [(usize, usize, usize, usize, usize, usize); 6] = [
    (2, 3, 8, 8, 2, 2),
    (1, 2, 9, 7, 2, 2),
    (2, 2, 9, 9, 3, 1),
    (1, 3, 11, 10, 3, 2),
    (3, 1, 5, 6, 2, 3),
    (1, 1, 1, 1, 1, 1),
];

/// Training and inference: the forward and the gradient equal Burn's `AvgPool2d` exactly (the
/// same sums in the same order, divided the same way).
#[test]
fn average_pool_and_its_gradient_equal_burns() {
    use burn::nn::pool::AvgPool2dConfig;
    use hearth_kernels::pool::avg_pool;
    for autodiff in [false, true] {
        let device = if autodiff {
            Device::flex().autodiff()
        } else {
            Device::flex()
        };
        // Else `avg_pool` is Burn's module and this compares Burn with itself.
        assert!(hearth_kernels::enabled() && hearth_kernels::is_flex(&device));
        for (n, c, h, w, k, s) in AVG_CASES {
            let what = format!("{n}x{c}x{h}x{w} k{k} s{s} autodiff {autodiff}");
            let pool = AvgPool2dConfig::new([k, k]).with_strides([s, s]).init();
            let x0 = Tensor::<4>::random([n, c, h, w], Distribution::Normal(0.0, 1.0), &device);
            let run = |ours: bool| {
                let x = x0.clone().detach();
                let x = if autodiff { x.require_grad() } else { x };
                let y = if ours {
                    avg_pool(&pool, x.clone())
                } else {
                    pool.forward(x.clone())
                };
                let out = values(y.clone());
                if !autodiff {
                    return (out, Vec::new());
                }
                let count = y.dims().iter().product::<usize>() as i64;
                let dy = Tensor::<1, Int>::arange(0..count, &device)
                    .float()
                    .reshape(y.dims())
                    .div_scalar(7.0)
                    .sin();
                let grads = (y * dy).sum().backward();
                let dx = x.grad(&grads).expect("the pool passes a gradient");
                (out, values(dx))
            };
            let (ours, theirs) = (run(true), run(false));
            assert_eq!(ours.0.len(), theirs.0.len(), "{what}: output size");
            assert_eq!(ours.0, theirs.0, "{what}: forward");
            assert_eq!(ours.1, theirs.1, "{what}: gradient");
        }
    }
}

#[test]
fn average_pool_counts_the_window_and_skips_uncovered_inputs() {
    use hearth_kernels::pool::{avg_pool2d, avg_pool2d_backward};
    // 1 plane of 3x3, 2x2 windows of stride 2: one window; the last row and column unused.
    let x: Vec<f32> = (1..=9).map(|v| v as f32).collect();
    assert_eq!(avg_pool2d(&x, [1, 1, 3, 3], [2, 2], [2, 2]), vec![3.0]);
    assert_eq!(
        avg_pool2d_backward(&[8.0], [1, 1, 3, 3], [2, 2], [2, 2]),
        vec![2.0, 2.0, 0.0, 2.0, 2.0, 0.0, 0.0, 0.0, 0.0]
    );
    // Overlapping 2x2 windows of stride 1 on 1x3: the middle input is in both.
    assert_eq!(
        avg_pool2d_backward(&[4.0, 8.0], [1, 1, 2, 3], [2, 2], [1, 1]),
        vec![1.0, 3.0, 2.0, 1.0, 3.0, 2.0]
    );
}

/// The backward against a window-by-window scan written here, on values full of ties, NaNs
/// and -∞ (windows where -∞ is the maximum, or a NaN beats it), over padded, dilated and
/// strided geometries: the run of windows inside the plane and the border windows must send
/// each gradient to the same input.
#[test]
fn backward_equals_a_window_by_window_scan_with_nans_and_infinities() {
    let mut seed = 0x2545_f491_u32;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        seed
    };
    for (n, c, h, w, k, s, p, d) in CASES {
        for nan_rate in [0, 50] {
            let g = PoolGeometry {
                kernel: [k, k],
                stride: [s, s],
                padding: [p, p],
                dilation: [d, d],
            };
            let x: Vec<f32> = (0..n * c * h * w)
                .map(|_| match next() % 100 {
                    r if r < nan_rate / 10 => f32::NAN,
                    r if r < 20 => f32::NEG_INFINITY,
                    r => (r % 4) as f32,
                })
                .collect();
            let (ho, wo) = (
                g.out_side(0, h).expect("fits"),
                g.out_side(1, w).expect("fits"),
            );
            let dy: Vec<f32> = (0..n * c * ho * wo).map(|i| 1.0 + i as f32).collect();
            let mut expected = vec![0f32; x.len()];
            for plane in 0..n * c {
                for oh in 0..ho {
                    for ow in 0..wo {
                        let mut best: Option<(usize, f32)> = None;
                        for i in 0..k {
                            for j in 0..k {
                                let ih = (oh * s + i * d) as isize - p as isize;
                                let iw = (ow * s + j * d) as isize - p as isize;
                                if ih < 0 || iw < 0 || ih >= h as isize || iw >= w as isize {
                                    continue;
                                }
                                let at = plane * h * w + ih as usize * w + iw as usize;
                                let v = x[at];
                                if best.is_none_or(|(_, top)| v > top || v.is_nan()) {
                                    best = Some((at, v));
                                }
                            }
                        }
                        if let Some((at, _)) = best {
                            expected[at] += dy[(plane * ho + oh) * wo + ow];
                        }
                    }
                }
            }
            let ours = hearth_kernels::pool::max_pool2d_backward(&x, &dy, [n, c, h, w], &g);
            assert_eq!(
                ours, expected,
                "{n}x{c}x{h}x{w} k{k} s{s} p{p} d{d}, NaN rate {nan_rate}/1000"
            );
        }
    }
}
