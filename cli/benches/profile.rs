//! Where a ResNet-50 training step's time goes on Burn Flex (issue 14's "profile first"):
//! every convolution shape of ResNet-50 at 224x224 timed as its forward pass, its input
//! gradient (a transposed convolution, what Burn's autodiff calls) and its weight gradient
//! (Burn's `conv2d_weight_backward`), each multiplied by how often the network has it; then
//! batch norm (training statistics) with ReLU, forward and backward, at every activation shape,
//! max pooling and the residual additions. Prints a table by op kind and by layer shape, and the
//! sum against a measured whole training step.
//!
//!   cargo bench --bench profile           # HEARTH_PROFILE_BATCH (default 16), HEARTH_PROFILE_REPS (2)
//!
//! Perf's own view (rayon workers lose the calling op, so it shows kernels, not ops):
//! `perf record -F 150 -g -- hearth bench model --model resnet50 --mode train --batch-size 16`.

use std::collections::BTreeMap;
use std::time::Instant;

use burn::prelude::*;
use burn::tensor::Distribution;
use burn::tensor::module::{
    batch_norm_train, conv_transpose2d, conv2d, conv2d_weight_backward, max_pool2d,
};
use burn::tensor::ops::{ConvOptions, ConvTransposeOptions, MaxPoolOptions};

/// One convolution of the network: (in, out, kernel, stride, input side), and how many.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Conv {
    cin: usize,
    cout: usize,
    k: usize,
    stride: usize,
    side: usize,
}

/// ResNet-50 (torchvision: stride on the 3x3 convolution) at 224x224.
fn resnet50_convs() -> BTreeMap<Conv, usize> {
    let mut out = BTreeMap::new();
    let mut add = |c: Conv| *out.entry(c).or_insert(0) += 1;
    add(Conv {
        cin: 3,
        cout: 64,
        k: 7,
        stride: 2,
        side: 224,
    });
    let mut cin = 64;
    let mut side = 56;
    for (blocks, width, first_stride) in [(3, 64, 1), (4, 128, 2), (6, 256, 2), (3, 512, 2)] {
        let cout = width * 4;
        for b in 0..blocks {
            let stride = if b == 0 { first_stride } else { 1 };
            add(Conv {
                cin,
                cout: width,
                k: 1,
                stride: 1,
                side,
            });
            add(Conv {
                cin: width,
                cout: width,
                k: 3,
                stride,
                side,
            });
            let out_side = side / stride;
            add(Conv {
                cin: width,
                cout,
                k: 1,
                stride: 1,
                side: out_side,
            });
            if b == 0 {
                add(Conv {
                    cin,
                    cout,
                    k: 1,
                    stride,
                    side,
                });
            }
            cin = cout;
            side = out_side;
        }
    }
    out
}

fn time_min(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::MAX, f64::min)
}

fn rand(shape: [usize; 4], device: &Device) -> Tensor<4> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), device)
}

fn main() {
    let device = Device::flex();
    let n: usize = std::env::var("HEARTH_PROFILE_BATCH")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16);
    let reps: usize = std::env::var("HEARTH_PROFILE_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let mut by_kind: BTreeMap<&str, f64> = BTreeMap::new();
    let mut flops: BTreeMap<&str, f64> = BTreeMap::new();
    println!(
        "ResNet-50, batch {n}, 224x224, Burn Flex; seconds per training step (min of {reps}) x count"
    );
    println!(
        "| conv (in→out, k, stride, side) | count | forward s | input grad s | weight grad s | weight grad GFLOP/s |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    for (c, count) in resnet50_convs() {
        let pad = c.k / 2;
        let opts = ConvOptions::new([c.stride; 2], [pad; 2], [1, 1], 1);
        let x = rand([n, c.cin, c.side, c.side], &device);
        let w = rand([c.cout, c.cin, c.k, c.k], &device);
        let out_side = (c.side + 2 * pad - c.k) / c.stride + 1;
        let dy = rand([n, c.cout, out_side, out_side], &device);
        let fwd = time_min(reps, || {
            let _ = conv2d(x.clone(), w.clone(), None, opts.clone());
        });
        // Burn's input gradient: a transposed convolution with the padding that restores the
        // input's side.
        let padding_out = (c.side + 2 * pad - c.k) % c.stride;
        let topts = ConvTransposeOptions::new([c.stride; 2], [pad; 2], [padding_out; 2], [1, 1], 1);
        let dx = time_min(reps, || {
            let _ = conv_transpose2d(dy.clone(), w.clone(), None, topts.clone());
        });
        let dw = time_min(reps, || {
            let _ = conv2d_weight_backward(x.clone(), w.clone(), dy.clone(), opts.clone());
        });
        let gflop = 2.0 * (n * c.cout * out_side * out_side * c.cin * c.k * c.k) as f64 / 1e9;
        let k = count as f64;
        *by_kind.entry("conv forward").or_default() += fwd * k;
        *by_kind.entry("conv input grad").or_default() += dx * k;
        *by_kind.entry("conv weight grad").or_default() += dw * k;
        for kind in ["conv forward", "conv input grad", "conv weight grad"] {
            *flops.entry(kind).or_default() += gflop * k;
        }
        println!(
            "| {}→{}, {}x{}, s{}, {} | {count} | {:.3} | {:.3} | {:.3} | {:.0} |",
            c.cin,
            c.cout,
            c.k,
            c.k,
            c.stride,
            c.side,
            fwd * k,
            dx * k,
            dw * k,
            gflop / dw
        );
    }
    // Batch norm (training statistics) + ReLU at every conv output; the last conv of a block
    // has no ReLU before the addition, counted the same here.
    let ad = device.clone().autodiff();
    let mut bn_shapes: BTreeMap<(usize, usize), usize> = BTreeMap::new();
    for (c, count) in resnet50_convs() {
        let out_side = (c.side + 2 * (c.k / 2) - c.k) / c.stride + 1;
        *bn_shapes.entry((c.cout, out_side)).or_default() += count;
    }
    for ((ch, side), count) in bn_shapes {
        let x = rand([n, ch, side, side], &ad).require_grad();
        let gamma = Tensor::<1>::ones([ch], &ad).require_grad();
        let beta = Tensor::<1>::zeros([ch], &ad).require_grad();
        let f = time_min(reps, || {
            let y = batch_norm_train(x.clone(), gamma.clone(), beta.clone(), 1e-5).output;
            let _ = burn::tensor::activation::relu(y);
        });
        let fb = time_min(reps, || {
            let y = batch_norm_train(x.clone(), gamma.clone(), beta.clone(), 1e-5).output;
            let _ = burn::tensor::activation::relu(y).sum().backward();
        });
        *by_kind.entry("batch norm + relu forward").or_default() += f * count as f64;
        *by_kind.entry("batch norm + relu backward").or_default() +=
            (fb - f).max(0.0) * count as f64;
    }
    // Max pooling after the stem and the 16 residual additions (forward + backward).
    let x = rand([n, 64, 112, 112], &ad).require_grad();
    let mp = MaxPoolOptions::new([3, 3])
        .with_stride([2, 2])
        .with_padding([1, 1]);
    let pool = time_min(reps, || {
        let _ = max_pool2d(x.clone(), mp.clone()).sum().backward();
    });
    *by_kind.entry("max pool (fwd + bwd)").or_default() += pool;
    let mut add = 0.0;
    for (blocks, ch, side) in [(3, 256, 56), (4, 512, 28), (6, 1024, 14), (3, 2048, 7)] {
        let a = rand([n, ch, side, side], &ad).require_grad();
        let b = rand([n, ch, side, side], &ad).require_grad();
        add += blocks as f64
            * time_min(reps, || {
                let _ = (a.clone() + b.clone()).sum().backward();
            });
    }
    *by_kind.entry("residual add (fwd + bwd)").or_default() += add;

    // The whole step, for the share the ops above explain.
    let step = {
        use hearth_cli::bench::{BenchMode, ModelBench};
        let bench = ModelBench {
            arch: hearth::models::Architecture::ResNet50,
            mode: BenchMode::Train,
            batch_size: n,
            size: 224,
            warmup: 1,
            steps: reps,
            num_classes: 1000,
            precision: hearth::train::Precision::Fp32,
        };
        bench
            .run(&device, |_, _, _, _| {})
            .map(|r| r.step_seconds.iter().copied().fold(f64::MAX, f64::min))
            .unwrap_or(f64::NAN)
    };
    let total: f64 = by_kind.values().sum();
    println!();
    println!("| op | seconds per step | share of the ops | GFLOP/s |");
    println!("| --- | ---: | ---: | ---: |");
    for (kind, s) in &by_kind {
        let rate = flops
            .get(kind)
            .map(|f| format!("{:.0}", f / s))
            .unwrap_or_default();
        println!("| {kind} | {s:.2} | {:.0}% | {rate} |", 100.0 * s / total);
    }
    println!("| sum of the ops | {total:.2} | 100% | |");
    println!(
        "| measured training step (forward, loss, backward, SGD) | {step:.2} | {:.0}% explained | |",
        100.0 * total / step
    );
}
