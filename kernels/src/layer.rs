//! [`conv2d`] and the path it takes ([`fast_path`]), over the kernels of the other modules.

use burn::nn::conv::Conv2d;
use burn::prelude::*;
use burn::tensor::FloatDType;

use crate::base::{enabled, is_cpu, is_flex, selects_gpu_kernels, symmetric};
use crate::cast::cast;
use crate::ext;
use crate::precision::low_precision;

/// Which implementation a convolution takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// Burn's own `conv2d`.
    Reference,
    /// 1x1 with a stride above 1, no padding, no dilation, one group: every stride-th pixel,
    /// then a matrix product per image.
    Pointwise,
    /// One group on a Flex device: the extension op [`ext::conv2d_gemm_grad`], which takes
    /// our im2col + GEMM forward and input gradient where they measured faster than Flex's and
    /// Flex's elsewhere, and always our weight gradient.
    Gemm,
    /// One group on a cubecl device (wgpu, Vulkan, CUDA; the `cube` feature): the same
    /// extension op, each pass by the kernel [`crate::select`] picks by rule, never autotuned.
    Selected,
}

/// The path `conv` takes on `x`'s device (with `allowed` standing for [`enabled`]).
pub fn fast_path(conv: &Conv2d, device: &Device, allowed: bool) -> Path {
    if conv.groups != 1 {
        return Path::Reference;
    }
    let Some(padding) = symmetric(&conv.padding) else {
        return Path::Reference;
    };
    if selects_gpu_kernels(device, allowed) {
        return Path::Selected;
    }
    if !allowed || !is_cpu(device) {
        return Path::Reference;
    }
    let pointwise = conv.kernel_size == [1, 1] && conv.dilation == [1, 1] && padding == [0, 0];
    let strided = conv.stride.iter().any(|&s| s > 1);
    let training = device.is_autodiff();
    // kernels/examples/conv_paths.rs: while training, a strided 1x1 is fastest as a slice and
    // a product (0.12-0.14 s against 0.16-0.23 s for ResNet-50's at batch 16); every other
    // shape with the GEMM op. On NdArray, which the extension does not cover, only the
    // pointwise path applies, and only its backward gains.
    match (is_flex(device), training, pointwise) {
        (true, true, true) if strided => Path::Pointwise,
        (true, _, _) => Path::Gemm,
        (false, true, true) => Path::Pointwise,
        _ => Path::Reference,
    }
}

/// `conv.forward(x)`, by the fast path where one applies; in `x`'s float type when that is
/// bf16 or f16 ([`crate::precision`]).
///
/// On a CPU with a fast path, a low-precision convolution runs in the f32 kernels on its
/// inputs and weights rounded to the low type, the result rounded to it: what a bf16 or f16
/// kernel with f32 accumulation gives (oneDNN's, and PyTorch's on the CPU), at the f32
/// kernels' speed instead of Burn's portable low-precision ones (2.5x slower for ResNet-50
/// training, BENCHMARKS.md "Mixed precision").
pub fn conv2d(conv: &Conv2d, x: Tensor<4>) -> Tensor<4> {
    crate::warm::keep_pool_warm(&x.device());
    // A weight cut into pieces (ZeRO stage 3, `crate::keyed::forward_from`): its module holds
    // it empty, and only the extension's op fetches it.
    if crate::keyed::is_pieced(conv.weight.id.val()) && low_precision(&x).is_none() {
        return pieced_conv2d(conv, x);
    }
    if let Some(dt) = low_precision(&x) {
        let path = fast_path(conv, &x.device(), enabled());
        if path == Path::Selected {
            // GPU kernels take the low type as it is (tensor cores).
            let weight = conv.weight.val().cast(dt);
            let bias = conv.bias.as_ref().map(|b| b.val().cast(dt));
            return conv2d_on(conv, path, x, weight, bias, None);
        }
        if path != Path::Reference {
            let f32 = FloatDType::F32;
            let rounded = |t: Tensor<1>| cast(cast(t, dt), f32);
            let weight = cast(cast(conv.weight.val(), dt), f32);
            let bias = conv.bias.as_ref().map(|b| rounded(b.val()));
            return cast(conv2d_on(conv, path, cast(x, f32), weight, bias, None), dt);
        }
        return match symmetric(&conv.padding) {
            Some(padding) => burn::tensor::module::conv2d(
                x,
                conv.weight.val().cast(dt),
                conv.bias.as_ref().map(|b| b.val().cast(dt)),
                burn::tensor::ops::ConvOptions::new(
                    conv.stride,
                    padding,
                    conv.dilation,
                    conv.groups,
                ),
            ),
            // Padding only Burn's module resolves: in f32, handed back in `x`'s type.
            None => conv.forward(x.cast(FloatDType::F32)).cast(dt),
        };
    }
    let path = match fast_path(conv, &x.device(), enabled()) {
        // A keyed forward (`crate::keyed`) takes the op that can keep its weight by key.
        Path::Pointwise if crate::keyed::keying() && is_flex(&x.device()) => Path::Gemm,
        path => path,
    };
    // Without autodiff the module's weight is not written while it runs: inference, whose
    // transformed weights may be kept (`crate::winograd::cache`).
    let inference = !x.device().is_autodiff() && !crate::keyed::keying();
    let run = || {
        conv2d_on(
            conv,
            path,
            x,
            conv.weight.val(),
            conv.bias.as_ref().map(|b| b.val()),
            Some(conv.weight.id.val()),
        )
    };
    if inference {
        crate::winograd::cache::inference(run)
    } else {
        run()
    }
}

/// `conv` on `x` with its weight cut into pieces of output channels, taken by the extension's
/// op a piece at a time ([`crate::keyed::forward_from`]): its module holds an empty stand-in,
/// and the op is told the kernel's size beside it. Only a convolution of
/// one group with the same padding on both sides takes pieces (ZeRO stage 3 cuts no other:
/// `hearth::pipeline::piece_rows`); another is a caller's broken promise, and panics naming it.
fn pieced_conv2d(conv: &Conv2d, x: Tensor<4>) -> Tensor<4> {
    let key = conv.weight.id.val();
    if conv.groups != 1 || symmetric(&conv.padding).is_none() {
        panic!(
            "hearth-kernels: weight {key} is cut into pieces, and its convolution ({} groups, \
             padding {:?}) is not of one group with the same padding on both sides",
            conv.groups, conv.padding
        );
    }
    let bias = conv.bias.as_ref().map(|b| b.val());
    if !x.device().is_autodiff() {
        return pieced_conv2d_without_graph(conv, x, key, bias);
    }
    conv2d_on(conv, Path::Gemm, x, conv.weight.val(), bias, Some(key))
}

/// [`pieced_conv2d`] on a device without autodiff (ZeRO stage 3's validation): nothing is kept
/// for a backward, so the layer takes the pieces itself, each a plain convolution by the
/// weight of its output channels, fetched from the pass's source and let go after it; the
/// pieces' outputs joined along the channels. On every backend (each piece goes through
/// [`ext::conv2d_gemm_grad`] with a weight of its own).
fn pieced_conv2d_without_graph(
    conv: &Conv2d,
    x: Tensor<4>,
    key: u64,
    bias: Option<Tensor<1>>,
) -> Tensor<4> {
    let Some(pieces) = crate::keyed::pieces_of(key) else {
        panic!("hearth-kernels: weight {key} is not cut into pieces by the forward under way");
    };
    let device = x.device();
    let inputs = x.dims()[1];
    let [kh, kw] = conv.kernel_size;
    pieces.check_conv(key, inputs, [kh, kw]);
    let padding = symmetric(&conv.padding).unwrap_or([0, 0]);
    let geometry = [conv.stride, padding, conv.dilation];
    let parts: Vec<Tensor<4>> = pieces
        .rows
        .iter()
        .enumerate()
        .map(|(k, rows)| {
            let values = crate::keyed::piece_value(key, k, rows.len(), pieces.cols);
            let w = Tensor::<2>::from_data(values, &device).reshape([rows.len(), inputs, kh, kw]);
            ext::conv2d_gemm_grad(x.clone(), w, geometry)
        })
        .collect();
    with_bias(Tensor::cat(parts, 1), bias)
}

/// `y` plus `bias` per output channel.
fn with_bias(y: Tensor<4>, bias: Option<Tensor<1>>) -> Tensor<4> {
    match bias {
        Some(b) => {
            let co = b.dims()[0];
            y + b.reshape([1, co, 1, 1])
        }
        None => y,
    }
}

/// `conv`'s shape applied to `x` with `weight` and `bias` (f32) by `path` (the reference path
/// is `conv.forward`: with the module's own weight and bias). `key`: `weight` is the module's
/// own, which the extension op may keep by that key ([`crate::keyed`]).
fn conv2d_on(
    conv: &Conv2d,
    path: Path,
    x: Tensor<4>,
    weight: Tensor<4>,
    bias: Option<Tensor<1>>,
    key: Option<u64>,
) -> Tensor<4> {
    match path {
        Path::Pointwise => pointwise_strided(x, weight, bias, conv.stride),
        Path::Gemm | Path::Selected => {
            let padding = symmetric(&conv.padding).unwrap_or([0, 0]);
            let geometry = [conv.stride, padding, conv.dilation];
            let y = match key {
                Some(key) => crate::keyed::with_conv_key(key, conv.kernel_size, || {
                    ext::conv2d_gemm_grad(x, weight, geometry)
                }),
                None => ext::conv2d_gemm_grad(x, weight, geometry),
            };
            with_bias(y, bias)
        }
        // Only the f32 path takes it, with the module's own weight and bias.
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
