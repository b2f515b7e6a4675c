//! What the kernel examples share (`mod common;` in each).
#![allow(dead_code)] // each example takes what it needs

use std::time::Instant;

/// The fastest of `reps` timed calls of `f`, in seconds, after one untimed call.
pub fn time_min(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::MAX, f64::min)
}

/// `name` parsed as a count, else `default`.
pub fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One convolution of a network: (in channels, out channels, kernel, stride, input side, how
/// many the network has), at 224x224.
pub type Conv = (usize, usize, usize, usize, usize, usize);

/// VGG-16's convolutions.
pub const VGG16: [Conv; 9] = [
    (3, 64, 3, 1, 224, 1),
    (64, 64, 3, 1, 224, 1),
    (64, 128, 3, 1, 112, 1),
    (128, 128, 3, 1, 112, 1),
    (128, 256, 3, 1, 56, 1),
    (256, 256, 3, 1, 56, 2),
    (256, 512, 3, 1, 28, 1),
    (512, 512, 3, 1, 28, 2),
    (512, 512, 3, 1, 14, 3),
];

/// ResNet-50's (torchvision: the stride on the 3x3).
pub const RESNET50: [Conv; 16] = [
    (3, 64, 7, 2, 224, 1),
    (64, 64, 3, 1, 56, 3),
    (128, 128, 3, 2, 56, 1),
    (128, 128, 3, 1, 28, 3),
    (256, 256, 3, 2, 28, 1),
    (256, 256, 3, 1, 14, 5),
    (512, 512, 3, 2, 14, 1),
    (512, 512, 3, 1, 7, 2),
    (64, 256, 1, 1, 56, 4),
    (256, 64, 1, 1, 56, 2),
    (256, 512, 1, 2, 56, 1),
    (512, 128, 1, 1, 28, 3),
    (1024, 256, 1, 1, 14, 5),
    (256, 1024, 1, 1, 14, 6),
    (2048, 512, 1, 1, 7, 2),
    (512, 2048, 1, 1, 7, 3),
];

/// DenseNet-121's 3x3 convolutions (128 → 32 in every dense layer), then the same shapes'
/// input gradients as forward convolutions of the output gradient (32 → 128, kernel flipped).
pub const DENSENET121: [Conv; 8] = [
    (128, 32, 3, 1, 56, 6),
    (128, 32, 3, 1, 28, 12),
    (128, 32, 3, 1, 14, 24),
    (128, 32, 3, 1, 7, 16),
    (32, 128, 3, 1, 56, 6),
    (32, 128, 3, 1, 28, 12),
    (32, 128, 3, 1, 14, 24),
    (32, 128, 3, 1, 7, 16),
];
