//! Faster CPU paths for the convolutions of image models, written against Burn's tensor API so
//! that Burn's autodiff derives their backward passes from well-blocked matrix products.
//!
//! Why: on Burn Flex a ResNet-50 training step spends half its time in convolution weight
//! gradients (BENCHMARKS.md, "CPU profile"). Burn's generic `conv2d_weight_backward` runs a
//! convolution with batch and channels swapped, which on Flex becomes many thin matrix-vector
//! products at 4-12 GFLOP/s. For a 1x1 convolution the weight gradient is one matrix product
//! per image, dW = Σₙ dYₙ · Xₙᵀ (K = H·W), and the input gradient dX = Wᵀ · dY: exactly what
//! autodiff produces for the forward pass written as `W · X`.
//!
//! - [`conv2d`]: [`burn::nn::conv::Conv2d`]'s forward, taking the fast path where one applies
//!   ([`fast_path`]) and Burn's `conv2d` otherwise.
//! - The fast path is on for CPU devices (Flex, NdArray) with autodiff (training: the gain is
//!   in the backward; for inference Flex's own 1x1 forward is faster) unless
//!   `HEARTH_FAST_KERNELS=0`, so the reference path stays one variable away.
//!
//! No dependency on any model: this crate could go upstream as a Flex improvement (there it
//! belongs in `conv2d_weight_backward` itself; see the crate README).

use std::sync::OnceLock;

use burn::nn::PaddingConfig2d;
use burn::nn::conv::Conv2d;
use burn::prelude::*;

/// Which implementation a convolution takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// Burn's own `conv2d`.
    Reference,
    /// 1x1, no padding, no dilation, one group: a matrix product per image (a strided one
    /// first takes every stride-th pixel).
    Pointwise,
}

/// Whether the fast paths are allowed (`HEARTH_FAST_KERNELS`, read once; anything but `0`,
/// `false` or `off` means yes).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("HEARTH_FAST_KERNELS")
            .map(|v| !matches!(v.trim(), "0" | "false" | "off"))
            .unwrap_or(true)
    })
}

/// Whether `device` computes on the CPU (the fast paths are measured there only).
pub fn is_cpu(device: &Device) -> bool {
    let plain = device.clone().inner();
    plain == Device::flex() || format!("{plain:?}").starts_with("NdArray")
}

/// The path `conv` takes on `x`'s device (with `allowed` standing for [`enabled`]).
pub fn fast_path(conv: &Conv2d, device: &Device, allowed: bool) -> Path {
    let pointwise = conv.kernel_size == [1, 1]
        && conv.stride.iter().all(|&s| s >= 1)
        && conv.dilation == [1, 1]
        && conv.groups == 1
        && matches!(
            conv.padding,
            PaddingConfig2d::Valid | PaddingConfig2d::Explicit(0, 0, 0, 0)
        );
    // Only when training: Flex's own 1x1 forward is faster at batch 16 (7.5 vs 9.6 ResNet-50
    // images/s), and the gain is the backward's.
    if allowed && pointwise && device.is_autodiff() && is_cpu(device) {
        Path::Pointwise
    } else {
        Path::Reference
    }
}

/// `conv.forward(x)`, by the fast path where one applies.
pub fn conv2d(conv: &Conv2d, x: Tensor<4>) -> Tensor<4> {
    match fast_path(conv, &x.device(), enabled()) {
        Path::Pointwise => pointwise_strided(
            x,
            conv.weight.val(),
            conv.bias.as_ref().map(|b| b.val()),
            conv.stride,
        ),
        Path::Reference => conv.forward(x),
    }
}

/// A 1x1 convolution with `stride` (no padding, one group): every stride-th pixel (a strided
/// slice, whose backward scatters the gradient back), then [`pointwise`].
pub fn pointwise_strided(
    x: Tensor<4>,
    weight: Tensor<4>,
    bias: Option<Tensor<1>>,
    stride: [usize; 2],
) -> Tensor<4> {
    let x = if stride == [1, 1] {
        x
    } else {
        let [_, _, h, w] = x.dims();
        x.slice(burn::tensor::s![.., .., 0..h; stride[0] as isize, 0..w; stride[1] as isize])
    };
    pointwise(x, weight, bias)
}

/// A 1x1 convolution (stride 1, no padding, one group) as a matrix product per image:
/// `[Co, Ci] · [N, Ci, H·W]`. Its autodiff backward is two matrix products: the weight
/// gradient `Σₙ dYₙ · Xₙᵀ` and the input gradient `Wᵀ · dY`.
pub fn pointwise(x: Tensor<4>, weight: Tensor<4>, bias: Option<Tensor<1>>) -> Tensor<4> {
    let [n, ci, h, w] = x.dims();
    let [co, wci, kh, kw] = weight.dims();
    assert!(
        wci == ci && kh == 1 && kw == 1,
        "pointwise convolution: weight {:?} for input {:?}",
        weight.dims(),
        x.dims()
    );
    let w2 = weight.reshape([1, co, ci]);
    let y = w2.matmul(x.reshape([n, ci, h * w]));
    let y = match bias {
        Some(b) => y + b.reshape([1, co, 1]),
        None => y,
    };
    y.reshape([n, co, h, w])
}
