//! The extension ops ([`crate::ext::ConvBackend`]) on Burn's cubecl backend (wgpu, Vulkan, CUDA):
//! each convolution pass and matrix product runs the kernel [`crate::select`] names for its
//! geometry and the device's capabilities, launched through cubek as Burn's own kernels are,
//! with no autotune: nothing is timed, and a new GPU compiles only the kernels it runs.
//!
//! A kernel whose setup declines a problem (an alignment, the shared memory it needs) hands it
//! to the next in the list; the list ends with Burn's direct kernels, which run everywhere.
//! Which kernel ran for each geometry is kept ([`chosen`]) for reports and tests.

use std::collections::HashMap;
use std::sync::Mutex;

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::tensor::ops::{ConvOptions, ConvTransposeOptions};
use burn::tensor::{DType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::conv::{
    ConvStrategy, ConvTranspose2dStrategy, conv_forward, conv_transpose2d,
};
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::ops::{permute_nchw_to_nhwc, permute_nhwc_to_nchw};
use burn_cubecl::tensor::CubeTensor;
use cubek::convolution::{
    AcceleratedTileKind, ConvAlgorithm, ConvolutionArgs, ConvolutionInputs, Strategy, launch_ref,
};
use cubek::matmul::definition::{MatmulElems, MatmulGlobalElems};
use cubek::std::InputBinding;

use crate::cube_base::{product, reshape};
use crate::select::{Caps, ConvKernel, ConvOp, Loading, Tile, conv_kernels};
use crate::weight_grad::{ConvShape, Geometry2, conv_shape};

/// What the device of `t` can run, for [`crate::select`].
fn caps(t: &CubeTensor) -> Caps {
    let features = &t.client.properties().features;
    Caps {
        mma: !features.matmul.mma.is_empty(),
        cmma: !features.matmul.cmma.is_empty(),
        tma: !features.tma.is_empty(),
        copy_async: features.copy_async,
    }
}

/// What a kernel was chosen for: a convolution pass and its geometry without the batch, or a
/// linear product's `[in, out]`, with the element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Choice {
    Conv(ConvOp, ConvShape, DType),
    Product([usize; 2], DType),
}

/// Which kernel ran for each [`Choice`] in this process. Looked up on every call (a hash of a
/// few integers); described in words only when [`chosen`] reads it.
static CHOSEN: Mutex<Option<HashMap<Choice, &'static str>>> = Mutex::new(None);

fn remember(choice: Choice, kernel: &'static str) {
    if let Ok(mut map) = CHOSEN.lock() {
        map.get_or_insert_with(HashMap::new)
            .entry(choice)
            .or_insert(kernel);
    }
}

/// Every (operation and geometry, kernel) this process chose by rule on a cubecl device, in
/// order of the description. Empty where nothing ran there, or everything autotuned.
pub fn chosen() -> Vec<(String, String)> {
    let Ok(map) = CHOSEN.lock() else {
        return Vec::new();
    };
    let mut out: Vec<(String, String)> = map
        .iter()
        .flatten()
        .map(|(choice, kernel)| {
            let what = match choice {
                Choice::Conv(op, s, dtype) => describe(*op, s, *dtype),
                Choice::Product([i, o], dtype) => {
                    format!("matmul [.., {i}] x [{i}, {o}] {dtype:?}")
                }
            };
            (what, kernel.to_string())
        })
        .collect();
    out.sort();
    out
}

/// An operation and its geometry in words, without the batch: `forward 64->64 3x3 stride 1
/// pad 1 on 56x56 F32`.
fn describe(op: ConvOp, s: &ConvShape, dtype: DType) -> String {
    let op = match op {
        ConvOp::Forward => "forward",
        ConvOp::InputGrad => "input gradient",
        ConvOp::WeightGrad => "weight gradient",
    };
    format!(
        "{op} {}->{} {}x{} stride {} pad {} on {}x{} {dtype:?}",
        s.input[1],
        s.out_channels,
        s.kernel[0],
        s.kernel[1],
        s.stride[0],
        s.padding[0],
        s.input[2],
        s.input[3]
    )
}

fn options([stride, padding, dilation]: Geometry2) -> ConvOptions<2> {
    ConvOptions::new(stride, padding, dilation, 1)
}

fn dims4(t: &CubeTensor) -> [usize; 4] {
    let s = t.meta.shape();
    [s[0], s[1], s[2], s[3]]
}

/// Runs the first kernel of `op`'s list that accepts the problem.
fn run(
    op: ConvOp,
    s: &ConvShape,
    probe: &CubeTensor,
    mut launch: impl FnMut(ConvKernel) -> Result<CubeTensor, String>,
) -> CubeTensor {
    let dtype = probe.dtype;
    let kernels = conv_kernels(op, s, dtype.size(), caps(probe));
    let mut declined = Vec::new();
    for kernel in kernels {
        match launch(kernel) {
            Ok(out) => {
                let mut geometry = *s;
                geometry.input[0] = 0;
                remember(Choice::Conv(op, geometry, dtype), kernel.label());
                return out;
            }
            Err(reason) => declined.push(format!("{}: {reason}", kernel.label())),
        }
    }
    // The list ends with Burn's direct kernel, which declines nothing Burn's own conv2d
    // accepts: reaching here is a shape Burn refuses too.
    panic!(
        "no GPU kernel runs the convolution {} (batch {}): {}",
        describe(op, s, dtype),
        s.input[0],
        declined.join("; ")
    )
}

fn algorithm(loading: Loading, tile: Tile) -> Strategy {
    let algorithm = match (loading, tile) {
        (Loading::Sync, Tile::Cmma) => ConvAlgorithm::SimpleSyncCyclic,
        (Loading::Sync, Tile::Mma) => ConvAlgorithm::SimpleSyncStrided,
        (Loading::Async, Tile::Cmma) => ConvAlgorithm::SimpleAsyncCyclic,
        (Loading::Async, Tile::Mma) => ConvAlgorithm::SimpleAsyncStrided,
        (Loading::Tma, _) => ConvAlgorithm::SimpleAsyncTma,
    };
    let tile_kind = match tile {
        Tile::Cmma => AcceleratedTileKind::Cmma,
        Tile::Mma => AcceleratedTileKind::Mma,
    };
    Strategy::Inferred {
        algorithm,
        tile_kind,
    }
}

fn binding(t: CubeTensor) -> InputBinding {
    let dtype = t.dtype;
    InputBinding::new(t.binding(), dtype_to_storage_type(dtype))
}

fn elems(lhs: DType, rhs: DType, out: DType) -> MatmulElems {
    MatmulElems::from_globals(&MatmulGlobalElems {
        lhs: dtype_to_storage_type(lhs),
        rhs: dtype_to_storage_type(rhs),
        out: dtype_to_storage_type(out),
    })
}

fn args([stride, padding, dilation]: Geometry2) -> ConvolutionArgs<2> {
    ConvolutionArgs {
        stride,
        padding,
        dilation,
    }
}

/// cubek's implicit GEMM for `op`, on NHWC views of the NCHW operands (as burn-cubecl launches
/// its own), the result back in NCHW.
fn implicit_gemm(
    op: ConvOp,
    strategy: &Strategy,
    a: &CubeTensor,
    b: &CubeTensor,
    out_nchw: [usize; 4],
    geometry: Geometry2,
) -> Result<CubeTensor, String> {
    let client = a.client.clone();
    let [n, c, h, w] = out_nchw;
    // As burn-cubecl: the output takes the input's type forward, the output gradient's type
    // backward.
    let dtype = match op {
        ConvOp::Forward | ConvOp::InputGrad => a.dtype,
        ConvOp::WeightGrad => b.dtype,
    };
    let out = empty_device_dtype(
        client.clone(),
        a.device.clone(),
        Shape::from(vec![n, h, w, c]),
        dtype,
    );
    let (a_nhwc, b_nhwc) = (
        permute_nchw_to_nhwc(a.clone()),
        permute_nchw_to_nhwc(b.clone()),
    );
    let dtypes = elems(a.dtype, b.dtype, dtype);
    let inputs = match op {
        ConvOp::Forward => ConvolutionInputs::Forward {
            input: binding(a_nhwc),
            weight: binding(b_nhwc),
            bias: None,
            out: out.clone().binding(),
        },
        ConvOp::InputGrad => ConvolutionInputs::BackwardData {
            out_grad: binding(a_nhwc),
            weights: binding(b_nhwc),
            in_grad: out.clone().binding(),
        },
        ConvOp::WeightGrad => ConvolutionInputs::BackwardWeight {
            input: binding(a_nhwc),
            out_grad: binding(b_nhwc),
            weight_grad: out.clone().binding(),
        },
    };
    launch_ref::<2>(strategy, &client, inputs, args(geometry), dtypes)
        .map_err(|e| format!("{e:?}"))?;
    Ok(permute_nhwc_to_nchw(out))
}

/// A 1x1 convolution (stride 1, no padding) as one batched product: `[1, Co, Ci] · [N, Ci, HW]`.
fn pointwise_forward(x: &CubeTensor, weight: &CubeTensor) -> Result<CubeTensor, String> {
    let [n, ci, h, w] = dims4(x);
    let co = weight.meta.shape()[0];
    let y = product(
        reshape(weight.clone(), &[1, co, ci]),
        reshape(x.clone(), &[n, ci, h * w]),
    )?;
    Ok(reshape(y, &[n, co, h, w]))
}

/// Its input gradient: `[1, Ci, Co] (Wᵀ) · [N, Co, HW]`.
fn pointwise_input_grad(weight: &CubeTensor, grad: &CubeTensor) -> Result<CubeTensor, String> {
    let [n, co, h, w] = dims4(grad);
    let ci = weight.meta.shape()[1];
    let wt = CubeBackend::float_swap_dims(reshape(weight.clone(), &[1, co, ci]), 1, 2);
    let dx = product(wt, reshape(grad.clone(), &[n, co, h * w]))?;
    Ok(reshape(dx, &[n, ci, h, w]))
}

/// Its weight gradient: `[Co, N·HW] · [N·HW, Ci]`, the images laid side by side.
fn pointwise_weight_grad(x: &CubeTensor, grad: &CubeTensor) -> Result<CubeTensor, String> {
    let [n, ci, h, w] = dims4(x);
    let co = grad.meta.shape()[1];
    let side_by_side = |t: &CubeTensor, c: usize| {
        let t = CubeBackend::float_swap_dims(reshape(t.clone(), &[n, c, h * w]), 0, 1);
        reshape(t, &[c, n * h * w])
    };
    let dy = side_by_side(grad, co);
    let xt = CubeBackend::float_swap_dims(side_by_side(x, ci), 0, 1);
    let dw = product(dy, xt)?;
    Ok(reshape(dw, &[co, ci, 1, 1]))
}

/// The input gradient as Burn's direct transposed convolution (burn-cubecl's own fallback
/// takes the autotuned one).
fn direct_input_grad(
    weight: &CubeTensor,
    grad: &CubeTensor,
    s: &ConvShape,
) -> Result<CubeTensor, String> {
    let padding_out = s.unread_edge(dims4(grad));
    let options = ConvTransposeOptions::new(s.stride, s.padding, padding_out, s.dilation, 1);
    conv_transpose2d(
        grad.clone(),
        weight.clone(),
        None,
        options,
        ConvTranspose2dStrategy::Direct,
    )
    .map_err(|e| format!("{e:?}"))
}

/// The weight gradient as one direct convolution of the input by the output gradient, batch
/// and channels swapped (each input channel an image of N channels, each output channel a
/// filter; stride and dilation trade places), as burn-cubecl's fallback frames it, but with
/// the direct kernel instead of the autotuned one.
fn direct_weight_grad(
    x: &CubeTensor,
    grad: &CubeTensor,
    s: &ConvShape,
) -> Result<CubeTensor, String> {
    let images = CubeBackend::float_swap_dims(x.clone(), 0, 1);
    let filters = CubeBackend::float_swap_dims(grad.clone(), 0, 1);
    let options = ConvOptions::new(s.dilation, s.padding, s.stride, 1);
    let swapped = conv_forward(images, filters, None, options, ConvStrategy::Direct)
        .map_err(|e| format!("{e:?}"))?;
    let dw = CubeBackend::float_swap_dims(swapped, 0, 1);
    // The product can overhang the kernel where a stride does not divide the input evenly.
    let [co, ci, kh, kw] = dims4(&dw);
    let wanted = [s.out_channels, s.input[1], s.kernel[0], s.kernel[1]];
    if [co, ci, kh, kw] == wanted {
        return Ok(dw);
    }
    let slices = wanted.map(|n| burn::tensor::Slice::from(0..n));
    Ok(CubeBackend::float_slice(dw, &slices))
}

/// What [`ConvKernel::PerImage`] says where the rules never put it.
const WEIGHT_GRAD_ONLY: &str = "products per image compute weight gradients only";
/// What [`ConvKernel::Col2Im`] says where the rules never put it.
const INPUT_GRAD_ONLY: &str = "col2im computes input gradients only";

/// The forward convolution (one group, no bias).
pub fn conv2d(x: CubeTensor, weight: CubeTensor, geometry: Geometry2) -> CubeTensor {
    let s = conv_shape(dims4(&x), dims4(&weight), geometry);
    let Some(out) = s.output() else {
        // Burn's own kernel says what is wrong with the shape.
        return conv_forward(x, weight, None, options(geometry), ConvStrategy::Direct)
            .unwrap_or_else(|e| panic!("conv2d: {e:?}"));
    };
    run(ConvOp::Forward, &s, &x, |kernel| match kernel {
        ConvKernel::ImplicitGemm(l, t) => implicit_gemm(
            ConvOp::Forward,
            &algorithm(l, t),
            &x,
            &weight,
            out,
            geometry,
        ),
        ConvKernel::Pointwise => pointwise_forward(&x, &weight),
        ConvKernel::PerImage => Err(WEIGHT_GRAD_ONLY.into()),
        ConvKernel::Col2Im => Err(INPUT_GRAD_ONLY.into()),
        ConvKernel::Direct => conv_forward(
            x.clone(),
            weight.clone(),
            None,
            options(geometry),
            ConvStrategy::Direct,
        )
        .map_err(|e| format!("{e:?}")),
    })
}

/// The input gradient of that convolution, `input_shape` `[N, Ci, H, W]`.
pub fn conv2d_x_grad(
    weight: CubeTensor,
    grad: CubeTensor,
    input_shape: [usize; 4],
    geometry: Geometry2,
) -> CubeTensor {
    let s = conv_shape(input_shape, dims4(&weight), geometry);
    run(ConvOp::InputGrad, &s, &grad, |kernel| match kernel {
        ConvKernel::ImplicitGemm(l, t) => implicit_gemm(
            ConvOp::InputGrad,
            &algorithm(l, t),
            &grad,
            &weight,
            input_shape,
            geometry,
        ),
        ConvKernel::Pointwise => pointwise_input_grad(&weight, &grad),
        ConvKernel::PerImage => Err(WEIGHT_GRAD_ONLY.into()),
        ConvKernel::Col2Im => crate::col2im::input_grad(&weight, &grad, &s),
        ConvKernel::Direct => direct_input_grad(&weight, &grad, &s),
    })
}

/// The weight gradient of that convolution, `weight_shape` `[Co, Ci, kh, kw]`.
pub fn conv2d_weight_grad(
    x: CubeTensor,
    grad: CubeTensor,
    weight_shape: [usize; 4],
    geometry: Geometry2,
) -> CubeTensor {
    let s = conv_shape(dims4(&x), weight_shape, geometry);
    run(ConvOp::WeightGrad, &s, &x, |kernel| match kernel {
        ConvKernel::ImplicitGemm(l, t) => implicit_gemm(
            ConvOp::WeightGrad,
            &algorithm(l, t),
            &x,
            &grad,
            weight_shape,
            geometry,
        ),
        ConvKernel::Pointwise => pointwise_weight_grad(&x, &grad),
        ConvKernel::PerImage => crate::per_image::weight_grad(&x, &grad, &s),
        ConvKernel::Col2Im => Err(INPUT_GRAD_ONLY.into()),
        ConvKernel::Direct => direct_weight_grad(&x, &grad, &s),
    })
}

/// `lhs · rhs` for a linear layer, by one fixed kernel.
pub fn linear_product(lhs: FloatTensor<CubeBackend>, rhs: FloatTensor<CubeBackend>) -> CubeTensor {
    let [inputs, outputs] = [
        rhs.meta.shape()[0],
        rhs.meta.shape()[rhs.meta.num_dims() - 1],
    ];
    let dtype = lhs.dtype;
    let out = product(lhs, rhs).unwrap_or_else(|e| {
        panic!("linear layer [.., {inputs}] x [{inputs}, {outputs}] {dtype:?}: {e}")
    });
    remember(Choice::Product([inputs, outputs], dtype), "matmul_cube");
    out
}
