//! Times ResNet-50's (or, with `HEARTH_CONV_MODEL=vgg16` or `densenet121`, VGG-16's or
//! DenseNet-121's) convolution shapes (224x224) through autodiff on Burn Flex, forward and
//! backward (input and weight gradients), by each path: Burn's `conv2d`, the pointwise matrix
//! product (1x1 only), and the extension op with the GEMM weight gradient. The measurement
//! behind which shapes the fast path takes (docs/benchmarks/cpu-models.md, "CPU kernels").
//!
//!   cargo run --release -p hearth-kernels --example conv_paths   # HEARTH_PROFILE_BATCH (16)

mod common;

use burn::prelude::*;
use burn::tensor::Distribution;
use burn::tensor::module::conv2d;
use burn::tensor::ops::ConvOptions;
use hearth_kernels::ext::conv2d_gemm_grad;
use hearth_kernels::pointwise_strided;

use common::{RESNET50, VGG16, env_usize, time_min};

fn main() {
    hearth_kernels::join_global_pool();
    let n = env_usize("HEARTH_PROFILE_BATCH", 16);
    let device = Device::flex().autodiff();
    // DenseNet-121: each block's 1x1 bottlenecks at their median input width (the input grows
    // by 32 channels a layer), its 3x3 128→32 layers, and the transitions.
    let densenet121 = [
        (3, 64, 7, 2, 224, 1),
        (160, 128, 1, 1, 56, 6),
        (128, 32, 3, 1, 56, 6),
        (256, 128, 1, 1, 56, 1),
        (304, 128, 1, 1, 28, 12),
        (128, 32, 3, 1, 28, 12),
        (512, 256, 1, 1, 28, 1),
        (624, 128, 1, 1, 14, 24),
        (128, 32, 3, 1, 14, 24),
        (1024, 512, 1, 1, 14, 1),
        (752, 128, 1, 1, 7, 16),
        (128, 32, 3, 1, 7, 16),
    ];
    let model = std::env::var("HEARTH_CONV_MODEL").unwrap_or_default();
    let shapes: &[(usize, usize, usize, usize, usize, usize)] = match model.as_str() {
        "vgg16" => &VGG16,
        "densenet121" => &densenet121,
        _ => &RESNET50,
    };
    println!("batch {n}; seconds for forward + backward (min of 3); GFLOP/s of the three passes");
    println!(
        "| conv | count | Burn s | pointwise s | GEMM weight grad s | Burn GFLOP/s | best GFLOP/s |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    let (mut tb, mut tp, mut tg) = (0.0, 0.0, 0.0);
    for &(cin, cout, k, stride, side, count) in shapes {
        let pad = k / 2;
        let x = Tensor::<4>::random(
            [n, cin, side, side],
            Distribution::Normal(0.0, 1.0),
            &device,
        )
        .require_grad();
        let w = Tensor::<4>::random([cout, cin, k, k], Distribution::Normal(0.0, 0.1), &device)
            .require_grad();
        let opts = ConvOptions::new([stride; 2], [pad; 2], [1, 1], 1);
        let burn = time_min(3, || {
            let _ = conv2d(x.clone(), w.clone(), None, opts.clone())
                .sum()
                .backward();
        });
        let pointwise = (k == 1).then(|| {
            time_min(3, || {
                let _ = pointwise_strided(x.clone(), w.clone(), None, [stride; 2])
                    .sum()
                    .backward();
            })
        });
        let gemm = time_min(3, || {
            let _ = conv2d_gemm_grad(x.clone(), w.clone(), [[stride; 2], [pad; 2], [1, 1]])
                .sum()
                .backward();
        });
        let out = (side + 2 * pad - k) / stride + 1;
        let gflop = 3.0 * 2.0 * (n * cout * out * out * cin * k * k) as f64 / 1e9;
        let c = count as f64;
        tb += burn * c;
        tg += gemm * c;
        tp += pointwise.unwrap_or(gemm).min(gemm) * c;
        let best = pointwise.unwrap_or(f64::MAX).min(gemm).min(burn);
        println!(
            "| {cin}→{cout} {k}x{k} s{stride} {side} | {count} | {burn:.3} | {} | {gemm:.3} | {:.0} | {:.0} |",
            pointwise.map(|p| format!("{p:.3}")).unwrap_or("-".into()),
            gflop / burn,
            gflop / best
        );
    }
    println!(
        "| all, times count | | {tb:.2} | best of pointwise and GEMM: {tp:.2} | {tg:.2} | | |"
    );
    raw_kernels(n, shapes);
}

/// The three raw kernels alone on `f32` slices (no Burn), GFLOP/s each: where the GEMM path's
/// time goes.
fn raw_kernels(n: usize, shapes: &[(usize, usize, usize, usize, usize, usize)]) {
    use hearth_kernels::conv::{
        conv2d_forward, conv2d_input_grad, conv2d_input_grad_as_conv, input_grad_as_conv_applies,
    };
    use hearth_kernels::weight_grad::{
        ConvShape, conv2d_weight_grad, conv2d_weight_grad_shifted, shifted_applies,
    };
    use hearth_kernels::winograd;
    println!();
    println!("raw kernels, batch {n} (min of 3): GFLOP/s");
    println!(
        "| conv | forward (Flex) | input grad (Flex) | input grad as a convolution | weight grad (Flex) | weight grad shifted | weight grad Winograd |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    let flex = Device::flex();
    for &(cin, cout, k, stride, side, _) in shapes {
        let s = ConvShape {
            input: [n, cin, side, side],
            out_channels: cout,
            kernel: [k, k],
            stride: [stride; 2],
            padding: [k / 2; 2],
            dilation: [1, 1],
        };
        let Some(out) = s.output() else { continue };
        let x: Vec<f32> = (0..n * cin * side * side)
            .map(|i| (i % 7) as f32 * 0.1)
            .collect();
        let w: Vec<f32> = (0..cout * cin * k * k)
            .map(|i| (i % 5) as f32 * 0.1)
            .collect();
        let dy: Vec<f32> = (0..out.iter().product::<usize>())
            .map(|i| (i % 3) as f32)
            .collect();
        let gflop = 2.0 * (n * cout * out[2] * out[3] * cin * k * k) as f64 / 1e9;
        let f = time_min(3, || drop(conv2d_forward(&x, &w, &s)));
        let dx = time_min(3, || drop(conv2d_input_grad(&w, &dy, &s)));
        let dx_conv = input_grad_as_conv_applies(&s)
            .then(|| time_min(3, || drop(conv2d_input_grad_as_conv(&w, &dy, &s))));
        let dw = time_min(3, || drop(conv2d_weight_grad(&x, &dy, &s)));
        let dw_shifted = shifted_applies(&s)
            .then(|| time_min(3, || drop(conv2d_weight_grad_shifted(&x, &dy, &s))));
        let dw_winograd = winograd::applies(&s)
            .then(|| time_min(3, || drop(winograd::conv2d_weight_grad(&x, &dy, &s))));
        // Flex's own kernels on the same data.
        let tensor = |v: &[f32], shape: [usize; 4]| {
            Tensor::<4>::from_data(TensorData::new(v.to_vec(), shape), &flex)
        };
        let (xt, wt, dyt) = (
            tensor(&x, s.input),
            tensor(&w, s.weight()),
            tensor(&dy, out),
        );
        let opts = ConvOptions::new([stride; 2], [k / 2; 2], [1, 1], 1);
        let ff = time_min(3, || {
            let _ = conv2d(xt.clone(), wt.clone(), None, opts.clone()).into_data();
        });
        let pad_out = (side + 2 * (k / 2) - k) % stride;
        let topts = burn::tensor::ops::ConvTransposeOptions::new(
            [stride; 2],
            [k / 2; 2],
            [pad_out; 2],
            [1, 1],
            1,
        );
        let fdx = time_min(3, || {
            let _ = burn::tensor::module::conv_transpose2d(
                dyt.clone(),
                wt.clone(),
                None,
                topts.clone(),
            )
            .into_data();
        });
        let fdw = time_min(3, || {
            let _ = burn::tensor::module::conv2d_weight_backward(
                xt.clone(),
                wt.clone(),
                dyt.clone(),
                opts.clone(),
            )
            .into_data();
        });
        println!(
            "| {cin}→{cout} {k}x{k} s{stride} {side} | {:.0} ({:.0}) | {:.0} ({:.0}) | {} | {:.0} ({:.0}) | {} | {} |",
            gflop / f,
            gflop / ff,
            gflop / dx,
            gflop / fdx,
            dx_conv.map_or("-".into(), |t| format!("{:.0}", gflop / t)),
            gflop / dw,
            gflop / fdw,
            dw_shifted.map_or("-".into(), |t| format!("{:.0}", gflop / t)),
            dw_winograd.map_or("-".into(), |t| format!("{:.0}", gflop / t)),
        );
    }
}
