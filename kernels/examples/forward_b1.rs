//! Inference at batch 1 piece by piece: our convolution forward for each convolution shape of
//! VGG-16, or of ResNet-50 or DenseNet-121 with `HEARTH_CONV_MODEL=resnet50|densenet121`, as
//! im2col's GEMM ([`conv2d_forward_im2col`]) and, where it applies, Winograd's F(2x2, 3x3)
//! ([`hearth_kernels::winograd`], bands of `HEARTH_WINOGRAD_BAND` floats), each with its time
//! in the network (times its count; `HEARTH_CONV_BATCH` for another batch), and the
//! classifiers' one-row products by [`row_times_matrix`] against Burn Flex's `matmul` (gemm's
//! one-thread matrix-vector kernel). The measurement behind `ONE_IMAGE_PIECE_FLOATS`
//! (`conv.rs`), `winograd::pays` and `gemv.rs`.
//!
//!   cargo run --release -p hearth-kernels --example forward_b1   # HEARTH_PROFILE_REPS (5)

mod common;

use burn::prelude::*;
use common::{Conv, DENSENET121, RESNET50, VGG16, env_usize, time_min};
use hearth_kernels::conv::conv2d_forward_im2col;
use hearth_kernels::gemv::row_times_matrix;
use hearth_kernels::weight_grad::ConvShape;
use hearth_kernels::winograd;

fn main() {
    hearth_kernels::join_global_pool();
    let reps = env_usize("HEARTH_PROFILE_REPS", 5);
    let shapes: &[Conv] = match std::env::var("HEARTH_CONV_MODEL").as_deref() {
        Ok("resnet50") => &RESNET50,
        Ok("densenet121") => &DENSENET121,
        _ => &VGG16,
    };
    let batch = env_usize("HEARTH_CONV_BATCH", 1);
    let band = env_usize("HEARTH_WINOGRAD_BAND", winograd::BAND_FLOATS);
    println!(
        "convolution forward, batch {batch}, {} threads (min of {reps}), Winograd bands of {band} floats",
        rayon::current_num_threads()
    );
    println!(
        "| conv | count | im2col ms | GFLOP/s | Winograd ms | GFLOP/s (direct's count) | Winograd, U kept ms | takes (training / inference) |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |");
    let (mut total, mut best) = (0.0, 0.0);
    for &(cin, cout, k, stride, side, count) in shapes {
        let s = ConvShape {
            input: [batch, cin, side, side],
            out_channels: cout,
            kernel: [k, k],
            stride: [stride; 2],
            padding: [k / 2; 2],
            dilation: [1, 1],
        };
        let Some([_, _, ho, wo]) = s.output() else {
            continue;
        };
        let x: Vec<f32> = (0..batch * cin * side * side)
            .map(|i| (i % 7) as f32 * 0.1)
            .collect();
        let w: Vec<f32> = (0..cout * cin * k * k)
            .map(|i| (i % 5) as f32 * 0.1)
            .collect();
        let t = time_min(reps, || drop(conv2d_forward_im2col(&x, &w, &s)));
        let gflop = 2.0 * (batch * cout * ho * wo * cin * k * k) as f64 / 1e9;
        let (wino, wino_cell) = if winograd::applies(&s) {
            let t = time_min(reps, || {
                drop(winograd::conv2d_forward_in_bands(&x, &w, &s, band))
            });
            let u = winograd::transform_weights(&w, cout, cin);
            let kept = time_min(reps, || {
                drop(winograd::conv2d_forward_transformed(&x, &u, &s, band))
            });
            let takes = |yes: bool| if yes { "W" } else { "i" };
            let cell = format!(
                "{:.2} | {:.0} | {:.2} | {} / {}",
                t * 1e3,
                gflop / t,
                kept * 1e3,
                takes(winograd::pays(&s)),
                takes(winograd::pays_kept(&s))
            );
            (t, cell)
        } else {
            (t, "- | - | - | -".to_string())
        };
        total += t * count as f64;
        best += t.min(wino) * count as f64;
        println!(
            "| {cin}→{cout} {k}x{k} s{stride} {side} | {count} | {:.2} | {:.0} | {wino_cell} |",
            t * 1e3,
            gflop / t
        );
    }
    println!(
        "| all, times count | | {:.1} | | {:.1} (the faster of the two) | |",
        total * 1e3,
        best * 1e3
    );
    println!();
    println!(
        "one row times a matrix (min of {}): ours against Burn Flex's matmul",
        2 * reps
    );
    println!("| k x n | ours ms | GB/s | Flex ms | GB/s |");
    println!("| --- | ---: | ---: | ---: | ---: |");
    let device = Device::flex();
    for (k, n) in [(25088, 4096), (4096, 4096), (4096, 1000), (2048, 1000)] {
        let x: Vec<f32> = (0..k).map(|i| (i % 7) as f32 * 0.1).collect();
        let w: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32 * 0.1).collect();
        let ours = time_min(2 * reps, || drop(row_times_matrix(&x, &w, k, n)));
        let xt = Tensor::<2>::from_data(TensorData::new(x, [1, k]), &device);
        let wt = Tensor::<2>::from_data(TensorData::new(w, [k, n]), &device);
        let flex = time_min(2 * reps, || drop(xt.clone().matmul(wt.clone()).into_data()));
        let gb = (k * n * 4) as f64 / 1e9;
        println!(
            "| {k} x {n} | {:.2} | {:.1} | {:.2} | {:.1} |",
            ours * 1e3,
            gb / ours,
            flex * 1e3,
            gb / flex
        );
    }
}
