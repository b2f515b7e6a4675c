//! Casts between f32 and bf16 or f16 on Flex, a slice at a time on every core.
//!
//! Burn Flex casts value by value through its generic element conversion, and `half`'s
//! per-value f16 conversion checks the CPU for F16C on every value: in a ResNet-50 training
//! step in fp16 the casts around each layer cost more than the layers. Here f16 goes through
//! `half`'s slice conversions (F16C, eight values an instruction, one check per slice) and bf16
//! through its slice conversions too, each core taking its own run of values. The bits are
//! `half`'s, as Flex's are (tested against `Tensor::cast`).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, Flex, TensorMetadata, backend_extension};
use burn::prelude::*;
use burn::tensor::{DType, FloatDType};
use burn_flex::{FlexTensor, Layout};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

/// Values a core converts at a time.
const RUN: usize = 1 << 16;

/// The extension: a float cast.
#[backend_extension(Flex, Autodiff)]
pub trait CastBackend: Backend {
    /// `x` in `dtype`; under autodiff its backward casts the gradient back to `x`'s type.
    fn hearth_cast(x: FloatTensor<Self>, dtype: FloatDType) -> FloatTensor<Self>;
}

/// `src` converted into `dst` run by run on every core.
fn convert<S: Sync, D: Send>(src: &[S], dst: &mut [D], run: impl Fn(&[S], &mut [D]) + Sync) {
    dst.par_chunks_mut(RUN)
        .zip(src.par_chunks(RUN))
        .for_each(|(d, s)| run(s, d));
}

impl CastBackend for Flex {
    fn hearth_cast(x: FloatTensor<Self>, dtype: FloatDType) -> FloatTensor<Self> {
        let to = DType::from(dtype);
        let from = x.dtype();
        if from == to {
            return x;
        }
        let x = x.to_contiguous();
        let shape = x.shape();
        let n = shape.num_elements();
        let bytes = match (from, to) {
            (DType::F32, DType::F16) => {
                let mut out = vec![f16::ZERO; n];
                convert(x.storage::<f32>(), &mut out, |s, d| {
                    d.convert_from_f32_slice(s)
                });
                burn::tensor::Bytes::from_elems(out)
            }
            (DType::F32, DType::BF16) => {
                let mut out = vec![bf16::ZERO; n];
                convert(x.storage::<f32>(), &mut out, |s, d| {
                    d.convert_from_f32_slice(s)
                });
                burn::tensor::Bytes::from_elems(out)
            }
            (DType::F16, DType::F32) => {
                let mut out = vec![0f32; n];
                convert(x.storage::<f16>(), &mut out, |s, d| {
                    s.convert_to_f32_slice(d)
                });
                burn::tensor::Bytes::from_elems(out)
            }
            (DType::BF16, DType::F32) => {
                let mut out = vec![0f32; n];
                convert(x.storage::<bf16>(), &mut out, |s, d| {
                    s.convert_to_f32_slice(d)
                });
                burn::tensor::Bytes::from_elems(out)
            }
            _ => return Flex::float_cast(x, dtype),
        };
        FlexTensor::new(bytes, Layout::contiguous(shape), to)
    }
}

/// The backward of [`CastBackend::hearth_cast`]: the gradient cast back to the input's type.
#[derive(Debug)]
struct CastBackward;

impl<B: CastBackend> Backward<B, 1> for CastBackward {
    type State = FloatDType;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_x] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(node) = node_x {
            grads.register::<B>(node.id, B::hearth_cast(grad, ops.state));
        }
    }
}

impl<B: CastBackend, C: CheckpointStrategy> CastBackend for Autodiff<B, C> {
    fn hearth_cast(x: FloatTensor<Self>, dtype: FloatDType) -> FloatTensor<Self> {
        // The input's type, which its gradient is cast back to (a float tensor's: `From`
        // covers every one, Flex32 included).
        let from = FloatDType::from(x.dtype());
        match CastBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(from, B::hearth_cast(x.into_primitive(), dtype)),
            OpsKind::UnTracked(prep) => prep.finish(B::hearth_cast(x.into_primitive(), dtype)),
        }
    }
}

/// `x.cast(dtype)`: through [`CastBackend`] on a Flex device with the fast paths on, by Burn's
/// cast elsewhere.
pub fn cast<const D: usize>(x: Tensor<D>, dtype: FloatDType) -> Tensor<D> {
    if !(crate::base::enabled() && crate::base::is_flex(&x.device())) {
        return x.cast(dtype);
    }
    Tensor::from_dispatch(<Dispatch as CastBackend>::hearth_cast(
        x.into_dispatch(),
        dtype,
    ))
}
