//! A strided convolution's input gradient on a cubecl device as one matrix product and a sum of
//! shifted columns (col2im; [`crate::select::ConvKernel::Col2Im`]).
//!
//! Why: cubek's implicit GEMM computes input gradients of stride 1 only, and Burn's direct
//! transposed convolution (the fallback) was 2-4.9x slower than col2im on every transposed
//! convolution the H200's autotune timed (`../shared/gpu/`). Burn's own col2im cannot be
//! called without autotune (it tunes its matrix product), so this is the same algorithm over
//! our fixed product: `columns = Wᵀ · dY` per image (`[Ci·kh·kw, Co] · [Co, Ho·Wo]`), then each
//! kernel offset's columns added into the zero-padded image at the positions that offset
//! read, with the convolution's stride. The columns are made for a set of offsets at a time,
//! within [`crate::cube_base::columns_budget`].

use burn::backend::ops::FloatTensorOps;
use burn::tensor::{Shape, Slice};
use burn_cubecl::CubeBackend;
use burn_cubecl::ops::numeric::zeros_client;
use burn_cubecl::tensor::CubeTensor;

use crate::cube_base::{columns_budget, offsets_per_set, product, reshape};
use crate::weight_grad::ConvShape;

/// The input gradient `[N, Ci, H, W]` of the convolution `s` (one group) from its weight
/// `[Co, Ci, kh, kw]` and output gradient `grad` `[N, Co, Ho, Wo]`.
pub fn input_grad(
    weight: &CubeTensor,
    grad: &CubeTensor,
    s: &ConvShape,
) -> Result<CubeTensor, String> {
    let [n, ci, h, w] = s.input;
    let [_, co, ho, wo] = s
        .output()
        .ok_or_else(|| format!("the kernel does not fit the input: {s:?}"))?;
    let given: Vec<usize> = grad.meta.shape().to_vec();
    if given != [n, co, ho, wo] {
        return Err(format!(
            "the output gradient is {given:?}, the convolution makes {:?}",
            [n, co, ho, wo]
        ));
    }
    let [kh, kw] = s.kernel;
    let [ph, pw] = s.padding;
    let positions = ho * wo;
    let offsets = kh * kw;
    let dy = reshape(grad.clone(), &[n, co, positions]);
    // `[Co, Ci, kh·kw]`: each offset's weights are a slice of the last axis.
    let weights = reshape(weight.clone(), &[co, ci, offsets]);
    let mut image = zeros_client(
        grad.client.clone(),
        grad.device.clone(),
        Shape::new([n, ci, h + 2 * ph, w + 2 * pw]),
        grad.dtype,
    );
    let all = |d: usize| Slice::from(0..d);
    // The padded input's positions that offset (i, j) read, one per output position.
    let read_by = |i: usize, j: usize| -> [Slice; 4] {
        let side = |k: usize, axis: usize, out: usize| {
            let start = k * s.dilation[axis];
            let end = start + (out - 1) * s.stride[axis] + 1;
            Slice::new(start as isize, Some(end as isize), s.stride[axis] as isize)
        };
        [all(n), all(ci), side(i, 0, ho), side(j, 1, wo)]
    };
    let one_offset = n * ci * positions * grad.dtype.size();
    let per_set = offsets_per_set(one_offset, offsets, columns_budget());
    let mut first = 0;
    while first < offsets {
        let last = (first + per_set).min(offsets);
        let count = last - first;
        // `Wᵀ` for these offsets: `[1, Ci·count, Co]`.
        let w_set = CubeBackend::float_slice(
            weights.clone(),
            &[all(co), all(ci), Slice::from(first..last)],
        );
        let w_set = reshape(w_set, &[1, co, ci * count]);
        let wt = CubeBackend::float_swap_dims(w_set, 1, 2);
        // `[N, Ci·count, Ho·Wo]` as `[N, Ci, count, Ho, Wo]`.
        let columns = product(wt, dy.clone())?;
        let columns = reshape(columns, &[n, ci, count, ho, wo]);
        for o in first..last {
            let taken = CubeBackend::float_slice(
                columns.clone(),
                &[
                    all(n),
                    all(ci),
                    Slice::from(o - first..o - first + 1),
                    all(ho),
                    all(wo),
                ],
            );
            let taken = reshape(taken, &[n, ci, ho, wo]);
            let at = read_by(o / kw, o % kw);
            // The first offset lands on zeros; later ones may overlap earlier ones (a kernel
            // wider than its stride) and add to them.
            let value = if o == 0 {
                taken
            } else {
                let there = CubeBackend::float_slice(image.clone(), &at);
                CubeBackend::float_add(there, taken)
            };
            image = CubeBackend::float_slice_assign(image, &at, value);
        }
        first = last;
    }
    if ph == 0 && pw == 0 {
        return Ok(image);
    }
    Ok(CubeBackend::float_slice(
        image,
        &[
            all(n),
            all(ci),
            Slice::from(ph..ph + h),
            Slice::from(pw..pw + w),
        ],
    ))
}
