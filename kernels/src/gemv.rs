//! A linear layer's product at batch 1, `y[1, n] = x[1, k] · W[k, n]`, on all threads.
//!
//! Burn Flex hands every matrix product to gemm, and gemm answers a product with one row by
//! its matrix-vector kernel on the calling thread alone, whatever parallelism it is given. At
//! batch 1 a classifier is that product and reads its whole weight once: VGG-16's three linear
//! layers read 490 MB per image, which one core streams at about the speed one core can pull
//! from memory. Here the output's columns are split between the threads, each running gemm's
//! kernel on its columns of every weight row, so every core streams its share of the weight.
//! Each output is still one thread's sum over `k` in order, so the result does not depend on
//! the number of threads.
//!
//! Inference only: [`linear`](crate::linear) takes this path on a Flex device without autodiff;
//! under autodiff the extension falls back to Burn's tracked matrix product.

use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, Flex, TensorMetadata, backend_extension};
use burn::prelude::*;
use burn::tensor::DType;
use rayon::prelude::*;

use crate::base::f32_tensor;

/// The fewest output columns one thread takes (a multiple of 16, the widest SIMD vector): a
/// narrower split costs more in waking a thread than the columns' share of memory.
const MIN_COLUMNS: usize = 256;

/// The fewest weights a product needs for [`one_row`] to take it: below, the weight sits in
/// the caches and gemm's one thread is as fast (`kernels/examples/forward_b1.rs`, 2-core Zen 5:
/// 2048 x 1000 0.11 ms here against 0.09 ms, 4096 x 4096 1.87 ms against 2.53 ms, 25088 x 4096
/// 13.4 ms against 18.1 ms).
const MIN_WEIGHTS: usize = 1 << 22;

/// `x · w` for one row `x` (`k` floats) and a row-major `w` (`k x n`): `n` floats. The columns
/// are split between rayon's threads in pieces of at least 256 columns.
///
/// Panics when the lengths do not match `k` and `n` (callers pass Burn tensors Burn checked).
pub fn row_times_matrix(x: &[f32], w: &[f32], k: usize, n: usize) -> Vec<f32> {
    assert_eq!(
        x.len(),
        k,
        "row times matrix: the row has {} of {k} values",
        x.len()
    );
    assert_eq!(
        w.len(),
        k * n,
        "row times matrix: the matrix has {} of {k} x {n} values",
        w.len()
    );
    let mut y = vec![0f32; n];
    if n == 0 || k == 0 {
        return y;
    }
    let threads = rayon::current_num_threads().max(1);
    let per = n
        .div_ceil(threads)
        .next_multiple_of(16)
        .max(MIN_COLUMNS)
        .min(n);
    y.par_chunks_mut(per).enumerate().for_each(|(i, out)| {
        let first = i * per;
        // SAFETY: `out` is `out.len()` consecutive outputs (a 1 x len row); `x` is 1 x k with
        // column stride 1; the matrix's columns `first..first + len` start at `w[first]`, with
        // row stride `n` and column stride 1, all inside `w` (k x n).
        unsafe {
            crate::base::gemm_rows(
                1,
                out.len(),
                k,
                out.as_mut_ptr(),
                out.len(),
                x.as_ptr(),
                1,
                k,
                w[first..].as_ptr(),
                n,
                gemm::Parallelism::None,
            );
        }
    });
    y
}

/// The extension: one row times a matrix.
#[backend_extension(Flex, Autodiff)]
pub trait LinearBackend: Backend {
    /// `x · weight` for `x` `[1, k]` and `weight` `[k, n]`: `[1, n]`.
    fn hearth_row_matmul(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self>;
}

impl LinearBackend for Flex {
    fn hearth_row_matmul(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self> {
        let [rows, k] = x.shape().dims::<2>();
        let [wk, n] = weight.shape().dims::<2>();
        // A weight that is a view (transposed, sliced) would be copied whole on every call:
        // Flex's product reads it through its strides instead.
        let plain = weight.is_contiguous()
            && weight.layout().start_offset() == 0
            && weight.bytes().len() == k * n * std::mem::size_of::<f32>();
        let f32s = x.dtype() == DType::F32 && weight.dtype() == DType::F32;
        if rows != 1 || wk != k || !f32s || !plain {
            return Flex::float_matmul(x, weight);
        }
        let x = x.to_contiguous();
        let y = row_times_matrix(x.storage::<f32>(), weight.storage::<f32>(), k, n);
        f32_tensor(y, vec![1, n])
    }
}

impl<B: LinearBackend, C: burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy>
    LinearBackend for Autodiff<B, C>
{
    /// Burn's tracked product: the fast path is for inference, where nothing is tracked.
    fn hearth_row_matmul(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_matmul(x, weight)
    }
}

/// `x · weight` (`[.., k]` by `[k, n]`) when `x` holds one row, f32, on a Flex device without
/// autodiff and the fast paths on: by [`row_times_matrix`]. `None` otherwise (the caller takes
/// Burn's product).
pub fn one_row<const D: usize>(x: &Tensor<D>, weight: &Tensor<2>) -> Option<Tensor<D>> {
    if D == 0 {
        return None;
    }
    let dims = x.dims();
    let [k, n] = weight.dims();
    let rows: usize = dims[..D - 1].iter().product();
    let device = x.device();
    let fits = rows == 1 && dims[D - 1] == k && k * n >= MIN_WEIGHTS;
    let fast = fits
        && x.dtype() == DType::F32
        && weight.dtype() == DType::F32
        && crate::base::enabled()
        && crate::base::is_flex(&device)
        && !device.is_autodiff();
    if !fast {
        return None;
    }
    let y = Tensor::<2>::from_dispatch(<Dispatch as LinearBackend>::hearth_row_matmul(
        x.clone().reshape([1, k]).into_dispatch(),
        weight.clone().into_dispatch(),
    ));
    let mut out = dims;
    out[D - 1] = n;
    Some(y.reshape(out))
}
