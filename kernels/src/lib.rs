//! Faster CPU paths for the convolutions of image models on Burn 0.22 Flex, with their
//! autodiff backward passes.
//!
//! Why: on Burn Flex a ResNet-50 training step spent half its time in convolution weight
//! gradients (docs/benchmarks/cpu-models.md, "CPU profile"). Burn's generic `conv2d_weight_backward` runs a
//! convolution with batch and channels swapped, which Flex executes as thin matrix products
//! at 4-65 GFLOP/s. Two paths replace it while training on the CPU:
//!
//! - [`Path::Gemm`] ([`ext`]): a backend-extension op with its own autodiff backward. The
//!   weight gradient is always im2col and one GEMM over images x output pixels
//!   ([`weight_grad`]); the forward and the input gradient are ours ([`conv`]) on the shapes
//!   where they measured faster than Flex's, Flex's elsewhere. Every convolution with one
//!   group on a Flex device, training or not.
//! - [`Path::Pointwise`]: a strided 1x1 convolution while training, as a strided slice and
//!   `W · X` per image, written in tensor ops so autodiff derives both gradients as GEMMs
//!   (also plain 1x1 on NdArray).
//!
//! [`conv2d`] picks the path ([`fast_path`]): only on CPU devices, and never with
//! `HEARTH_FAST_KERNELS=0`, so the reference path stays one variable away.
//!
//! Beside the convolutions: batch norm (+ ReLU) in few passes while training and in one for
//! inference ([`norm`], [`batch_norm`]), and max pooling, its backward finding the argmax
//! again ([`pool`]).
//!
//! No dependency on any model: the weight gradient could go upstream as Flex's
//! `conv2d_weight_backward` (see the crate README).

use std::sync::OnceLock;

use burn::nn::PaddingConfig2d;
use burn::nn::conv::Conv2d;
use burn::prelude::*;
use burn::tensor::FloatDType;

pub mod batch_norm;
pub mod cast;
pub mod conv;
#[cfg(feature = "cube")]
pub mod cube;
pub mod ext;
pub mod gemv;
pub mod norm;
pub mod pool;
pub mod precision;
pub mod select;
pub mod weight_grad;

pub use cast::cast;
pub use precision::{linear, low_precision};

/// A contiguous Flex f32 tensor of `dims` holding `values` (the raw kernels' outputs).
pub(crate) fn f32_tensor(values: Vec<f32>, dims: Vec<usize>) -> burn_flex::FlexTensor {
    burn_flex::FlexTensor::new(
        burn::tensor::Bytes::from_elems(values),
        burn_flex::Layout::contiguous(burn::tensor::Shape::from(dims)),
        burn::tensor::DType::F32,
    )
}

/// `len` values written plane by plane in parallel (planes of `plane` values), without first
/// zeroing them: `fill(i, values)` writes plane `i`. A kernel's output written once skips a
/// pass over memory that `vec![0.0; len]` costs (a memset, or the kernel clearing fresh pages).
///
/// # Safety
/// `fill` must write every element of every plane it is given; `len` must be a multiple of
/// `plane` (or 0).
pub(crate) unsafe fn par_planes(
    len: usize,
    plane: usize,
    fill: impl Fn(usize, &mut [std::mem::MaybeUninit<f32>]) + Sync + Send,
) -> Vec<f32> {
    use rayon::prelude::*;
    let mut values = Vec::<f32>::with_capacity(len);
    if len > 0 {
        assert!(
            plane > 0 && len.is_multiple_of(plane),
            "{len} values in planes of {plane}"
        );
        values.spare_capacity_mut()[..len]
            .par_chunks_mut(plane)
            .enumerate()
            .for_each(|(i, p)| fill(i, p));
    }
    // SAFETY: the caller's `fill` wrote all `len` values (a panic in it never gets here).
    unsafe { values.set_len(len) };
    values
}

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
    /// extension op, each pass by the kernel [`select`] picks by rule, never autotuned.
    Selected,
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

/// Makes the calling thread the first of the threads of rayon's global pool, as a program's
/// main thread before any parallel work; `false` where it does not (`HEARTH_JOIN_POOL=0`,
/// fewer than 2 threads, or the global pool was already built).
///
/// Why: every parallel kernel (ours, gemm's, Burn Flex's) forks onto the global pool and joins.
/// Called from a thread outside the pool, each op injects its job, wakes the workers and puts
/// the caller to sleep until they finish: a sleep and a wake-up per op, and between ops three
/// threads (the caller and two spinning workers) on two cores. From a thread of the pool, an
/// op's pieces go on its own queue and it works on them itself, the other threads stealing.
/// The pool keeps its size (`RAYON_NUM_THREADS`, else one per core), the calling thread now
/// one of them. Measured on 2 cores (AMD EPYC Zen 5): docs/benchmarks/cpu-models.md, "the main thread in the
/// pool".
///
/// The calling thread keeps its identity, so Burn's `RunningState` (batch norm's running
/// statistics, kept per thread and averaged over threads) sees the same thread as without it;
/// running the steps on the pool's other threads instead changed them. With one thread the
/// pool would have no thread of its own left for work that other threads hand it while this
/// one waits on them, so it is not done then.
pub fn join_global_pool() -> bool {
    let off =
        std::env::var("HEARTH_JOIN_POOL").is_ok_and(|v| matches!(v.trim(), "0" | "false" | "off"));
    let threads = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
        .unwrap_or(1);
    if off || threads < 2 {
        return false;
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .use_current_thread()
        .build_global()
        .is_ok()
}

/// Whether `device` computes on the CPU (the fast paths are measured there only).
pub fn is_cpu(device: &Device) -> bool {
    is_flex(device) || format!("{:?}", device.clone().inner()).starts_with("NdArray")
}

/// Whether `device` runs through cubecl (wgpu, Vulkan, CUDA) in a build with the `cube`
/// feature: where [`Path::Selected`] applies.
pub fn is_cube(device: &Device) -> bool {
    #[cfg(feature = "cube")]
    {
        use burn::backend::DispatchDevice;
        matches!(
            device.clone().inner().as_dispatch(),
            DispatchDevice::Cube(_)
        )
    }
    #[cfg(not(feature = "cube"))]
    {
        let _ = device;
        false
    }
}

/// Whether Hearth's convolutions and linear layers on `device` take the kernels [`select`]
/// picks by rule: a cubecl device, the fast paths allowed, and `--autotune full` not asked for.
pub fn selects_gpu_kernels(device: &Device, allowed: bool) -> bool {
    allowed && is_cube(device) && select::selection() == select::Selection::Rules
}

/// Whether `device` is Burn Flex (with or without autodiff): the backend [`ext`] extends.
pub fn is_flex(device: &Device) -> bool {
    device.clone().inner() == Device::flex()
}

/// The symmetric padding `[rows, columns]` of `padding`, if it is symmetric and explicit.
fn symmetric(padding: &PaddingConfig2d) -> Option<[usize; 2]> {
    match *padding {
        PaddingConfig2d::Valid => Some([0, 0]),
        PaddingConfig2d::Explicit(top, left, bottom, right) if top == bottom && left == right => {
            Some([top, left])
        }
        _ => None,
    }
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
/// bf16 or f16 ([`precision`]).
///
/// On a CPU with a fast path, a low-precision convolution runs in the f32 kernels on its
/// inputs and weights rounded to the low type, the result rounded to it: what a bf16 or f16
/// kernel with f32 accumulation gives (oneDNN's, and PyTorch's on the CPU), at the f32
/// kernels' speed instead of Burn's portable low-precision ones (2.5x slower for ResNet-50
/// training, BENCHMARKS.md "Mixed precision").
pub fn conv2d(conv: &Conv2d, x: Tensor<4>) -> Tensor<4> {
    if let Some(dt) = low_precision(&x) {
        let path = fast_path(conv, &x.device(), enabled());
        if path == Path::Selected {
            // GPU kernels take the low type as it is (tensor cores).
            let weight = conv.weight.val().cast(dt);
            let bias = conv.bias.as_ref().map(|b| b.val().cast(dt));
            return conv2d_on(conv, path, x, weight, bias);
        }
        if path != Path::Reference {
            let f32 = FloatDType::F32;
            let rounded = |t: Tensor<1>| cast(cast(t, dt), f32);
            let weight = cast(cast(conv.weight.val(), dt), f32);
            let bias = conv.bias.as_ref().map(|b| rounded(b.val()));
            return cast(conv2d_on(conv, path, cast(x, f32), weight, bias), dt);
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
    let path = fast_path(conv, &x.device(), enabled());
    conv2d_on(
        conv,
        path,
        x,
        conv.weight.val(),
        conv.bias.as_ref().map(|b| b.val()),
    )
}

/// `conv`'s shape applied to `x` with `weight` and `bias` (f32) by `path` (the reference path
/// is `conv.forward`: with the module's own weight and bias).
fn conv2d_on(
    conv: &Conv2d,
    path: Path,
    x: Tensor<4>,
    weight: Tensor<4>,
    bias: Option<Tensor<1>>,
) -> Tensor<4> {
    match path {
        Path::Pointwise => pointwise_strided(x, weight, bias, conv.stride),
        Path::Gemm | Path::Selected => {
            let padding = symmetric(&conv.padding).unwrap_or([0, 0]);
            let y = ext::conv2d_gemm_grad(x, weight, [conv.stride, padding, conv.dilation]);
            match bias {
                Some(b) => {
                    let co = b.dims()[0];
                    y + b.reshape([1, co, 1, 1])
                }
                None => y,
            }
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
