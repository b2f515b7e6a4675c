//! Mixed precision by the activations' float type: a convolution, a linear layer or a batch
//! norm that receives a bf16 or f16 activation computes in that type, with its f32 parameters
//! cast on the way in (the cast's backward casts the gradient back, so parameters, their
//! gradients and the optimizer state stay f32: master weights). Batch norm computes its
//! statistics in f32 and hands back the activation's type, as PyTorch's autocast lists it.
//!
//! A model runs in low precision by casting its input (and its logits back to f32 for the
//! loss); nothing else changes, and an f32 activation takes exactly the f32 paths.

use burn::nn::Linear;
use burn::prelude::*;
use burn::tensor::{DType, FloatDType};

use crate::cast;

/// The low-precision float type `x` computes in: bf16 or f16; `None` for f32 (and f64).
pub fn low_precision<const D: usize>(x: &Tensor<D>) -> Option<FloatDType> {
    match x.dtype() {
        DType::BF16 => Some(FloatDType::BF16),
        DType::F16 => Some(FloatDType::F16),
        _ => None,
    }
}

/// `linear.forward(x)` in `x`'s float type; one f32 row for inference on the CPU on all
/// threads ([`crate::gemv`]); other f32 products on Flex (training included) by
/// [`crate::product`], which holds a product's result once where Flex's holds it twice for a
/// moment (VGG-16's first classifier layer's weight gradient: 392 MiB).
pub fn linear<const D: usize>(linear: &Linear, x: Tensor<D>) -> Tensor<D> {
    crate::warm::keep_pool_warm(&x.device());
    // A weight cut into pieces (ZeRO stage 3, `crate::keyed::forward_from`): its module holds
    // it empty, and only the extension's product fetches it.
    if crate::keyed::is_pieced(linear.weight.id.val()) && low_precision(&x).is_none() {
        return selected_linear(linear, x);
    }
    if crate::base::selects_gpu_kernels(&x.device(), crate::base::enabled()) {
        return selected_linear(linear, x);
    }
    match low_precision(&x) {
        None => match crate::gemv::one_row(&x, &linear.weight.val()) {
            Some(y) => match &linear.bias {
                Some(b) => y + b.val().unsqueeze::<D>(),
                None => y,
            },
            None if crate::base::is_flex(&x.device()) && crate::base::enabled() => {
                selected_linear(linear, x)
            }
            None => linear.forward(x),
        },
        // On Flex, in f32 on the values rounded to the low type, the result rounded to it (as
        // `crate::layer::conv2d`): its f32 product is the fast one.
        Some(dt) if crate::base::is_flex(&x.device()) && crate::base::enabled() => {
            let f32 = FloatDType::F32;
            let y = burn::tensor::module::linear(
                cast(x, f32),
                cast(cast(linear.weight.val(), dt), f32),
                linear.bias.as_ref().map(|b| cast(cast(b.val(), dt), f32)),
            );
            cast(y, dt)
        }
        Some(dt) => burn::tensor::module::linear(
            x,
            linear.weight.val().cast(dt),
            linear.bias.as_ref().map(|b| b.val().cast(dt)),
        ),
    }
}

/// A linear layer by the extension's product [`crate::ext::matmul2`] (on a cubecl device its
/// fixed kernel, never autotuned; on Flex [`crate::product`]), in `x`'s float type: the rows
/// of `x` flattened into one matrix.
fn selected_linear<const D: usize>(linear: &Linear, x: Tensor<D>) -> Tensor<D> {
    let dims = x.dims();
    let inputs = dims[D - 1];
    let rows = dims[..D - 1].iter().product::<usize>();
    let weight = linear.weight.val();
    let outputs = crate::keyed::pieced_cols(linear.weight.id.val()).unwrap_or(weight.dims()[1]);
    let low = low_precision(&x);
    let x = x.reshape([rows, inputs]);
    let key = linear.weight.id.val();
    let y = match low {
        Some(dt) => crate::ext::matmul2(x, weight.cast(dt)),
        // A weight cut into pieces without a graph (ZeRO stage 3's validation): nothing kept.
        None if !x.device().is_autodiff() && crate::keyed::is_pieced(key) => {
            pieced_product_without_graph(x, key)
        }
        // The module's own weight, which the product may keep by key (`crate::keyed`).
        None => crate::keyed::with_key(key, || crate::ext::matmul2(x, weight)),
    };
    let bias = match low {
        Some(dt) => linear.bias.as_ref().map(|b| b.val().cast(dt)),
        None => linear.bias.as_ref().map(|b| b.val()),
    };
    let y = match bias {
        Some(b) => y + b.unsqueeze::<2>(),
        None => y,
    };
    let mut out = dims;
    out[D - 1] = outputs;
    y.reshape(out)
}

/// `x · W` for weight `key` cut into pieces of rows by the forward under way, on a device
/// without autodiff: the sum of `x[:, rows] · W[rows]`, each piece fetched from the pass's
/// source and let go after its product (the graph's version is the extension's
/// `ext/pieced.rs`, which keeps what its backward needs).
fn pieced_product_without_graph(x: Tensor<2>, key: u64) -> Tensor<2> {
    let Some(pieces) = crate::keyed::pieces_of(key) else {
        panic!("hearth-kernels: weight {key} is not cut into pieces by the forward under way");
    };
    let [n, inputs] = x.dims();
    pieces.check_product(key, inputs);
    let device = x.device();
    let mut y: Option<Tensor<2>> = None;
    for (k, rows) in pieces.rows.iter().enumerate() {
        let values = crate::keyed::piece_value(key, k, rows.len(), pieces.cols);
        let w = Tensor::<2>::from_data(values, &device);
        let part = crate::ext::matmul2(x.clone().slice([0..n, rows.clone()]), w);
        y = Some(match y {
            Some(y) => y + part,
            None => part,
        });
    }
    y.unwrap_or_else(|| Tensor::zeros([n, pieces.cols], &device))
}
