//! Batch normalization with the batch's statistics (and ReLU) as a Burn backend extension op
//! whose forward and backward are [`crate::batch_norm`]'s few-pass kernels on Flex, with a
//! handwritten autodiff backward; and [`batch_norm`], the `BatchNorm` module's forward that
//! takes it while training on a Flex device (running statistics updated as Burn does).

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{
    Autodiff, AutodiffBackend, Backend, Dispatch, Flex, TensorMetadata, backend_extension,
};
use burn::nn::BatchNorm;
use burn::prelude::*;
use burn::tensor::DType;
use burn_flex::FlexTensor;

use crate::base::f32_tensor;

/// The extension: training-mode batch norm (optionally with ReLU) and its backward.
#[backend_extension(Flex, Autodiff)]
pub trait NormBackend: Backend {
    /// `(output, mean, biased variance)`; mean and variance are constants under autodiff.
    fn hearth_batch_norm_train(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        relu: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// [`Self::hearth_batch_norm_train`] of an input whose first `known_mean.len()` channels
    /// are an earlier input's, with that input's batch statistics (constants): the same
    /// results, those channels' statistics not computed again.
    #[allow(clippy::too_many_arguments)]
    fn hearth_batch_norm_train_after(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        known_mean: FloatTensor<Self>,
        known_var: FloatTensor<Self>,
        epsilon: f64,
        relu: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// Batch norm with the given (running) statistics, then ReLU when `relu`, in one pass: for
    /// inference. Not differentiable: under autodiff the result is a constant, so
    /// [`batch_norm`] takes it only on devices without autodiff.
    #[allow(clippy::too_many_arguments)]
    fn hearth_batch_norm_inference(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        variance: FloatTensor<Self>,
        epsilon: f64,
        relu: bool,
    ) -> FloatTensor<Self>;

    /// `(dx, dγ, dβ)` of that op for the output gradient `grad`.
    #[allow(clippy::too_many_arguments)]
    fn hearth_batch_norm_train_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        variance: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        epsilon: f64,
        relu: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

/// `[N, C, S]` of a tensor with at least two axes.
fn ncs(t: &FlexTensor) -> [usize; 3] {
    let dims = t.shape().to_vec();
    let s = dims[2..].iter().product();
    [dims[0], dims[1], s]
}

fn f32_values(t: FlexTensor) -> FlexTensor {
    let t = if t.dtype() == DType::F32 {
        t
    } else {
        Flex::float_cast(t, burn::tensor::FloatDType::F32)
    };
    t.to_contiguous()
}

/// `(activation-shaped, per-channel, per-channel)` tensors from f32 values, in `dtype`.
fn outputs(
    [a, b, c]: [Vec<f32>; 3],
    dims: Vec<usize>,
    dtype: DType,
) -> (FlexTensor, FlexTensor, FlexTensor) {
    let channels = vec![dims[1]];
    let back = |t: FlexTensor| {
        if dtype == DType::F32 {
            t
        } else {
            Flex::float_cast(t, dtype.into())
        }
    };
    (
        back(f32_tensor(a, dims)),
        back(f32_tensor(b, channels.clone())),
        back(f32_tensor(c, channels)),
    )
}

/// Flex's training batch norm, the statistics of the channels in `known` given.
fn flex_train(
    x: FlexTensor,
    gamma: FlexTensor,
    beta: FlexTensor,
    known: Option<[FlexTensor; 2]>,
    epsilon: f64,
    relu: bool,
) -> (FlexTensor, FlexTensor, FlexTensor) {
    let dtype = x.dtype();
    let dims = x.shape().to_vec();
    let shape = ncs(&x);
    let (x, gamma, beta) = (f32_values(x), f32_values(gamma), f32_values(beta));
    let known = known.map(|k| k.map(f32_values));
    let known_values: [&[f32]; 2] = match &known {
        Some([m, v]) => [m.storage::<f32>(), v.storage::<f32>()],
        None => [&[], &[]],
    };
    let (y, mean, var) = crate::batch_norm::forward_after(
        x.storage::<f32>(),
        shape,
        gamma.storage::<f32>(),
        beta.storage::<f32>(),
        known_values,
        epsilon,
        relu,
    );
    outputs([y, mean, var], dims, dtype)
}

impl NormBackend for Flex {
    fn hearth_batch_norm_train(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        relu: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        flex_train(x, gamma, beta, None, epsilon, relu)
    }

    fn hearth_batch_norm_train_after(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        known_mean: FloatTensor<Self>,
        known_var: FloatTensor<Self>,
        epsilon: f64,
        relu: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        flex_train(x, gamma, beta, Some([known_mean, known_var]), epsilon, relu)
    }

    fn hearth_batch_norm_inference(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        variance: FloatTensor<Self>,
        epsilon: f64,
        relu: bool,
    ) -> FloatTensor<Self> {
        let dtype = x.dtype();
        let dims = x.shape().to_vec();
        let shape = ncs(&x);
        let [x, gamma, beta, mean, variance] = [x, gamma, beta, mean, variance].map(f32_values);
        let y = crate::batch_norm::inference(
            x.storage::<f32>(),
            shape,
            [gamma, beta, mean, variance]
                .each_ref()
                .map(|t| t.storage::<f32>()),
            epsilon,
            relu,
        );
        let y = f32_tensor(y, dims);
        if dtype == DType::F32 {
            y
        } else {
            Flex::float_cast(y, dtype.into())
        }
    }

    fn hearth_batch_norm_train_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        variance: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        epsilon: f64,
        relu: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let dtype = x.dtype();
        let dims = x.shape().to_vec();
        let shape = ncs(&x);
        let [x, gamma, beta, mean, variance, grad] =
            [x, gamma, beta, mean, variance, grad].map(f32_values);
        let (dx, dgamma, dbeta) = crate::batch_norm::backward(
            x.storage::<f32>(),
            shape,
            gamma.storage::<f32>(),
            beta.storage::<f32>(),
            mean.storage::<f32>(),
            variance.storage::<f32>(),
            epsilon,
            relu,
            grad.storage::<f32>(),
        );
        outputs([dx, dgamma, dbeta], dims, dtype)
    }
}

#[derive(Debug)]
struct BatchNormTrainOp;

/// What the backward needs: the checkpointed x, γ and β, the batch statistics, ε and ReLU.
type NormState<P> = (NodeId, NodeId, NodeId, P, P, f64, bool);

impl<B: NormBackend> Backward<B, 3> for BatchNormTrainOp {
    type State = NormState<B::FloatTensorPrimitive>;

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_x, node_gamma, node_beta] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, gamma, beta, mean, variance, epsilon, relu) = ops.state;
        let x = checkpointer.retrieve_node_output::<B::FloatTensorPrimitive>(x);
        let gamma = checkpointer.retrieve_node_output::<B::FloatTensorPrimitive>(gamma);
        let beta = checkpointer.retrieve_node_output::<B::FloatTensorPrimitive>(beta);
        let (dx, dgamma, dbeta) = B::hearth_batch_norm_train_backward(
            x, gamma, beta, mean, variance, grad, epsilon, relu,
        );
        for (node, g) in [(node_x, dx), (node_gamma, dgamma), (node_beta, dbeta)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, g);
            }
        }
    }
}

/// A training batch norm's `(output, mean, variance)` on backend `B`.
type Trained<B> = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>);

/// A training batch norm under autodiff: `inner` computes it, [`BatchNormTrainOp`] is its
/// backward (with or without known statistics: the statistics it is given back are the
/// batch's either way).
fn autodiff_train<B: NormBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    gamma: FloatTensor<Autodiff<B, C>>,
    beta: FloatTensor<Autodiff<B, C>>,
    epsilon: f64,
    relu: bool,
    inner: impl FnOnce(FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) -> Trained<B>,
) -> Trained<Autodiff<B, C>> {
    let constant = <Autodiff<B, C> as AutodiffBackend>::from_inner;
    match BatchNormTrainOp
        .prepare::<C>([x.node(), gamma.node(), beta.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let (xs, gs, bs) = (
                prep.checkpoint(&x),
                prep.checkpoint(&gamma),
                prep.checkpoint(&beta),
            );
            let (y, mean, var) = inner(
                x.into_primitive(),
                gamma.into_primitive(),
                beta.into_primitive(),
            );
            let state = (xs, gs, bs, mean.clone(), var.clone(), epsilon, relu);
            (prep.finish(state, y), constant(mean), constant(var))
        }
        OpsKind::UnTracked(prep) => {
            let (y, mean, var) = inner(
                x.into_primitive(),
                gamma.into_primitive(),
                beta.into_primitive(),
            );
            (prep.finish(y), constant(mean), constant(var))
        }
    }
}

impl<B: NormBackend, C: CheckpointStrategy> NormBackend for Autodiff<B, C> {
    fn hearth_batch_norm_train(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        relu: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        autodiff_train::<B, C>(x, gamma, beta, epsilon, relu, move |x, g, b| {
            B::hearth_batch_norm_train(x, g, b, epsilon, relu)
        })
    }

    /// The known statistics are constants: no gradient flows into them.
    fn hearth_batch_norm_train_after(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        known_mean: FloatTensor<Self>,
        known_var: FloatTensor<Self>,
        epsilon: f64,
        relu: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (m, v) = (known_mean.into_primitive(), known_var.into_primitive());
        autodiff_train::<B, C>(x, gamma, beta, epsilon, relu, move |x, g, b| {
            B::hearth_batch_norm_train_after(x, g, b, m, v, epsilon, relu)
        })
    }

    /// Not differentiable: the result is a constant ([`batch_norm`] calls it only without
    /// autodiff).
    fn hearth_batch_norm_inference(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        variance: FloatTensor<Self>,
        epsilon: f64,
        relu: bool,
    ) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(B::hearth_batch_norm_inference(
            x.into_primitive(),
            gamma.into_primitive(),
            beta.into_primitive(),
            mean.into_primitive(),
            variance.into_primitive(),
            epsilon,
            relu,
        ))
    }

    /// A backward pass: not differentiable itself, the results are constants.
    fn hearth_batch_norm_train_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        variance: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        epsilon: f64,
        relu: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let constant = <Self as AutodiffBackend>::from_inner;
        let (dx, dg, db) = B::hearth_batch_norm_train_backward(
            x.into_primitive(),
            gamma.into_primitive(),
            beta.into_primitive(),
            mean.into_primitive(),
            variance.into_primitive(),
            grad.into_primitive(),
            epsilon,
            relu,
        );
        (constant(dx), constant(dg), constant(db))
    }
}

/// The extension op on tensors: `(output, mean, variance)`. Only for Flex devices (Burn's
/// dispatch panics on others; callers check with [`crate::base::is_flex`]).
pub fn batch_norm_train<const D: usize>(
    x: Tensor<D>,
    gamma: Tensor<1>,
    beta: Tensor<1>,
    epsilon: f64,
    relu: bool,
) -> (Tensor<D>, Tensor<1>, Tensor<1>) {
    let (y, mean, var) = <Dispatch as NormBackend>::hearth_batch_norm_train(
        x.into_dispatch(),
        gamma.into_dispatch(),
        beta.into_dispatch(),
        epsilon,
        relu,
    );
    (
        Tensor::from_dispatch(y),
        Tensor::from_dispatch(mean),
        Tensor::from_dispatch(var),
    )
}

/// The batch statistics of a training batch norm's input, per channel, detached: what a later
/// batch norm over the same channels and more may take instead of computing them again
/// ([`batch_norm_after`]).
#[derive(Debug, Clone)]
pub struct BatchStats {
    pub mean: Tensor<1>,
    pub var: Tensor<1>,
}

/// [`batch_norm`] of an input whose first channels hold the same values as the input of the
/// batch norm that returned `known` (DenseNet: each layer's input is the one before's with its
/// new channels after it), those channels' statistics taken from `known` rather than
/// computed again: the same output, gradients and running statistics, bit for bit (a
/// channel's statistics depend only on its values). Returns the statistics of all of `x`'s
/// channels for the next such batch norm when it took the fused training path, `None`
/// otherwise (inference, other devices, low precision, recomputation), where `known` is not
/// needed either.
pub fn batch_norm_after<const D: usize>(
    bn: &BatchNorm,
    x: Tensor<D>,
    relu: bool,
    known: Option<&BatchStats>,
) -> (Tensor<D>, Option<BatchStats>) {
    let device = x.device();
    let fused = device.is_autodiff()
        && bn.training.is_enabled()
        && !is_replaying()
        && crate::low_precision(&x).is_none()
        && crate::base::enabled()
        && crate::base::is_flex(&device);
    if !fused {
        return (batch_norm(bn, x, relu), None);
    }
    let channels = x.dims()[1];
    let known = known.filter(|k| {
        let n = k.mean.dims()[0];
        n > 0 && n <= channels && k.var.dims()[0] == n
    });
    let (y, mean, var) = match known {
        Some(k) => {
            let (y, mean, var) = <Dispatch as NormBackend>::hearth_batch_norm_train_after(
                x.into_dispatch(),
                bn.gamma.val().into_dispatch(),
                bn.beta.val().into_dispatch(),
                k.mean.clone().into_dispatch(),
                k.var.clone().into_dispatch(),
                bn.epsilon,
                relu,
            );
            (
                Tensor::from_dispatch(y),
                Tensor::from_dispatch(mean),
                Tensor::from_dispatch(var),
            )
        }
        None => batch_norm_train(x, bn.gamma.val(), bn.beta.val(), bn.epsilon, relu),
    };
    update_running(bn, &mean, &var, &device);
    let stats = BatchStats {
        mean: mean.detach(),
        var: var.detach(),
    };
    (y, Some(stats))
}

/// Moves `bn`'s running statistics towards a batch's, as Burn's `BatchNorm` does.
fn update_running(bn: &BatchNorm, mean: &Tensor<1>, var: &Tensor<1>, device: &Device) {
    let momentum = bn.momentum;
    let running_mean = bn.running_mean.value_sync().to_device(device);
    let running_var = bn.running_var.value_sync().to_device(device);
    let running_mean = running_mean
        .mul_scalar(1.0 - momentum)
        .add(mean.clone().detach().mul_scalar(momentum));
    let running_var = running_var
        .mul_scalar(1.0 - momentum)
        .add(var.clone().detach().mul_scalar(momentum));
    bn.running_mean.update(running_mean.detach());
    bn.running_var.update(running_var.detach());
}

/// `bn.forward(x)`, then ReLU when `relu`: by the fused op while training on a Flex device
/// with the fast paths on (updating the running statistics as Burn's `BatchNorm` does), by
/// one scale-and-shift pass for inference on a Flex device, by Burn's module and `relu`
/// otherwise (frozen layers on a training device, other devices).
///
/// Inside [`replaying`] a training batch norm normalises by the batch's statistics as usual
/// but leaves its running statistics alone.
pub fn batch_norm<const D: usize>(bn: &BatchNorm, x: Tensor<D>, relu: bool) -> Tensor<D> {
    crate::warm::keep_pool_warm(&x.device());
    // Mixed precision: statistics and normalisation in f32, the activation's type out.
    if let Some(dt) = crate::low_precision(&x) {
        let x = crate::cast(x, burn::tensor::FloatDType::F32);
        return crate::cast(batch_norm(bn, x, relu), dt);
    }
    let device = x.device();
    let training = device.is_autodiff() && bn.training.is_enabled();
    if training && is_replaying() {
        // The same kernels as the first pass took, so the output is the same.
        if crate::base::enabled() && crate::base::is_flex(&device) {
            return batch_norm_train(x, bn.gamma.val(), bn.beta.val(), bn.epsilon, relu).0;
        }
        let y =
            burn::tensor::module::batch_norm_train(x, bn.gamma.val(), bn.beta.val(), bn.epsilon)
                .output;
        return if relu {
            burn::tensor::activation::relu(y)
        } else {
            y
        };
    }
    if !device.is_autodiff() && crate::base::enabled() && crate::base::is_flex(&device) {
        // Inference: one pass where Burn's generic batch norm and ReLU make five.
        let y = <Dispatch as NormBackend>::hearth_batch_norm_inference(
            x.into_dispatch(),
            bn.gamma.val().into_dispatch(),
            bn.beta.val().into_dispatch(),
            bn.running_mean.value().to_device(&device).into_dispatch(),
            bn.running_var.value().to_device(&device).into_dispatch(),
            bn.epsilon,
            relu,
        );
        return Tensor::from_dispatch(y);
    }
    if !(training && crate::base::enabled() && crate::base::is_flex(&device)) {
        let y = bn.forward(x);
        return if relu {
            burn::tensor::activation::relu(y)
        } else {
            y
        };
    }
    let (y, mean, var) = batch_norm_train(x, bn.gamma.val(), bn.beta.val(), bn.epsilon, relu);
    update_running(bn, &mean, &var, &device);
    y
}

thread_local! {
    static REPLAYING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is inside [`replaying`].
pub fn is_replaying() -> bool {
    REPLAYING.with(|r| r.get())
}

/// Runs `f`, a forward pass already run once on the same input (activation recomputation),
/// with [`batch_norm`]'s running statistics left as the first pass left them, so they move
/// once per batch as without recomputation. The flag is this thread's, and is restored when
/// `f` returns or unwinds.
pub fn replaying<T>(f: impl FnOnce() -> T) -> T {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            REPLAYING.with(|r| r.set(self.0));
        }
    }
    let _restore = Restore(REPLAYING.with(|r| r.replace(true)));
    f()
}
