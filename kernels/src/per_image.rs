//! A convolution's weight gradient on a cubecl device as one matrix product per image, the
//! images' products summed afterwards ([`crate::select::ConvKernel::PerImage`]).
//!
//! Why: the weight gradient sums over every image and output position, `K = N·Ho·Wo` terms per
//! weight, while its result is small (`Co × Ci·kh·kw`). cubek's kernels (the implicit GEMM and
//! the matrix product alike) give each cube one tile of the result and walk the whole `K`
//! inside it, a stage of about 32 positions at a time: ResNet-50's first stage at batch 32
//! (`K` = 100,352, a 64x576 result) keeps a few dozen cubes busy for over 3,000 steps each
//! while the rest of the GPU idles. Cut by image, the same work is `N` times as many cubes
//! with `Ho·Wo` positions each (split-K, as cuDNN does for these shapes); the `N` partial
//! results are then summed (in f32).
//!
//! The products' right-hand side is the input's columns for a set of kernel offsets (im2col),
//! made a set at a time so that they never take more than
//! [`crate::cube_base::columns_budget`] bytes (at least one offset); a 1x1 convolution with
//! stride 1 and no padding needs no columns at all.

use burn::backend::ops::FloatTensorOps;
use burn::tensor::{DType, FloatDType, Shape, Slice};
use burn_cubecl::CubeBackend;
use burn_cubecl::ops::numeric::zeros_client;
use burn_cubecl::tensor::CubeTensor;

use crate::cube_base::{columns_budget, offsets_per_set, product, reshape};
use crate::select::is_pointwise;
use crate::weight_grad::ConvShape;

/// `Σ_n a[n] · b[n]` for `a` `[N, M, K]` and `b` `[N, K, P]`: the product per image, summed
/// (fp16 and bf16 in f32) and returned in `a`'s type as `[M, P]`.
fn summed_products(a: CubeTensor, b: CubeTensor) -> Result<CubeTensor, String> {
    let dtype = a.dtype;
    let per_image = product(a, b)?;
    let dims = per_image.meta.shape().to_vec();
    let (m, p) = (dims[1], dims[2]);
    let low = match dtype {
        DType::F16 => Some(FloatDType::F16),
        DType::BF16 => Some(FloatDType::BF16),
        _ => None,
    };
    let wide = match low {
        Some(_) => CubeBackend::float_cast(per_image, FloatDType::F32),
        None => per_image,
    };
    let sum = reshape(CubeBackend::float_sum_dim(wide, 0), &[m, p]);
    Ok(match low {
        Some(low) => CubeBackend::float_cast(sum, low),
        None => sum,
    })
}

/// The weight gradient `[Co, Ci, kh, kw]` of the convolution `s` (one group) from its input
/// `x` `[N, Ci, H, W]` and output gradient `grad` `[N, Co, Ho, Wo]`.
pub fn weight_grad(x: &CubeTensor, grad: &CubeTensor, s: &ConvShape) -> Result<CubeTensor, String> {
    let [n, ci, h, w] = s.input;
    let [_, co, ho, wo] = s
        .output()
        .ok_or_else(|| format!("the kernel does not fit the input: {s:?}"))?;
    let positions = ho * wo;
    let given: Vec<usize> = grad.meta.shape().to_vec();
    if given != [n, co, ho, wo] {
        return Err(format!(
            "the output gradient is {given:?}, the convolution makes {:?}",
            [n, co, ho, wo]
        ));
    }
    // The output gradient per image as `[N, Co, Ho·Wo]` (the left-hand side of every product).
    let dy = reshape(grad.clone(), &[n, co, positions]);
    if is_pointwise(s) {
        // The input is its own columns: `[N, Ci, H·W]` read transposed.
        let xt = CubeBackend::float_swap_dims(reshape(x.clone(), &[n, ci, h * w]), 1, 2);
        return Ok(reshape(summed_products(dy, xt)?, &[co, ci, 1, 1]));
    }
    let [kh, kw] = s.kernel;
    let [ph, pw] = s.padding;
    let padded = if ph == 0 && pw == 0 {
        x.clone()
    } else {
        let zeros = zeros_client(
            x.client.clone(),
            x.device.clone(),
            Shape::new([n, ci, h + 2 * ph, w + 2 * pw]),
            x.dtype,
        );
        let all = |d: usize| Slice::from(0..d);
        CubeBackend::float_slice_assign(
            zeros,
            &[
                all(n),
                all(ci),
                Slice::from(ph..ph + h),
                Slice::from(pw..pw + w),
            ],
            x.clone(),
        )
    };
    // The input's values that kernel offset (i, j) meets at each output position.
    let offset = |i: usize, j: usize| -> CubeTensor {
        let side = |k: usize, axis: usize, out: usize| {
            let start = k * s.dilation[axis];
            let end = start + (out - 1) * s.stride[axis] + 1;
            Slice::new(start as isize, Some(end as isize), s.stride[axis] as isize)
        };
        let all = |d: usize| Slice::from(0..d);
        let cut = CubeBackend::float_slice(
            padded.clone(),
            &[all(n), all(ci), side(i, 0, ho), side(j, 1, wo)],
        );
        reshape(cut, &[n, ci, 1, positions])
    };
    let offsets = kh * kw;
    let one_offset = n * ci * positions * x.dtype.size();
    let per_set = offsets_per_set(one_offset, offsets, columns_budget());
    let mut parts = Vec::new();
    let mut first = 0;
    while first < offsets {
        let last = (first + per_set).min(offsets);
        let columns: Vec<CubeTensor> = (first..last).map(|o| offset(o / kw, o % kw)).collect();
        let count = columns.len();
        let columns = if count == 1 {
            columns.into_iter().next().ok_or("no offset")?
        } else {
            CubeBackend::float_cat(columns, 2)
        };
        // `[N, Ci·count, Ho·Wo]`, read transposed: `[N, Ho·Wo, Ci·count]`.
        let columns =
            CubeBackend::float_swap_dims(reshape(columns, &[n, ci * count, positions]), 1, 2);
        parts.push(reshape(
            summed_products(dy.clone(), columns)?,
            &[co, ci, count],
        ));
        first = last;
    }
    let dw = if parts.len() == 1 {
        parts.pop().ok_or("no part")?
    } else {
        CubeBackend::float_cat(parts, 2)
    };
    Ok(reshape(dw, &[co, ci, kh, kw]))
}
