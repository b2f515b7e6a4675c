//! Two tensors joined along a dimension, copied on every thread.
//!
//! Why: Burn Flex's `cat` copies on the calling thread alone, into memory it has just asked
//! for (each page faulted in as the copy first touches it). A DenseNet joins every layer's new
//! channels to all the ones before them, so the copies grow with the square of the block's
//! depth: on a 2-core Zen 4, DenseNet-121's training step spent 0.16-0.22 s of 2.5-2.9 in
//! them, the other core idle (`perf`), where PyTorch's `cat` took 0.06 s. Here the pieces are
//! copied in parallel, and a DenseNet block joins two tensors per layer (the input so far and
//! the new channels: the same copies) so that the backward, which only cuts the gradient in
//! two, is an op with two parents ([`Backward`] takes a fixed count).
//!
//! The values are copied, never computed: the result equals Flex's `cat` bit for bit, and the
//! backward hands each parent its part of the gradient as Burn's `cat` does (a view).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, Flex, TensorMetadata, backend_extension};
use burn::prelude::*;
use burn::tensor::{DType, Slice};

use crate::base::f32_tensor;

/// Values copied per parallel piece at most: small enough that one image's part splits
/// across the threads, large enough that a piece outweighs its scheduling.
const PIECE: usize = 1 << 16;

/// `a` and `b` (row-major, each `outer` runs of `a_run` and `b_run` values) joined run by run:
/// `outer` runs of `a_run + b_run` values, `a`'s first.
pub fn cat2(a: &[f32], b: &[f32], outer: usize, a_run: usize, b_run: usize) -> Vec<f32> {
    use rayon::prelude::*;
    assert_eq!(a.len(), outer * a_run, "cat: the first tensor's length");
    assert_eq!(b.len(), outer * b_run, "cat: the second tensor's length");
    let run = a_run + b_run;
    // (source, first output index) of every piece.
    let mut pieces: Vec<(&[f32], usize)> = Vec::new();
    for o in 0..outer {
        for (src, at) in [
            (&a[o * a_run..(o + 1) * a_run], o * run),
            (&b[o * b_run..(o + 1) * b_run], o * run + a_run),
        ] {
            for (k, chunk) in src.chunks(PIECE).enumerate() {
                pieces.push((chunk, at + k * PIECE));
            }
        }
    }
    let len = outer * run;
    // SAFETY: the pieces cover `0..len` exactly once between them (each run's two parts, cut
    // into consecutive chunks), so every value is written, each by one piece, inside the block.
    unsafe {
        crate::base::written_by(len, |out| {
            pieces.par_iter().for_each(|&(src, at)| {
                std::ptr::copy_nonoverlapping(src.as_ptr(), out.at(at), src.len());
            });
        })
    }
}

/// The extension: two tensors joined along a dimension.
#[backend_extension(Flex, Autodiff)]
pub trait CatBackend: Backend {
    /// `cat([a, b], dim)` for f32 tensors of the same rank whose other dimensions agree; under
    /// autodiff each gets its part of the gradient.
    fn hearth_cat2(a: FloatTensor<Self>, b: FloatTensor<Self>, dim: usize) -> FloatTensor<Self>;
}

/// A Flex tensor's values in row-major order, borrowed where it is contiguous.
fn values_of(t: &burn_flex::FlexTensor) -> std::borrow::Cow<'_, [f32]> {
    match t.layout().contiguous_offsets() {
        Some((start, end)) => std::borrow::Cow::Borrowed(&t.storage::<f32>()[start..end]),
        None => std::borrow::Cow::Owned(t.to_contiguous().storage::<f32>().to_vec()),
    }
}

impl CatBackend for Flex {
    fn hearth_cat2(a: FloatTensor<Self>, b: FloatTensor<Self>, dim: usize) -> FloatTensor<Self> {
        let (da, db): (Vec<usize>, Vec<usize>) = (
            a.shape().iter().copied().collect(),
            b.shape().iter().copied().collect(),
        );
        let inner: usize = da[dim + 1..].iter().product();
        let outer: usize = da[..dim].iter().product();
        let y = cat2(
            &values_of(&a),
            &values_of(&b),
            outer,
            da[dim] * inner,
            db[dim] * inner,
        );
        let mut dims = da;
        dims[dim] += db[dim];
        f32_tensor(y, dims)
    }
}

/// The backward of [`CatBackend::hearth_cat2`] under autodiff: the first tensor's extent along
/// the dimension, and the dimension.
#[derive(Debug)]
struct Cat2Backward;

impl<B: Backend> Backward<B, 2> for Cat2Backward {
    type State = (usize, usize);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_a, node_b] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (split, dim) = ops.state;
        let dims: Vec<usize> = grad.shape().iter().copied().collect();
        let part = |range: std::ops::Range<usize>| -> Vec<Slice> {
            dims.iter()
                .enumerate()
                .map(|(d, &n)| {
                    let r = if d == dim { range.clone() } else { 0..n };
                    Slice::new(r.start as isize, Some(r.end as isize), 1)
                })
                .collect()
        };
        if let Some(node) = node_a {
            grads.register::<B>(node.id, B::float_slice(grad.clone(), &part(0..split)));
        }
        if let Some(node) = node_b {
            grads.register::<B>(node.id, B::float_slice(grad, &part(split..dims[dim])));
        }
    }
}

impl<B: CatBackend, C: CheckpointStrategy> CatBackend for Autodiff<B, C> {
    fn hearth_cat2(a: FloatTensor<Self>, b: FloatTensor<Self>, dim: usize) -> FloatTensor<Self> {
        let split = a.shape()[dim];
        let prep = Cat2Backward
            .prepare::<C>([a.node(), b.node()])
            .compute_bound()
            .stateful();
        let out = B::hearth_cat2(a.into_primitive(), b.into_primitive(), dim);
        match prep {
            OpsKind::Tracked(prep) => prep.finish((split, dim), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }
}

/// `Tensor::cat(vec![a, b], dim)`: copied in parallel ([`cat2`]) for f32 on a Flex device with
/// the fast paths on, by Burn's `cat` otherwise. Panics as Burn's does when the other
/// dimensions differ.
pub fn cat<const D: usize>(a: Tensor<D>, b: Tensor<D>, dim: usize) -> Tensor<D> {
    let (da, db) = (a.dims(), b.dims());
    let agree = (0..D).all(|d| d == dim || da[d] == db[d]);
    let fast = agree
        && dim < D
        && a.dtype() == DType::F32
        && b.dtype() == DType::F32
        && crate::base::enabled()
        && crate::base::is_flex(&a.device());
    if !fast {
        return Tensor::cat(vec![a, b], dim);
    }
    Tensor::from_dispatch(<Dispatch as CatBackend>::hearth_cat2(
        a.into_dispatch(),
        b.into_dispatch(),
        dim,
    ))
}
