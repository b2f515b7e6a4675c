//! The convolution op with our weight gradient, as a Burn backend extension: Burn Flex computes
//! the forward pass and the input gradient (its own tiled im2col + GEMM kernels), and the
//! weight gradient is [`crate::weight_grad::conv2d_weight_grad`]. Burn's autodiff knows no
//! backward for an extension op, so `Autodiff<B, C>` gets a handwritten one: the same as
//! Burn's `conv2d` backward (`burn-autodiff`, `ops/module.rs`) except for the weight gradient.
//!
//! One group, no bias (the callers add it as a broadcast sum, whose backward is autodiff's).

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::ops::ModuleOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, Flex, backend_extension};
use burn::backend::{AutodiffBackend, TensorMetadata};
use burn::prelude::*;
use burn::tensor::DType;
use burn::tensor::ops::ConvOptions;
use burn_flex::FlexTensor;

use crate::base::f32_tensor;
use crate::input_grad::flex_input_grad;
pub use crate::input_grad::{InputGrad, input_grad_path};
pub use crate::weight_grad::Geometry2;
use crate::weight_grad::{conv_shape, conv2d_weight_grad};

mod pieced;

fn options([stride, padding, dilation]: Geometry2) -> ConvOptions<2> {
    ConvOptions::new(stride, padding, dilation, 1)
}

/// The output shape of a convolution of `x` by `weight` (for fusion's deferred ops).
#[cfg_attr(not(feature = "cube"), allow(dead_code))]
fn conv_out_shape(x: &Shape, weight: &Shape, geometry: &Geometry2) -> Shape {
    let s = conv_shape(x.dims::<4>(), weight.dims::<4>(), *geometry);
    Shape::from(s.output().map_or_else(|| vec![0; 4], |o| o.to_vec()))
}

#[cfg_attr(not(feature = "cube"), allow(dead_code))]
fn dims_shape(dims: &[usize; 4]) -> Shape {
    Shape::from(dims.to_vec())
}

#[cfg_attr(not(feature = "cube"), allow(dead_code))]
fn product_shape(lhs: &Shape, rhs: &Shape) -> Shape {
    let mut dims = lhs.to_vec();
    let last = dims.len() - 1;
    dims[last] = rhs[rhs.num_dims() - 1];
    Shape::from(dims)
}

/// The extension: a convolution with its two gradients as ops of their own, and a linear
/// layer's matrix product. On Flex the weight gradient (and where faster the forward and input
/// gradient) are ours; on cubecl devices (the `cube` feature) every pass runs the kernel
/// [`crate::select`] picks by rule, with no autotune (`cube.rs`).
#[backend_extension(
    Flex,
    Autodiff,
    Cube: cfg(feature = "cube"),
    Fusion: cfg(feature = "cube"),
)]
pub trait ConvBackend: Backend {
    /// `conv2d(x, weight)` with one group and no bias.
    #[fusion(dtype = x, shape = conv_out_shape(x, weight, geometry))]
    fn hearth_conv2d(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        geometry: Geometry2,
    ) -> FloatTensor<Self>;

    /// The input gradient `input_shape` of that convolution.
    #[fusion(dtype = grad, shape = dims_shape(input_shape))]
    fn hearth_conv2d_x_grad(
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        input_shape: [usize; 4],
        geometry: Geometry2,
    ) -> FloatTensor<Self>;

    /// The weight gradient `[Co, Ci, kh, kw]` of that convolution.
    #[fusion(dtype = grad, shape = dims_shape(weight_shape))]
    fn hearth_conv2d_weight_grad(
        x: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        weight_shape: [usize; 4],
        geometry: Geometry2,
    ) -> FloatTensor<Self>;

    /// `lhs · rhs` for two matrices (a linear layer's `[B, in] · [in, out]`).
    #[fusion(dtype = lhs, shape = product_shape(lhs, rhs))]
    fn hearth_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self>;
}

impl<B: ConvBackend> pieced::PieceOps for B {
    fn conv(x: FloatTensor<B>, weight: FloatTensor<B>, geometry: Geometry2) -> FloatTensor<B> {
        B::hearth_conv2d(x, weight, geometry)
    }
    fn conv_x_grad(
        weight: FloatTensor<B>,
        grad: FloatTensor<B>,
        input_shape: [usize; 4],
        geometry: Geometry2,
    ) -> FloatTensor<B> {
        B::hearth_conv2d_x_grad(weight, grad, input_shape, geometry)
    }
    fn conv_weight_grad(
        x: FloatTensor<B>,
        grad: FloatTensor<B>,
        weight_shape: [usize; 4],
        geometry: Geometry2,
    ) -> FloatTensor<B> {
        B::hearth_conv2d_weight_grad(x, grad, weight_shape, geometry)
    }
    fn matmul(lhs: FloatTensor<B>, rhs: FloatTensor<B>) -> FloatTensor<B> {
        B::hearth_matmul(lhs, rhs)
    }
}

#[cfg(feature = "cube")]
impl ConvBackend for burn_cubecl::CubeBackend {
    fn hearth_conv2d(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        geometry: Geometry2,
    ) -> FloatTensor<Self> {
        crate::cube::conv2d(x, weight, geometry)
    }

    fn hearth_conv2d_x_grad(
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        input_shape: [usize; 4],
        geometry: Geometry2,
    ) -> FloatTensor<Self> {
        crate::cube::conv2d_x_grad(weight, grad, input_shape, geometry)
    }

    fn hearth_conv2d_weight_grad(
        x: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        weight_shape: [usize; 4],
        geometry: Geometry2,
    ) -> FloatTensor<Self> {
        crate::cube::conv2d_weight_grad(x, grad, weight_shape, geometry)
    }

    fn hearth_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        crate::cube::linear_product(lhs, rhs)
    }
}

impl ConvBackend for Flex {
    fn hearth_conv2d(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        geometry: Geometry2,
    ) -> FloatTensor<Self> {
        let weight_shape = weight.shape().dims::<4>();
        let shape = conv_shape(x.shape().dims::<4>(), weight_shape, geometry);
        let fits = shape.output().is_some() && weight_shape[1] == shape.input[1];
        let f32s = x.dtype() == DType::F32 && weight.dtype() == DType::F32;
        // Ours beats or ties Flex's forward on the shapes measured in
        // `kernels/examples/conv_paths.rs` (2-core AVX-512), images in parallel with
        // single-threaded products (one image cut into pieces of rows, of columns for 1x1, or
        // of output channels for a 1x1 on a small map): at batch 16 3x3 (ResNet-50's 217-304
        // against 151-253 GFLOP/s, strided ones 223-260 against 148-203; VGG-16's 220-371
        // against 121-307; DenseNet-121's 128→32 146-155 against 100-107, 88 against 99 on
        // 7x7), the 7x7 stem (114 against 64) and 1x1 (292-351 against 273-343); at batch 1
        // every kernel wider than 1x1 (ResNet-50's 124-222 against 69-163, VGG-16's 125-332
        // against 23-251) and, since one image's 1x1 products are cut evenly (Zen 4,
        // 2026-12-04), 1x1 too: DenseNet-121's 147-223 against 84-208, ResNet-50's 166-216
        // against 141-197 but 256→64 on 56x56 (185-189 against 211-213, one layer in
        // sixteen). On a Zen 5 Flex's 1x1 had led at batch 1 (1024→256 on 14x14: 248 against
        // ours 120, before the cut by output channels); not measured there since.
        if !(f32s && fits) {
            return Flex::conv2d(x, weight, None, options(geometry));
        }
        let y = crate::winograd::cache::forward(&x.to_contiguous(), &weight, &shape, None);
        f32_tensor(y, shape.output().map_or(vec![], |o| o.to_vec()))
    }

    fn hearth_conv2d_x_grad(
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        input_shape: [usize; 4],
        geometry: Geometry2,
    ) -> FloatTensor<Self> {
        let weight_shape = weight.shape().dims::<4>();
        let shape = conv_shape(input_shape, weight_shape, geometry);
        let fits =
            shape.output() == Some(grad.shape().dims::<4>()) && weight_shape[1] == input_shape[1];
        let f32s = weight.dtype() == DType::F32 && grad.dtype() == DType::F32;
        let path = if f32s && fits {
            input_grad_path(&shape)
        } else {
            InputGrad::Flex
        };
        if path == InputGrad::Flex {
            return flex_input_grad(weight, grad, &shape);
        }
        let (weight, grad) = (weight.to_contiguous(), grad.to_contiguous());
        let (weight, grad) = (weight.storage::<f32>(), grad.storage::<f32>());
        let dx = match path {
            InputGrad::AsConv => crate::conv::conv2d_input_grad_as_conv(weight, grad, &shape),
            _ => crate::conv::conv2d_input_grad(weight, grad, &shape),
        };
        f32_tensor(dx, input_shape.to_vec())
    }

    fn hearth_conv2d_weight_grad(
        x: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        weight_shape: [usize; 4],
        geometry: Geometry2,
    ) -> FloatTensor<Self> {
        let dims = x.shape().dims::<4>();
        let shape = conv_shape(dims, weight_shape, geometry);
        let fits = shape.output() == Some(grad.shape().dims::<4>()) && weight_shape[1] == dims[1];
        if x.dtype() != DType::F32 || grad.dtype() != DType::F32 || !fits {
            // Other precisions (and shapes Burn should refuse anyway): Burn's own gradient.
            let weight =
                FlexTensor::from_data(burn::tensor::TensorData::zeros::<f32, _>(weight_shape));
            return Flex::conv2d_weight_backward(x, weight, grad, options(geometry));
        }
        let (x, grad) = (x.to_contiguous(), grad.to_contiguous());
        let dw = conv2d_weight_grad(x.storage::<f32>(), grad.storage::<f32>(), &shape);
        f32_tensor(dw, weight_shape.to_vec())
    }

    fn hearth_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        crate::product::product(lhs, rhs)
    }
}

#[derive(Debug)]
struct ConvWithOurWeightGrad;

/// How an op's backward finds its weight: checkpointed in the graph, or by key
/// ([`crate::keyed`]: read from the values handed to the backward, its gradient handed out).
#[derive(Debug, Clone)]
enum Weight {
    Held(NodeId),
    /// The key, and the weight's shape (zeros of it stand in where its source failed).
    Keyed(u64, Vec<usize>),
}

impl Weight {
    /// The weight kept for a backward: by key where a keyed forward gave the op one and the
    /// weight trains (a frozen weight is not sharded: its module holds it anyway), else
    /// checkpointed.
    fn keep(trains: bool, shape: &[usize], checkpoint: impl FnOnce() -> NodeId) -> Self {
        match crate::keyed::take_key() {
            Some(key) if trains => Weight::Keyed(key, shape.to_vec()),
            _ => Weight::Held(checkpoint()),
        }
    }

    fn retrieve<B: Backend>(
        &self,
        checkpointer: &mut Checkpointer,
        device: &B::Device,
    ) -> B::FloatTensorPrimitive {
        match self {
            Weight::Held(node) => {
                checkpointer.retrieve_node_output::<B::FloatTensorPrimitive>(*node)
            }
            Weight::Keyed(key, shape) => {
                B::float_from_data(crate::keyed::value(*key, shape), device)
            }
        }
    }

    /// Registers the weight's gradient `dw`: on its graph node, or handed out by key.
    fn register<B: Backend>(
        &self,
        grads: &mut Gradients,
        node: NodeId,
        dw: B::FloatTensorPrimitive,
    ) {
        match self {
            Weight::Held(_) => grads.register::<B>(node, dw),
            Weight::Keyed(key, _) => match burn::tensor::try_read_sync(B::float_into_data(dw)) {
                Some(Ok(data)) => crate::keyed::put_grad(*key, data),
                // Reading a CPU tensor cannot fail; a device's failure leaves nothing to hand.
                Some(Err(e)) => {
                    panic!("hearth-kernels: reading keyed weight {key}'s gradient: {e:?}")
                }
                None => panic!(
                    "hearth-kernels: keyed weight {key}'s gradient cannot be read synchronously"
                ),
            },
        }
    }
}

impl<B: ConvBackend> Backward<B, 2> for ConvWithOurWeightGrad {
    type State = (NodeId, Weight, Geometry2);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_x, node_weight] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x_state, weight_state, geometry) = ops.state;
        let x = checkpointer.retrieve_node_output::<B::FloatTensorPrimitive>(x_state);
        let weight = weight_state.retrieve::<B>(checkpointer, &grad.device());
        if let Some(node) = node_x {
            let input_shape = x.shape().dims::<4>();
            let dx = B::hearth_conv2d_x_grad(weight.clone(), grad.clone(), input_shape, geometry);
            grads.register::<B>(node.id, dx);
        }
        if let Some(node) = node_weight {
            let weight_shape = weight.shape().dims::<4>();
            drop(weight);
            let dw = B::hearth_conv2d_weight_grad(x, grad, weight_shape, geometry);
            weight_state.register::<B>(grads, node.id, dw);
        }
    }
}

impl<B: ConvBackend, C: CheckpointStrategy> ConvBackend for Autodiff<B, C> {
    fn hearth_conv2d(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        geometry: Geometry2,
    ) -> FloatTensor<Self> {
        // A weight cut into pieces of output channels (`crate::keyed::forward_from`): its
        // module holds it empty.
        if let Some((key, pieces)) = crate::keyed::take_pieced() {
            let kernel = crate::keyed::take_kernel();
            return pieced::conv2d::<B, C>(x, weight, key, pieces, kernel, geometry);
        }
        match ConvWithOurWeightGrad
            .prepare::<C>([x.node(), weight.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let x_state = prep.checkpoint(&x);
                let shape = weight.shape().dims::<4>();
                let weight_state =
                    Weight::keep(weight.is_tracked(), &shape, || prep.checkpoint(&weight));
                prep.finish(
                    (x_state, weight_state, geometry),
                    B::hearth_conv2d(x.into_primitive(), weight.into_primitive(), geometry),
                )
            }
            OpsKind::UnTracked(prep) => prep.finish(B::hearth_conv2d(
                x.into_primitive(),
                weight.into_primitive(),
                geometry,
            )),
        }
    }

    /// Not differentiable itself (it is a backward pass): the result is a constant.
    fn hearth_conv2d_x_grad(
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        input_shape: [usize; 4],
        geometry: Geometry2,
    ) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(B::hearth_conv2d_x_grad(
            weight.into_primitive(),
            grad.into_primitive(),
            input_shape,
            geometry,
        ))
    }

    /// Not differentiable itself (it is a backward pass): the result is a constant.
    fn hearth_conv2d_weight_grad(
        x: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        weight_shape: [usize; 4],
        geometry: Geometry2,
    ) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(B::hearth_conv2d_weight_grad(
            x.into_primitive(),
            grad.into_primitive(),
            weight_shape,
            geometry,
        ))
    }

    fn hearth_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        // A weight cut into pieces (`crate::keyed::forward_from`): its module holds it empty.
        if let Some((key, pieces)) = crate::keyed::take_pieced() {
            return pieced::product::<B, C>(lhs, rhs, key, pieces);
        }
        match LinearProduct
            .prepare::<C>([lhs.node(), rhs.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                // Each operand is kept only for the other's gradient (as Burn's `linear`): a
                // frozen weight keeps no input, an input that needs no gradient no weight.
                let lhs_state = rhs.is_tracked().then(|| prep.checkpoint(&lhs));
                let shape = rhs.shape().to_vec();
                let rhs_state = lhs
                    .is_tracked()
                    .then(|| Weight::keep(rhs.is_tracked(), &shape, || prep.checkpoint(&rhs)));
                prep.finish(
                    (lhs_state, rhs_state),
                    B::hearth_matmul(lhs.into_primitive(), rhs.into_primitive()),
                )
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::hearth_matmul(lhs.into_primitive(), rhs.into_primitive()))
            }
        }
    }
}

#[derive(Debug)]
struct LinearProduct;

impl<B: ConvBackend> Backward<B, 2> for LinearProduct {
    type State = (Option<NodeId>, Option<Weight>);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_lhs, node_rhs] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let device = grad.device();
        let (lhs_state, rhs_state) = ops.state;
        let lhs =
            lhs_state.map(|s| checkpointer.retrieve_node_output::<B::FloatTensorPrimitive>(s));
        let rhs = rhs_state
            .as_ref()
            .map(|s| s.retrieve::<B>(checkpointer, &device));
        // C = A · B: dA = dC · Bᵀ, dB = Aᵀ · dC (a parent that needs its gradient had the
        // other operand kept for it).
        if let (Some(node), Some(rhs)) = (node_lhs, rhs) {
            let d = B::hearth_matmul(grad.clone(), B::float_transpose(rhs));
            grads.register::<B>(node.id, d);
        }
        if let (Some(node), Some(lhs)) = (node_rhs, lhs) {
            let d = B::hearth_matmul(B::float_transpose(lhs), grad);
            match rhs_state {
                Some(w) => w.register::<B>(grads, node.id, d),
                None => grads.register::<B>(node.id, d),
            }
        }
    }
}

/// `conv2d(x, weight)` (one group, no bias) through the extension: only for tensors on a Flex
/// device (with or without autodiff); other backends panic in Burn's dispatch, so callers check
/// the device first ([`crate::layer::fast_path`]).
pub fn conv2d_gemm_grad(x: Tensor<4>, weight: Tensor<4>, geometry: Geometry2) -> Tensor<4> {
    let out = <Dispatch as ConvBackend>::hearth_conv2d(
        x.into_dispatch(),
        weight.into_dispatch(),
        geometry,
    );
    Tensor::from_dispatch(out)
}

/// The weight gradient alone (a constant under autodiff), for tests and benches.
pub fn conv2d_weight_grad_tensor(
    x: Tensor<4>,
    grad: Tensor<4>,
    weight_shape: [usize; 4],
    geometry: Geometry2,
) -> Tensor<4> {
    let out = <Dispatch as ConvBackend>::hearth_conv2d_weight_grad(
        x.into_dispatch(),
        grad.into_dispatch(),
        weight_shape,
        geometry,
    );
    Tensor::from_dispatch(out)
}

/// `lhs · rhs` for two matrices through the extension (a linear layer's product on a cubecl
/// device, by one fixed kernel; on Flex [`crate::product::product`], its output written
/// once).
pub fn matmul2(lhs: Tensor<2>, rhs: Tensor<2>) -> Tensor<2> {
    let out = <Dispatch as ConvBackend>::hearth_matmul(lhs.into_dispatch(), rhs.into_dispatch());
    Tensor::from_dispatch(out)
}
