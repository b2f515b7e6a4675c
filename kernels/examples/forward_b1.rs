//! Inference at batch 1 piece by piece: our convolution forward ([`conv2d_forward`]) for each
//! convolution shape of VGG-16, or of ResNet-50 with `HEARTH_CONV_MODEL=resnet50`, with its
//! time in the network (times its count), and the classifiers' one-row products by
//! [`row_times_matrix`] against Burn Flex's `matmul` (gemm's one-thread matrix-vector kernel).
//! The measurement behind `ONE_IMAGE_PIECE_FLOATS` (`conv.rs`) and `gemv.rs`.
//!
//!   cargo run --release -p hearth-kernels --example forward_b1   # HEARTH_PROFILE_REPS (5)

mod common;

use burn::prelude::*;
use common::{Conv, RESNET50, VGG16, env_usize, time_min};
use hearth_kernels::conv::conv2d_forward;
use hearth_kernels::gemv::row_times_matrix;
use hearth_kernels::weight_grad::ConvShape;

fn main() {
    hearth_kernels::join_global_pool();
    let reps = env_usize("HEARTH_PROFILE_REPS", 5);
    let resnet = std::env::var("HEARTH_CONV_MODEL").is_ok_and(|m| m == "resnet50");
    let shapes: &[Conv] = if resnet { &RESNET50 } else { &VGG16 };
    println!(
        "convolution forward, batch 1, {} threads (min of {reps})",
        rayon::current_num_threads()
    );
    println!("| conv | count | ms | GFLOP/s |");
    println!("| --- | ---: | ---: | ---: |");
    let mut total = 0.0;
    for &(cin, cout, k, stride, side, count) in shapes {
        let s = ConvShape {
            input: [1, cin, side, side],
            out_channels: cout,
            kernel: [k, k],
            stride: [stride; 2],
            padding: [k / 2; 2],
            dilation: [1, 1],
        };
        let Some([_, _, ho, wo]) = s.output() else {
            continue;
        };
        let x: Vec<f32> = (0..cin * side * side)
            .map(|i| (i % 7) as f32 * 0.1)
            .collect();
        let w: Vec<f32> = (0..cout * cin * k * k)
            .map(|i| (i % 5) as f32 * 0.1)
            .collect();
        let t = time_min(reps, || drop(conv2d_forward(&x, &w, &s)));
        total += t * count as f64;
        let gflop = 2.0 * (cout * ho * wo * cin * k * k) as f64 / 1e9;
        println!(
            "| {cin}→{cout} {k}x{k} s{stride} {side} | {count} | {:.2} | {:.0} |",
            t * 1e3,
            gflop / t
        );
    }
    println!("| all, times count | | {:.1} | |", total * 1e3);
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
