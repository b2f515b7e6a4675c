//! A convolution, its batch norm and what follows them (ReLU, or a residual added and ReLU)
//! as one op for inference on Flex: [`conv2d_batch_norm`]. The batch norm's running statistics,
//! the residual and the ReLU are applied to each piece of the convolution's output as soon as
//! the kernel computes it (`epilogue.rs`), where ResNet's inference made three more
//! passes over each output: batch norm, the residual sum and ReLU.
//!
//! The results are those of the separate ops (the same arithmetic in the same order). While
//! training, on other backends, in bf16/f16, with a bias or a weight ZeRO stage 3 holds in
//! pieces, [`conv2d_batch_norm`] is the separate ops.

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::ops::{ActivationOps, FloatTensorOps};
use burn::backend::tensor::FloatTensor;
use burn::backend::{
    Autodiff, AutodiffBackend, Backend, Dispatch, Flex, TensorMetadata, backend_extension,
};
use burn::nn::BatchNorm;
use burn::nn::conv::Conv2d;
use burn::prelude::*;
use burn::tensor::DType;
use burn_flex::FlexTensor;

use crate::base::{enabled, f32_tensor, is_flex, symmetric};
use crate::epilogue::Epilogue;
use crate::ext::{ConvBackend, Geometry2};
use crate::layer::{Path, fast_path};
use crate::norm::NormBackend;
use crate::precision::low_precision;
use crate::weight_grad::conv_shape;

/// What follows a convolution's batch norm in [`conv2d_batch_norm`]. (Taken by value once per
/// layer, so the residual's tensor is not boxed.)
#[allow(clippy::large_enum_variant)]
pub enum After {
    /// Nothing: the batch norm's output.
    Nothing,
    /// ReLU.
    Relu,
    /// A residual (the output's shape) added, then ReLU: a residual block's end.
    AddRelu(Tensor<4>),
}

/// `bn(conv(x))`, then what `after` says: one op and one pass over the output where
/// [`folds`] (inference on Flex), else the separate ops ([`crate::conv2d`],
/// [`crate::norm::batch_norm`], a sum and ReLU), whose results it equals.
pub fn conv2d_batch_norm(conv: &Conv2d, bn: &BatchNorm, x: Tensor<4>, after: After) -> Tensor<4> {
    if !folds(conv, &x) {
        let relu = matches!(after, After::Relu);
        let y = crate::norm::batch_norm(bn, crate::conv2d(conv, x), relu);
        return match after {
            After::AddRelu(residual) => burn::tensor::activation::relu(y + residual),
            _ => y,
        };
    }
    crate::warm::keep_pool_warm(&x.device());
    crate::winograd::cache::inference(|| folded(conv, bn, x, after))
}

/// [`conv2d_batch_norm`]'s one op, where it [`folds`].
fn folded(conv: &Conv2d, bn: &BatchNorm, x: Tensor<4>, after: After) -> Tensor<4> {
    let device = x.device();
    let padding = symmetric(&conv.padding).unwrap_or([0, 0]);
    let geometry = [conv.stride, padding, conv.dilation];
    let [gamma, beta] = [&bn.gamma, &bn.beta].map(|p| p.val().into_dispatch());
    let [mean, var] =
        [&bn.running_mean, &bn.running_var].map(|p| p.value().to_device(&device).into_dispatch());
    let (x, w) = (x.into_dispatch(), conv.weight.val().into_dispatch());
    let y = match after {
        After::AddRelu(residual) => <Dispatch as InferBackend>::hearth_conv2d_batch_norm_add_relu(
            x,
            w,
            geometry,
            gamma,
            beta,
            mean,
            var,
            bn.epsilon,
            residual.into_dispatch(),
        ),
        after => <Dispatch as InferBackend>::hearth_conv2d_batch_norm(
            x,
            w,
            geometry,
            gamma,
            beta,
            mean,
            var,
            bn.epsilon,
            matches!(after, After::Relu),
        ),
    };
    Tensor::from_dispatch(y)
}

/// Whether [`conv2d_batch_norm`] takes the one op: f32 inference (no autodiff) on Flex with the
/// fast kernels on, a convolution of ours ([`Path::Gemm`]) without a bias, whose weight the
/// module holds whole and no keyed pass is under way ([`crate::keyed`]).
pub fn folds(conv: &Conv2d, x: &Tensor<4>) -> bool {
    let device = x.device();
    enabled()
        && is_flex(&device)
        && !device.is_autodiff()
        && low_precision(x).is_none()
        && conv.bias.is_none()
        && fast_path(conv, &device, true) == Path::Gemm
        && !crate::keyed::is_pieced(conv.weight.id.val())
        && !crate::keyed::keying()
}

/// The extension: a convolution (one group, no bias) with batch norm by given statistics, then
/// ReLU, or a residual and ReLU. For inference: not differentiable (a constant under
/// autodiff), so [`conv2d_batch_norm`] takes it only without autodiff.
#[backend_extension(Flex, Autodiff)]
pub trait InferBackend: Backend {
    /// `bn(conv2d(x, weight))`, then ReLU when `relu`.
    #[allow(clippy::too_many_arguments)]
    fn hearth_conv2d_batch_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        geometry: Geometry2,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        variance: FloatTensor<Self>,
        epsilon: f64,
        relu: bool,
    ) -> FloatTensor<Self>;

    /// `relu(bn(conv2d(x, weight)) + residual)`.
    #[allow(clippy::too_many_arguments)]
    fn hearth_conv2d_batch_norm_add_relu(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        geometry: Geometry2,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        variance: FloatTensor<Self>,
        epsilon: f64,
        residual: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

/// The values of an f32 tensor, contiguous; `None` for another type.
fn f32s(t: FlexTensor) -> Option<FlexTensor> {
    (t.dtype() == DType::F32).then(|| t.to_contiguous())
}

/// The one pass on Flex, or `None` (nothing computed) where a tensor is not f32 or the
/// shapes do not fit, for the caller to take the separate ops.
#[allow(clippy::too_many_arguments)]
fn flex_fused(
    x: &FlexTensor,
    weight: &FlexTensor,
    geometry: Geometry2,
    stats: [&FlexTensor; 4],
    epsilon: f64,
    residual: Option<&FlexTensor>,
    relu: bool,
) -> Option<FlexTensor> {
    let weight_shape = weight.shape().dims::<4>();
    let shape = conv_shape(x.shape().dims::<4>(), weight_shape, geometry);
    let out = shape.output()?;
    let co = weight_shape[0];
    let fits = weight_shape[1] == shape.input[1]
        && stats.iter().all(|s| s.shape().to_vec() == [co])
        && residual.is_none_or(|r| r.shape().to_vec() == out);
    if !fits {
        return None;
    }
    let x = f32s(x.clone())?;
    // Read through `winograd::cache`, which knows the weight by its own storage and view.
    (weight.dtype() == DType::F32).then_some(())?;
    let [gamma, beta, mean, var] = stats.map(|s| f32s(s.clone()));
    let (gamma, beta, mean, var) = (gamma?, beta?, mean?, var?);
    let residual = match residual {
        Some(r) => Some(f32s(r.clone())?),
        None => None,
    };
    let (scale, shift) = crate::epilogue::affine(
        gamma.storage::<f32>(),
        beta.storage::<f32>(),
        mean.storage::<f32>(),
        var.storage::<f32>(),
        epsilon,
    );
    let epi = Epilogue {
        scale: &scale,
        shift: &shift,
        residual: residual.as_ref().map(|r| r.storage::<f32>()),
        relu,
    };
    let y = crate::winograd::cache::forward(&x, weight, &shape, Some(&epi));
    Some(f32_tensor(y, out.to_vec()))
}

/// The op on Flex: [`flex_fused`], or where it declines, the separate ops (our convolution,
/// batch norm's inference pass, then the residual's sum and ReLU).
#[allow(clippy::too_many_arguments)]
fn on_flex(
    x: FlexTensor,
    weight: FlexTensor,
    geometry: Geometry2,
    [gamma, beta, mean, variance]: [FlexTensor; 4],
    epsilon: f64,
    residual: Option<FlexTensor>,
    relu: bool,
) -> FlexTensor {
    let stats = [&gamma, &beta, &mean, &variance];
    if let Some(y) = flex_fused(
        &x,
        &weight,
        geometry,
        stats,
        epsilon,
        residual.as_ref(),
        relu,
    ) {
        return y;
    }
    let y = <Flex as ConvBackend>::hearth_conv2d(x, weight, geometry);
    let relu_here = relu && residual.is_none();
    let y = <Flex as NormBackend>::hearth_batch_norm_inference(
        y, gamma, beta, mean, variance, epsilon, relu_here,
    );
    match residual {
        Some(r) if relu => Flex::relu(Flex::float_add(y, r)),
        Some(r) => Flex::float_add(y, r),
        None => y,
    }
}

impl InferBackend for Flex {
    fn hearth_conv2d_batch_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        geometry: Geometry2,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        variance: FloatTensor<Self>,
        epsilon: f64,
        relu: bool,
    ) -> FloatTensor<Self> {
        let stats = [gamma, beta, mean, variance];
        on_flex(x, weight, geometry, stats, epsilon, None, relu)
    }

    fn hearth_conv2d_batch_norm_add_relu(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        geometry: Geometry2,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        variance: FloatTensor<Self>,
        epsilon: f64,
        residual: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let stats = [gamma, beta, mean, variance];
        on_flex(x, weight, geometry, stats, epsilon, Some(residual), true)
    }
}

impl<B: InferBackend, C: CheckpointStrategy> InferBackend for Autodiff<B, C> {
    /// Not differentiable: the result is a constant.
    fn hearth_conv2d_batch_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        geometry: Geometry2,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        variance: FloatTensor<Self>,
        epsilon: f64,
        relu: bool,
    ) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(B::hearth_conv2d_batch_norm(
            x.into_primitive(),
            weight.into_primitive(),
            geometry,
            gamma.into_primitive(),
            beta.into_primitive(),
            mean.into_primitive(),
            variance.into_primitive(),
            epsilon,
            relu,
        ))
    }

    /// Not differentiable: the result is a constant.
    fn hearth_conv2d_batch_norm_add_relu(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        geometry: Geometry2,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        variance: FloatTensor<Self>,
        epsilon: f64,
        residual: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(B::hearth_conv2d_batch_norm_add_relu(
            x.into_primitive(),
            weight.into_primitive(),
            geometry,
            gamma.into_primitive(),
            beta.into_primitive(),
            mean.into_primitive(),
            variance.into_primitive(),
            epsilon,
            residual.into_primitive(),
        ))
    }
}

#[cfg(test)]
mod tests;
