//! The extension's ops on a weight cut into pieces of rows (`crate::keyed::forward_from`,
//! ZeRO stage 3): a linear layer's product and a convolution, each taking its weight a piece
//! at a time, fetched as it is needed and let go after it, in the forward and again in the
//! backward, where each piece's gradient is handed out before the next piece is fetched. The
//! graph keeps the input and the weight's key, never the weight: the module's empty stand-in
//! for it is a parent only so that the op is tracked where the weight trains and the input
//! does not (its gradient is handed out by piece, not registered).

use std::ops::Range;

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, TensorMetadata};
use burn::prelude::Shape;
use burn::tensor::{Slice, TensorData};

use crate::keyed::Pieces;
use crate::weight_grad::Geometry2;

/// The ops these pieces run, one piece at a time: the extension's own (`super::ConvBackend`
/// provides them for every backend it covers), named here so that this module does not reach
/// back to the one that calls it.
pub(super) trait PieceOps: Backend {
    fn conv(
        x: Self::FloatTensorPrimitive,
        weight: Self::FloatTensorPrimitive,
        geometry: Geometry2,
    ) -> Self::FloatTensorPrimitive;
    fn conv_x_grad(
        weight: Self::FloatTensorPrimitive,
        grad: Self::FloatTensorPrimitive,
        input_shape: [usize; 4],
        geometry: Geometry2,
    ) -> Self::FloatTensorPrimitive;
    fn conv_weight_grad(
        x: Self::FloatTensorPrimitive,
        grad: Self::FloatTensorPrimitive,
        weight_shape: [usize; 4],
        geometry: Geometry2,
    ) -> Self::FloatTensorPrimitive;
    fn matmul(
        lhs: Self::FloatTensorPrimitive,
        rhs: Self::FloatTensorPrimitive,
    ) -> Self::FloatTensorPrimitive;
}

/// `x · W` for a weight `W` cut into pieces of rows: the sum of `x[:, rows] · W[rows]`.
pub(super) fn product<B: PieceOps, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    empty: FloatTensor<Autodiff<B, C>>,
    key: u64,
    pieces: Pieces,
) -> FloatTensor<Autodiff<B, C>> {
    let parents = [x.node(), empty.node()];
    drop(empty);
    match PiecedProduct
        .prepare::<C>(parents)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let x_state = prep.checkpoint(&x);
            let y = product_forward::<B>(x.into_primitive(), key, &pieces);
            prep.finish((x_state, key, pieces), y)
        }
        OpsKind::UnTracked(prep) => {
            prep.finish(product_forward::<B>(x.into_primitive(), key, &pieces))
        }
    }
}

/// `conv2d(x, W)` (one group, no bias) for a weight `W` of shape `[out, in, kh, kw]` cut into
/// pieces of output channels (rows of `in·kh·kw` values): each piece's output channels from it
/// alone, joined. `kernel` is `[kh, kw]` (`crate::keyed::with_conv_key`); `in` is `x`'s
/// channels.
pub(super) fn conv2d<B: PieceOps, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    empty: FloatTensor<Autodiff<B, C>>,
    key: u64,
    pieces: Pieces,
    kernel: Option<[usize; 2]>,
    geometry: Geometry2,
) -> FloatTensor<Autodiff<B, C>> {
    let Some([kh, kw]) = kernel else {
        panic!(
            "hearth-kernels: weight {key} is cut into pieces, and its convolution was called \
             without its kernel's size (only `hearth_kernels::conv2d` takes such a weight)"
        );
    };
    let inputs = x.shape().dims::<4>()[1];
    pieces.check_conv(key, inputs, [kh, kw]);
    let kernel = [inputs, kh, kw];
    let parents = [x.node(), empty.node()];
    drop(empty);
    match PiecedConv.prepare::<C>(parents).compute_bound().stateful() {
        OpsKind::Tracked(mut prep) => {
            let x_state = prep.checkpoint(&x);
            let y = conv_forward::<B>(x.into_primitive(), key, &pieces, kernel, geometry);
            prep.finish((x_state, key, pieces, kernel, geometry), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(conv_forward::<B>(
            x.into_primitive(),
            key,
            &pieces,
            kernel,
            geometry,
        )),
    }
}

/// Range `range` of dimension `dim` of `x`, the other dimensions whole.
fn along<B: Backend>(
    x: B::FloatTensorPrimitive,
    dim: usize,
    range: &Range<usize>,
) -> B::FloatTensorPrimitive {
    let dims = x.shape().to_vec();
    let slices: Vec<Slice> = dims
        .iter()
        .enumerate()
        .map(|(d, &n)| match d == dim {
            true => Slice::new(range.start as isize, Some(range.end as isize), 1),
            false => Slice::new(0, Some(n as isize), 1),
        })
        .collect();
    B::float_slice(x, &slices)
}

/// Piece `k` (rows `rows`) of weight `key` from the pass's source: a matrix, or with
/// `kernel` (`[in, kh, kw]`) a convolution's weight of the piece's output channels.
fn piece<B: Backend>(
    key: u64,
    k: usize,
    rows: &Range<usize>,
    pieces: &Pieces,
    kernel: Option<[usize; 3]>,
    device: &B::Device,
) -> B::FloatTensorPrimitive {
    let w = crate::keyed::piece_value(key, k, rows.len(), pieces.cols);
    let w = B::float_from_data(w, device);
    match kernel {
        Some([i, kh, kw]) => B::float_reshape(w, Shape::new([rows.len(), i, kh, kw])),
        None => w,
    }
}

/// Hands piece `k` of weight `key`'s gradient `grad` (`[rows, cols]` values) to the backward's
/// source.
fn hand_piece_grad<B: Backend>(key: u64, k: usize, grad: B::FloatTensorPrimitive) {
    match burn::tensor::try_read_sync(B::float_into_data(grad)) {
        Some(Ok(data)) => crate::keyed::put_piece_grad(key, k, data),
        // Reading a CPU tensor cannot fail; a device's failure leaves nothing to hand.
        Some(Err(e)) => {
            panic!("hearth-kernels: reading piece {k} of weight {key}'s gradient: {e:?}")
        }
        None => panic!(
            "hearth-kernels: piece {k} of weight {key}'s gradient cannot be read synchronously"
        ),
    }
}

fn product_forward<B: PieceOps>(
    x: B::FloatTensorPrimitive,
    key: u64,
    pieces: &Pieces,
) -> B::FloatTensorPrimitive {
    let [n, inputs] = x.shape().dims::<2>();
    pieces.check_product(key, inputs);
    let device = x.device();
    let mut y: Option<B::FloatTensorPrimitive> = None;
    for (k, rows) in pieces.rows.iter().enumerate() {
        let w = piece::<B>(key, k, rows, pieces, None, &device);
        let part = B::matmul(along::<B>(x.clone(), 1, rows), w);
        y = Some(match y {
            Some(y) => B::float_add(y, part),
            None => part,
        });
    }
    y.unwrap_or_else(|| B::float_from_data(TensorData::zeros::<f32, _>([n, pieces.cols]), &device))
}

fn conv_forward<B: PieceOps>(
    x: B::FloatTensorPrimitive,
    key: u64,
    pieces: &Pieces,
    kernel: [usize; 3],
    geometry: Geometry2,
) -> B::FloatTensorPrimitive {
    let device = x.device();
    let parts: Vec<_> = pieces
        .rows
        .iter()
        .enumerate()
        .map(|(k, rows)| {
            let w = piece::<B>(key, k, rows, pieces, Some(kernel), &device);
            B::conv(x.clone(), w, geometry)
        })
        .collect();
    B::float_cat(parts, 1)
}

#[derive(Debug)]
struct PiecedProduct;

impl<B: PieceOps> Backward<B, 2> for PiecedProduct {
    type State = (NodeId, u64, Pieces);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_x, _] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let device = grad.device();
        let (x_state, key, pieces) = ops.state;
        let x = checkpointer.retrieve_node_output::<B::FloatTensorPrimitive>(x_state);
        // Y = Σ X[:, r] · W[r]: dX[:, r] = dY · W[r]ᵀ, dW[r] = X[:, r]ᵀ · dY.
        let mut dx = Vec::with_capacity(pieces.rows.len());
        for (k, rows) in pieces.rows.iter().enumerate() {
            let w = piece::<B>(key, k, rows, &pieces, None, &device);
            if node_x.is_some() {
                dx.push(B::matmul(grad.clone(), B::float_transpose(w)));
            }
            let xk = along::<B>(x.clone(), 1, rows);
            hand_piece_grad::<B>(key, k, B::matmul(B::float_transpose(xk), grad.clone()));
        }
        if let Some(node) = node_x {
            grads.register::<B>(node.id, B::float_cat(dx, 1));
        }
    }
}

#[derive(Debug)]
struct PiecedConv;

impl<B: PieceOps> Backward<B, 2> for PiecedConv {
    type State = (NodeId, u64, Pieces, [usize; 3], Geometry2);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_x, _] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let device = grad.device();
        let (x_state, key, pieces, kernel, geometry) = ops.state;
        let x = checkpointer.retrieve_node_output::<B::FloatTensorPrimitive>(x_state);
        let input_shape = x.shape().dims::<4>();
        // Y[:, r] = conv(X, W[r]): dX = Σ conv_x_grad(W[r], dY[:, r]), dW[r] =
        // conv_weight_grad(X, dY[:, r]).
        let mut dx: Option<B::FloatTensorPrimitive> = None;
        for (k, rows) in pieces.rows.iter().enumerate() {
            let w = piece::<B>(key, k, rows, &pieces, Some(kernel), &device);
            let dy = along::<B>(grad.clone(), 1, rows);
            if node_x.is_some() {
                let part = B::conv_x_grad(w, dy.clone(), input_shape, geometry);
                dx = Some(match dx {
                    Some(d) => B::float_add(d, part),
                    None => part,
                });
            }
            let [i, kh, kw] = kernel;
            let dw = B::conv_weight_grad(x.clone(), dy, [rows.len(), i, kh, kw], geometry);
            let dw = B::float_reshape(dw, Shape::new([rows.len(), pieces.cols]));
            hand_piece_grad::<B>(key, k, dw);
        }
        if let (Some(node), Some(dx)) = (node_x, dx) {
            grads.register::<B>(node.id, dx);
        }
    }
}
