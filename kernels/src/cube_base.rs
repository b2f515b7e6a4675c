//! What Hearth's cubecl convolution kernels share, below `cube.rs` (which picks them) and the
//! kernels written over cubek's product (`per_image.rs`, `col2im.rs`): the one fixed matrix
//! product, a reshape, and the budget for im2col columns.

use std::sync::atomic::{AtomicUsize, Ordering};

use burn::backend::ops::FloatTensorOps;
use burn::tensor::Shape;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::matmul::{MatmulStrategy, matmul};
use burn_cubecl::tensor::CubeTensor;

/// `lhs · rhs` by cubek's default product (CMMA tiles where the device has them, else the plain
/// tiled kernel): one fixed kernel, never tuned.
pub(crate) fn product(lhs: CubeTensor, rhs: CubeTensor) -> Result<CubeTensor, String> {
    let dtype = lhs.dtype;
    matmul(lhs, rhs, None, MatmulStrategy::Cube, dtype).map_err(|e| format!("{e:?}"))
}

pub(crate) fn reshape(t: CubeTensor, dims: &[usize]) -> CubeTensor {
    CubeBackend::float_reshape(t, Shape::from(dims.to_vec()))
}

/// The most bytes one set of im2col columns may take (each kernel offset's columns are the
/// size of the input, strided: VGG-16's first layers at batch 32 hold one offset at a time).
pub const COLUMNS_BUDGET: usize = 256 << 20;

static BUDGET: AtomicUsize = AtomicUsize::new(COLUMNS_BUDGET);

/// Sets the most bytes one set of columns may take in this process (at least one offset is
/// always made): smaller on a GPU short of memory, or to test the cut into sets.
pub fn set_columns_budget(bytes: usize) {
    BUDGET.store(bytes, Ordering::Relaxed);
}

/// The budget [`set_columns_budget`] set, [`COLUMNS_BUDGET`] by default.
pub fn columns_budget() -> usize {
    BUDGET.load(Ordering::Relaxed)
}

/// How many kernel offsets go into one set of columns: as many as fit in `budget` bytes, at
/// least one, at most all `offsets`.
pub fn offsets_per_set(one_offset_bytes: usize, offsets: usize, budget: usize) -> usize {
    (budget / one_offset_bytes.max(1)).clamp(1, offsets.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_columns_are_made_in_sets_within_the_budget() {
        // ResNet-50's first stage at batch 32: 64 channels of 56x56, 25.7 MB an offset: all 9.
        assert_eq!(offsets_per_set(32 * 64 * 3136 * 4, 9, COLUMNS_BUDGET), 9);
        // VGG-16's first layers at batch 32: 411 MB an offset: one at a time.
        assert_eq!(offsets_per_set(32 * 64 * 50176 * 4, 9, COLUMNS_BUDGET), 1);
        // The 7x7 stem: 3 channels, 4.8 MB an offset: all 49.
        assert_eq!(offsets_per_set(32 * 3 * 12544 * 4, 49, COLUMNS_BUDGET), 49);
        // Between: as many as fit.
        assert_eq!(offsets_per_set(100, 9, 450), 4);
        assert_eq!(offsets_per_set(0, 9, 450), 9);
    }
}
