//! The GEMM weight-gradient path equals the reference within 1e-4 relative:
//! - the raw kernel against the definition (one multiply-add at a time, in f64) over random
//!   kernels, strides, paddings, dilations, odd sizes, batch 1 and batches split into chunks;
//! - the extension op through Burn's autodiff against Burn's `conv2d`, forward and backward
//!   (input, weight and bias gradients), through `hearth_kernels::conv2d` on `Conv2d` modules.

use burn::nn::PaddingConfig2d;
use burn::nn::conv::Conv2dConfig;
use burn::prelude::*;
use burn::tensor::Distribution;
use hearth_kernels::weight_grad::{
    ConvShape, conv2d_weight_grad, conv2d_weight_grad_im2col, conv2d_weight_grad_shifted,
    shifted_applies,
};
use hearth_kernels::{Path, fast_path};

mod common;
use common::{Shapes, close, values};

/// Deterministic pseudo-random values in [-1, 1).
fn noise(len: usize, seed: u64) -> Vec<f32> {
    let mut g = Shapes(seed | 1);
    (0..len)
        .map(|_| g.next(0, 1 << 20) as f32 / (1 << 19) as f32 - 1.0)
        .collect()
}

/// The weight gradient by the definition, one multiply-add at a time (in f64).
fn conv2d_weight_grad_naive(x: &[f32], dy: &[f32], s: &ConvShape) -> Vec<f32> {
    let [n, ci, h, w] = s.input;
    let Some([_, co, ho, wo]) = s.output() else {
        return vec![0.0; s.weight().iter().product()];
    };
    let [kh, kw] = s.kernel;
    let mut dw = vec![0f64; co * ci * kh * kw];
    for b in 0..n {
        for o in 0..co {
            for c in 0..ci {
                for i in 0..kh {
                    for j in 0..kw {
                        let mut acc = 0f64;
                        for oh in 0..ho {
                            let ih = (oh * s.stride[0] + i * s.dilation[0]) as isize
                                - s.padding[0] as isize;
                            if ih < 0 || ih >= h as isize {
                                continue;
                            }
                            for ow in 0..wo {
                                let iw = (ow * s.stride[1] + j * s.dilation[1]) as isize
                                    - s.padding[1] as isize;
                                if iw < 0 || iw >= w as isize {
                                    continue;
                                }
                                let xv = x[((b * ci + c) * h + ih as usize) * w + iw as usize];
                                let g = dy[((b * co + o) * ho + oh) * wo + ow];
                                acc += xv as f64 * g as f64;
                            }
                        }
                        dw[((o * ci + c) * kh + i) * kw + j] += acc;
                    }
                }
            }
        }
    }
    dw.into_iter().map(|v| v as f32).collect()
}

/// The geometries every raw-kernel test runs (those whose kernel fits): fixed cases first (1x1
/// plain and strided, the 7x7 stem shape in small, a batch split into chunks (10x10 outputs:
/// chunks of 11 images, the last of 3), padding as wide as the kernel, dilation, large maps
/// whose columns are built in several blocks of output rows), then `random` drawn from `seed`.
fn geometries(seed: u64, random: usize) -> Vec<ConvShape> {
    let mut g = Shapes(seed);
    // (n, ci, co, h, w, kh, kw, stride, padding, dilation)
    let mut cases = vec![
        (1, 1, 1, 1, 1, 1, 1, 1, 0, 1),
        (2, 5, 3, 6, 7, 1, 1, 1, 0, 1),
        (1, 3, 4, 8, 8, 1, 1, 2, 0, 1),
        (2, 3, 8, 32, 30, 7, 7, 2, 3, 1),
        (25, 2, 3, 10, 10, 3, 3, 1, 1, 1),
        (3, 2, 2, 5, 5, 3, 3, 1, 3, 1),
        (2, 4, 5, 9, 7, 3, 3, 1, 2, 2),
        (1, 256, 2, 40, 40, 3, 3, 1, 1, 1),
        (1, 256, 3, 81, 79, 3, 3, 2, 1, 1),
        (6, 70, 60, 12, 11, 3, 2, 1, 1, 1),
        (5, 9, 7, 20, 3, 5, 1, 1, 2, 1),
        // One image large enough to be split into pieces: of columns (1x1), of rows.
        (1, 6, 5, 40, 36, 1, 1, 1, 0, 1),
        (1, 5, 6, 37, 41, 3, 3, 1, 1, 1),
        // Batches of maps of 1024 pixels or more with a small gradient: each image its own
        // partial sum (a stem's 7x7 stride 2; deep columns cut into three blocks of rows).
        (2, 3, 8, 70, 66, 7, 7, 2, 3, 1),
        (3, 512, 3, 64, 64, 3, 3, 2, 1, 1),
    ];
    for _ in 0..random {
        let k = g.next(1, 5);
        cases.push((
            g.next(1, 4),
            g.next(1, 6),
            g.next(1, 6),
            g.next(k, 12),
            g.next(k, 12),
            k,
            g.next(1, 5).min(k + 1),
            g.next(1, 3),
            g.next(0, 3),
            g.next(1, 2),
        ));
    }
    cases
        .into_iter()
        .map(|(n, ci, co, h, w, kh, kw, stride, pad, dil)| ConvShape {
            input: [n, ci, h, w],
            out_channels: co,
            kernel: [kh, kw],
            stride: [stride, stride],
            padding: [pad, pad],
            dilation: [dil, dil],
        })
        .filter(|s| s.output().is_some()) // Burn refuses the others before any kernel
        .collect()
}

#[test]
fn the_kernel_equals_the_definition_over_random_geometries() {
    let cases = geometries(0x2545_f491_4f6c_dd1d, 40);
    assert!(cases.len() >= 40, "only {} geometries fit", cases.len());
    let mut shifted = 0;
    for (i, s) in cases.iter().enumerate() {
        let [n, ci, h, w] = s.input;
        let out = s.output().expect("filtered");
        let x = noise(n * ci * h * w, 2 * i as u64 + 7);
        let dy = noise(out.iter().product(), 2 * i as u64 + 8);
        let naive = conv2d_weight_grad_naive(&x, &dy, s);
        close(&conv2d_weight_grad(&x, &dy, s), &naive, &format!("{s:?}"));
        close(
            &conv2d_weight_grad_im2col(&x, &dy, s),
            &naive,
            &format!("im2col {s:?}"),
        );
        if shifted_applies(s) {
            shifted += 1;
            close(
                &conv2d_weight_grad_shifted(&x, &dy, s),
                &naive,
                &format!("shifted {s:?}"),
            );
        }
    }
    assert!(shifted >= 10, "only {shifted} stride-1 geometries");
}

#[test]
fn the_extension_equals_burn_conv2d_forward_and_backward_over_random_modules() {
    let device = Device::flex().autodiff();
    let mut g = Shapes(0x9e37_79b9_7f4a_7c15);
    // (n, ci, co, h, w, k, stride, padding, dilation, bias)
    let mut cases = vec![
        (1, 3, 4, 15, 13, 7, 2, 3, 1, false),
        (2, 5, 3, 9, 9, 3, 1, 1, 1, true),
        (1, 4, 6, 7, 8, 3, 2, 1, 1, false),
        (3, 6, 4, 6, 6, 1, 1, 0, 1, true),
        (2, 3, 3, 9, 9, 3, 1, 2, 2, false),
    ];
    for _ in 0..20 {
        let k = g.next(1, 4);
        cases.push((
            g.next(1, 3),
            g.next(1, 6),
            g.next(1, 6),
            g.next(k + 2, 11),
            g.next(k + 2, 11),
            k,
            g.next(1, 2),
            g.next(0, k / 2 + 1),
            g.next(1, 2),
            g.next(0, 1) == 1,
        ));
    }
    for (n, ci, co, h, w, k, stride, pad, dil, bias) in cases {
        let what = format!("n{n} ci{ci} co{co} {h}x{w} k{k} s{stride} p{pad} d{dil} bias {bias}");
        let conv = Conv2dConfig::new([ci, co], [k, k])
            .with_stride([stride, stride])
            .with_padding(PaddingConfig2d::Explicit(pad, pad, pad, pad))
            .with_dilation([dil, dil])
            .with_bias(bias)
            .init(&device);
        let expected = if k == 1 && stride > 1 {
            Path::Pointwise
        } else {
            Path::Gemm
        };
        assert_eq!(fast_path(&conv, &device, true), expected, "{what}");
        if (h + 2 * pad) < dil * (k - 1) + 1 || (w + 2 * pad) < dil * (k - 1) + 1 {
            continue;
        }
        let x0 = Tensor::<4>::random([n, ci, h, w], Distribution::Normal(0.0, 1.0), &device);
        let run = |fast: bool| {
            let x = x0.clone().detach().require_grad();
            let y = if fast {
                hearth_kernels::conv2d(&conv, x.clone())
            } else {
                conv.forward(x.clone())
            };
            // A fixed, non-uniform output gradient.
            let dy = Tensor::<4>::from_data(
                TensorData::new(noise(y.dims().iter().product(), 99), y.dims()),
                &device,
            );
            let out = values(y.clone());
            let grads = (y * dy).sum().backward();
            (
                out,
                values(x.grad(&grads).expect("input gradient")),
                values(conv.weight.grad(&grads).expect("weight gradient")),
                conv.bias
                    .as_ref()
                    .map(|b| values(b.grad(&grads).expect("bias gradient"))),
            )
        };
        let (fast, reference) = (run(true), run(false));
        close(&fast.0, &reference.0, &format!("{what} forward"));
        close(&fast.1, &reference.1, &format!("{what} input grad"));
        close(&fast.2, &reference.2, &format!("{what} weight grad"));
        if let (Some(f), Some(r)) = (&fast.3, &reference.3) {
            close(f, r, &format!("{what} bias grad"));
        }
    }
}

/// The forward pass by the definition.
fn forward_naive(x: &[f32], w: &[f32], s: &ConvShape) -> Vec<f32> {
    let [n, ci, h, wd] = s.input;
    let [_, co, ho, wo] = s.output().expect("fits");
    let [kh, kw] = s.kernel;
    let mut y = vec![0f32; n * co * ho * wo];
    for b in 0..n {
        for o in 0..co {
            for oh in 0..ho {
                for ow in 0..wo {
                    let mut acc = 0f64;
                    for c in 0..ci {
                        for i in 0..kh {
                            for j in 0..kw {
                                let ih = (oh * s.stride[0] + i * s.dilation[0]) as isize
                                    - s.padding[0] as isize;
                                let iw = (ow * s.stride[1] + j * s.dilation[1]) as isize
                                    - s.padding[1] as isize;
                                if ih < 0 || iw < 0 || ih >= h as isize || iw >= wd as isize {
                                    continue;
                                }
                                let xv = x[((b * ci + c) * h + ih as usize) * wd + iw as usize];
                                acc += xv as f64 * w[((o * ci + c) * kh + i) * kw + j] as f64;
                            }
                        }
                    }
                    y[((b * co + o) * ho + oh) * wo + ow] = acc as f32;
                }
            }
        }
    }
    y
}

/// The input gradient by the definition: every output gradient times every weight it met.
fn input_grad_naive(w: &[f32], dy: &[f32], s: &ConvShape) -> Vec<f32> {
    let [n, ci, h, wd] = s.input;
    let [_, co, ho, wo] = s.output().expect("fits");
    let [kh, kw] = s.kernel;
    let mut dx = vec![0f64; n * ci * h * wd];
    for b in 0..n {
        for o in 0..co {
            for oh in 0..ho {
                for ow in 0..wo {
                    let g = dy[((b * co + o) * ho + oh) * wo + ow] as f64;
                    for c in 0..ci {
                        for i in 0..kh {
                            for j in 0..kw {
                                let ih = (oh * s.stride[0] + i * s.dilation[0]) as isize
                                    - s.padding[0] as isize;
                                let iw = (ow * s.stride[1] + j * s.dilation[1]) as isize
                                    - s.padding[1] as isize;
                                if ih < 0 || iw < 0 || ih >= h as isize || iw >= wd as isize {
                                    continue;
                                }
                                dx[((b * ci + c) * h + ih as usize) * wd + iw as usize] +=
                                    g * w[((o * ci + c) * kh + i) * kw + j] as f64;
                            }
                        }
                    }
                }
            }
        }
    }
    dx.into_iter().map(|v| v as f32).collect()
}

#[test]
fn forward_and_input_grad_kernels_equal_the_definition_over_random_geometries() {
    let cases = geometries(0x1234_5678_9abc_def1, 30);
    assert!(cases.len() >= 30, "only {} geometries fit", cases.len());
    let mut as_conv = 0;
    for (i, s) in cases.iter().enumerate() {
        let [n, ci, h, w] = s.input;
        let out = s.output().expect("filtered");
        let x = noise(n * ci * h * w, 3 * i as u64 + 1);
        let wt = noise(s.weight().iter().product(), 3 * i as u64 + 2);
        let dy = noise(out.iter().product(), 3 * i as u64 + 3);
        close(
            &hearth_kernels::conv::conv2d_forward(&x, &wt, s),
            &forward_naive(&x, &wt, s),
            &format!("forward {s:?}"),
        );
        let naive = input_grad_naive(&wt, &dy, s);
        close(
            &hearth_kernels::conv::conv2d_input_grad(&wt, &dy, s),
            &naive,
            &format!("input grad {s:?}"),
        );
        if hearth_kernels::conv::input_grad_as_conv_applies(s) {
            as_conv += 1;
            close(
                &hearth_kernels::conv::conv2d_input_grad_as_conv(&wt, &dy, s),
                &naive,
                &format!("input grad as a convolution {s:?}"),
            );
        }
    }
    // Stride 1 with padding within the kernel: the fixed cases alone give several (dilation
    // 2 among them), the random ones more.
    assert!(
        as_conv >= 10,
        "only {as_conv} geometries took the flipped convolution"
    );
}

/// Two images, so the op takes our forward and our input gradients (1x1: `Wᵀ · dY`; stride
/// 1: the flipped convolution; strided: Flex's), through autodiff and without it; a 64 → 64
/// 3x3 on 14x14 takes Winograd's F(2x2, 3x3) for its forward and for its input gradient
/// (the flipped convolution is one too).
#[test]
fn the_extension_takes_its_own_kernels_and_equals_burn() {
    use hearth_kernels::ext::{InputGrad, input_grad_path};
    let device = Device::flex().autodiff();
    for (ci, co, k, stride, pad, side, input_grad) in [
        (3, 4, 3, 1, 1, 60, InputGrad::AsConv),
        (4, 3, 1, 1, 0, 30, InputGrad::Gemm),
        (4, 3, 1, 1, 0, 6, InputGrad::Gemm),
        (4, 3, 1, 2, 0, 30, InputGrad::Flex),
        (3, 4, 3, 2, 1, 20, InputGrad::Flex),
        (8, 3, 3, 1, 1, 20, InputGrad::AsConv),
        (5, 5, 3, 1, 1, 6, InputGrad::AsConv),
        (4, 6, 3, 1, 1, 30, InputGrad::AsConv),
        (6, 2, 5, 1, 1, 9, InputGrad::AsConv),
        (64, 64, 3, 1, 1, 14, InputGrad::AsConv),
    ] {
        let what = format!("{ci}→{co} {k}x{k} s{stride} p{pad} {side}x{side}");
        let shape = ConvShape {
            input: [2, ci, side, side],
            out_channels: co,
            kernel: [k, k],
            stride: [stride; 2],
            padding: [pad; 2],
            dilation: [1, 1],
        };
        assert_eq!(
            input_grad_path(&shape),
            input_grad,
            "{what}: input gradient kernel"
        );
        let winograd =
            hearth_kernels::winograd::applies(&shape) && hearth_kernels::winograd::pays(&shape);
        assert_eq!(winograd, ci == 64, "{what}: Winograd's forward");
        let conv = Conv2dConfig::new([ci, co], [k, k])
            .with_stride([stride, stride])
            .with_padding(PaddingConfig2d::Explicit(pad, pad, pad, pad))
            .init(&device);
        let x0 = Tensor::<4>::random([2, ci, side, side], Distribution::Normal(0.0, 1.0), &device);
        let run = |fast: bool| {
            let x = x0.clone().detach().require_grad();
            let y = if fast {
                hearth_kernels::ext::conv2d_gemm_grad(
                    x.clone(),
                    conv.weight.val(),
                    [[stride; 2], [pad; 2], [1, 1]],
                )
            } else {
                burn::tensor::module::conv2d(
                    x.clone(),
                    conv.weight.val(),
                    None,
                    burn::tensor::ops::ConvOptions::new([stride; 2], [pad; 2], [1, 1], 1),
                )
            };
            let dy = Tensor::<4>::from_data(
                TensorData::new(noise(y.dims().iter().product(), 5), y.dims()),
                &device,
            );
            let out = values(y.clone());
            let grads = (y * dy).sum().backward();
            (
                out,
                values(x.grad(&grads).expect("input gradient")),
                values(conv.weight.grad(&grads).expect("weight gradient")),
            )
        };
        let (fast, reference) = (run(true), run(false));
        close(&fast.0, &reference.0, &format!("{what} forward"));
        close(&fast.1, &reference.1, &format!("{what} input grad"));
        close(&fast.2, &reference.2, &format!("{what} weight grad"));
    }
}

#[test]
fn inference_takes_the_gemm_op_and_equals_burns_forward() {
    let device = Device::flex();
    for (k, stride, pad, side) in [
        (3, 1, 1, 60),
        (7, 2, 3, 121),
        (3, 1, 1, 8),
        (1, 2, 0, 9),
        (1, 1, 0, 5),
    ] {
        let conv = Conv2dConfig::new([3, 4], [k, k])
            .with_stride([stride, stride])
            .with_padding(PaddingConfig2d::Explicit(pad, pad, pad, pad))
            .init(&device);
        assert_eq!(fast_path(&conv, &device, true), Path::Gemm);
        // Images in parallel (2) and one image in pieces of rows (1).
        for n in [2, 1] {
            let x =
                Tensor::<4>::random([n, 3, side, side], Distribution::Normal(0.0, 1.0), &device);
            let ours = hearth_kernels::conv2d(&conv, x.clone());
            let reference = conv.forward(x);
            close(
                &values(ours),
                &values(reference),
                &format!("k{k} s{stride} {side}x{side} batch {n}"),
            );
        }
    }
}

/// A 3x3 convolution with stride 1 and padding 1 of `n` square `ci`-channel images of `side`
/// pixels into `co` channels.
fn same_3x3([n, ci, co, side]: [usize; 4]) -> ConvShape {
    ConvShape {
        input: [n, ci, side, side],
        out_channels: co,
        kernel: [3, 3],
        stride: [1, 1],
        padding: [1, 1],
        dilation: [1, 1],
    }
}

/// The shifted weight gradient sums fixed runs of images and adds the runs' sums in order: a
/// batch's gradient is its runs' gradients added in order, bit for bit (so the gradients of
/// whole runs, such as a pipeline's micro-batches or data-parallel ranks, regroup only the last
/// additions), and nothing depends on the number of threads.
#[test]
fn a_batchs_shifted_weight_gradient_adds_its_runs_in_order() {
    use hearth_kernels::weight_grad::SHIFTED_RUN;
    let (n, ci, co, side) = (4 * SHIFTED_RUN, 5, 7, 9);
    let s = same_3x3([n, ci, co, side]);
    let x = noise(n * ci * side * side, 11);
    let dy = noise(n * co * side * side, 12);
    let whole = conv2d_weight_grad_shifted(&x, &dy, &s);
    // Piece i of `count` equal pieces of the batch.
    let piece = |i: usize, count: usize| {
        let m = n / count;
        let (xs, ys) = (m * ci * side * side, m * co * side * side);
        let part = ConvShape {
            input: [m, ci, side, side],
            ..s
        };
        conv2d_weight_grad_shifted(&x[i * xs..(i + 1) * xs], &dy[i * ys..(i + 1) * ys], &part)
    };
    let mut in_order = piece(0, 4);
    for i in 1..4 {
        for (acc, v) in in_order.iter_mut().zip(piece(i, 4)) {
            *acc += v;
        }
    }
    assert_eq!(whole, in_order, "the runs added in order");
    let halves: Vec<f32> = piece(0, 2)
        .iter()
        .zip(piece(1, 2))
        .map(|(p, q)| p + q)
        .collect();
    close(&whole, &halves, "the halves' sum");
}

/// The shifted weight gradient's layouts against the definition: channels-last copies (wider
/// kernels with fewer output than input channels; channel counts and widths around the 8x8
/// blocks of its transpose: a multiple of 8, one over, one under; padding and none; non-square
/// kernels), the image read in place (1x1 without padding) and plain copies (1x1 with
/// padding, more output channels); and the channels-last runs still add in order.
#[test]
fn the_shifted_weight_gradients_layouts_equal_the_definition() {
    // (n, ci, co, h, w, kh, kw, pad)
    let cases = [
        (2, 16, 8, 8, 8, 3, 3, 1),
        (3, 17, 9, 9, 17, 3, 3, 1),
        (1, 23, 7, 7, 15, 3, 3, 0),
        (5, 12, 5, 10, 9, 5, 5, 2),
        (2, 9, 3, 11, 16, 3, 2, 1),
        (4, 40, 32, 6, 6, 3, 3, 2),
        (3, 10, 7, 5, 9, 1, 1, 0),
        (6, 9, 12, 8, 8, 1, 1, 0),
        (2, 6, 4, 5, 5, 1, 1, 1),
        (2, 4, 9, 7, 6, 3, 3, 1),
        (2, 5, 0, 6, 6, 3, 3, 1),
    ];
    for (i, &(n, ci, co, h, w, kh, kw, pad)) in cases.iter().enumerate() {
        let s = ConvShape {
            input: [n, ci, h, w],
            out_channels: co,
            kernel: [kh, kw],
            stride: [1, 1],
            padding: [pad, pad],
            dilation: [1, 1],
        };
        let out = s.output().expect("the kernel fits");
        let x = noise(n * ci * h * w, 40 + 2 * i as u64);
        let dy = noise(out.iter().product(), 41 + 2 * i as u64);
        close(
            &conv2d_weight_grad_shifted(&x, &dy, &s),
            &conv2d_weight_grad_naive(&x, &dy, &s),
            &format!("{s:?}"),
        );
    }
    let (n, ci, co, side) = (2 * hearth_kernels::weight_grad::SHIFTED_RUN, 19, 6, 11);
    let s = same_3x3([n, ci, co, side]);
    let (xs, ys) = (n / 2 * ci * side * side, n / 2 * co * side * side);
    let x = noise(2 * xs, 60);
    let dy = noise(2 * ys, 61);
    let half = ConvShape {
        input: [n / 2, ci, side, side],
        ..s
    };
    let halves: Vec<f32> = conv2d_weight_grad_shifted(&x[..xs], &dy[..ys], &half)
        .iter()
        .zip(conv2d_weight_grad_shifted(&x[xs..], &dy[ys..], &half))
        .map(|(p, q)| p + q)
        .collect();
    assert_eq!(
        conv2d_weight_grad_shifted(&x, &dy, &s),
        halves,
        "the runs added in order"
    );
}
