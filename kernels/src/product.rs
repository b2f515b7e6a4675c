//! A linear layer's matrix product on Flex, written by gemm straight into the f32 vector that
//! becomes the result's storage.
//!
//! Why: Flex's own product allocates its output as bytes (`vec![0u8; len]`), and Burn's
//! `Bytes::from_bytes_vec` then copies those into a block aligned to 16 bytes (a byte vector's
//! alignment is 1, whatever address the allocator gave it). So for a moment every product's
//! output is held twice, and copied once. Small for activations; for a weight gradient it is
//! the size of the weight: VGG-16's first classifier layer (25088 x 4096) held 392 MiB more at
//! the peak of every backward pass, which was most of what kept ZeRO stage 3 from its memory
//! goal on VGG-16 (`kernels/tests/product.rs` counts both peaks: `cargo test --release -p
//! hearth-kernels --test product -- --nocapture`).
//!
//! The same gemm call with the same strides and threads as Flex's 2-D product (so the same
//! sums in the same order); other float types, ranks and shapes go to Flex's.

use burn::backend::Flex;
use burn::backend::TensorMetadata;
use burn::backend::ops::FloatTensorOps;
use burn::tensor::DType;
use burn_flex::FlexTensor;

use crate::base::f32_tensor;

/// Flex's threshold for a parallel product (`m·n·k` multiply-adds): below it one thread.
const PARALLEL_THRESHOLD: usize = 192 * 192 * 192;

/// `lhs · rhs` for `[m, k]` and `[k, n]` matrices on Flex (either may be a strided view, such
/// as a transposed weight or input: read through its strides, never copied). F32 matrices are
/// ours; anything else is Flex's product (which panics on mismatched inner dimensions as it
/// always did).
pub fn product(lhs: FlexTensor, rhs: FlexTensor) -> FlexTensor {
    let (ls, rs) = (lhs.shape(), rhs.shape());
    let ours = lhs.dtype() == DType::F32
        && rhs.dtype() == DType::F32
        && ls.num_dims() == 2
        && rs.num_dims() == 2
        && ls[1] == rs[0];
    if !ours {
        return Flex::float_matmul(lhs, rhs);
    }
    let (m, k, n) = (ls[0], ls[1], rs[1]);
    let len = m
        .checked_mul(n)
        .unwrap_or_else(|| panic!("matrix product: a {m} x {n} result overflows"));
    if len == 0 || k == 0 {
        return f32_tensor(vec![0.0; len], vec![m, n]);
    }
    let [lhs_rs, lhs_cs] = row_col_strides(&lhs);
    let [rhs_rs, rhs_cs] = row_col_strides(&rhs);
    let lhs_values: &[f32] = lhs.storage();
    let rhs_values: &[f32] = rhs.storage();
    let parallelism = if m.saturating_mul(n).saturating_mul(k) >= PARALLEL_THRESHOLD {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    let mut out = Vec::<f32>::with_capacity(len);
    // SAFETY: the views' offsets and strides are their layouts' (Flex checked them against
    // their storage when it made the views), so every element gemm reads is inside the
    // storage; `out` has room for the `m x n` row-major result. With `read_dst` false gemm
    // sets its `alpha` to zero and writes every element of `dst` without reading it (k > 0 and
    // m, n > 0 here), so `set_len` exposes only written values.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            lhs_values.as_ptr().add(lhs.layout().start_offset()),
            lhs_cs,
            lhs_rs,
            rhs_values.as_ptr().add(rhs.layout().start_offset()),
            rhs_cs,
            rhs_rs,
            0.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
        out.set_len(len);
    }
    f32_tensor(out, vec![m, n])
}

/// A matrix's row and column strides, in elements.
fn row_col_strides(t: &FlexTensor) -> [isize; 2] {
    let s = t.layout().strides();
    [s[0], s[1]]
}
