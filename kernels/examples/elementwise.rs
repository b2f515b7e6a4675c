//! Times our batch norm (training statistics, with ReLU), forward and backward, at every batch
//! norm of DenseNet-121 (224x224, the activation shapes its dense layers and transitions
//! normalize) and four of ResNet-50's, with the bytes its passes move per second: how near
//! the memory's speed these loops run (docs/benchmarks/cpu-models.md, "Issue 30, item 1: batch norm").
//!
//!   cargo run --release -q -p hearth-kernels --example elementwise   # HEARTH_PROFILE_BATCH (16), _REPS (5)

mod common;

use common::{env_usize, time_min};
use hearth_kernels::batch_norm;

/// DenseNet-121's batch norms as (channels, side, count).
fn densenet121() -> Vec<(usize, usize, usize)> {
    let mut out = Vec::new();
    let mut ch = 64;
    for (block, (layers, side)) in [(6, 56), (12, 28), (24, 14), (16, 7)]
        .into_iter()
        .enumerate()
    {
        for _ in 0..layers {
            out.push((ch, side, 1)); // the layer's first norm, over its concatenated input
            out.push((128, side, 1)); // the bottleneck's
            ch += 32;
        }
        if block < 3 {
            out.push((ch, side, 1)); // the transition's
            ch /= 2;
        }
    }
    out.push((ch, 7, 1)); // the final norm
    out
}

fn main() {
    let n = env_usize("HEARTH_PROFILE_BATCH", 16);
    let reps = env_usize("HEARTH_PROFILE_REPS", 5);
    println!("batch norm + ReLU at batch {n} (best of {reps})");
    let resnet = vec![(64, 112, 1), (256, 56, 3), (512, 28, 4), (1024, 14, 6)];
    for (model, shapes) in [("densenet121", densenet121()), ("resnet50 (some)", resnet)] {
        let (mut fwd, mut bwd, mut bytes) = (0.0, 0.0, 0.0);
        for (c, side, count) in shapes {
            let s = side * side;
            let len = n * c * s;
            let x: Vec<f32> = (0..len)
                .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
                .collect();
            let dy: Vec<f32> = (0..len)
                .map(|i| ((i * 104729) % 997) as f32 / 498.0 - 1.0)
                .collect();
            let (gamma, beta) = (vec![1.1f32; c], vec![0.05f32; c]);
            let mut stats = (Vec::new(), Vec::new());
            let f = time_min(reps, || {
                let (y, m, v) = batch_norm::forward(&x, [n, c, s], &gamma, &beta, 1e-5, true);
                std::hint::black_box(y);
                stats = (m, v);
            });
            let b = time_min(reps, || {
                std::hint::black_box(batch_norm::backward(
                    &x,
                    [n, c, s],
                    &gamma,
                    &beta,
                    &stats.0,
                    &stats.1,
                    1e-5,
                    true,
                    &dy,
                ));
            });
            fwd += f * count as f64;
            bwd += b * count as f64;
            // Forward reads x three times and writes y; backward reads x and dy twice, writes dx.
            bytes += (4.0 + 5.0) * (len * 4) as f64 * count as f64;
        }
        println!(
            "{model:<16} forward {:7.1} ms  backward {:7.1} ms  total {:7.1} ms  ({:.1} GB/s of passes)",
            fwd * 1e3,
            bwd * 1e3,
            (fwd + bwd) * 1e3,
            bytes / (fwd + bwd) / 1e9
        );
    }
}
