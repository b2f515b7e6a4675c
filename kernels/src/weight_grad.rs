//! The weight gradient of a 2-D convolution (one group) as im2col and one GEMM per chunk of
//! images, on plain `f32` slices:
//!
//! `dW[co, ci·kh·kw] = Σ over images and output pixels of dY[co, p] · cols[ci·kh·kw, p]`
//!
//! Burn's generic `conv2d_weight_backward` runs a convolution with batch and channels swapped;
//! Burn Flex executes it as thin matrix products that re-read the whole output gradient (22-65
//! GFLOP/s for ResNet-50's 3x3 layers, BENCHMARKS.md "CPU profile"). Here the reduction over
//! images and pixels is the GEMM's inner dimension, so gemm's blocked microkernels do the work.
//!
//! Images are taken in chunks so that the inner dimension is at least [`MIN_INNER`] even for
//! 7x7 feature maps; the columns of one chunk are `ci·kh·kw × chunk·Ho·Wo` floats. The row
//! order of the columns follows the weight's `[Co, Ci, kh, kw]` layout, so the result needs no
//! permutation. Deterministic: the GEMM splits rows and columns across threads, never the sum.
//!
//! For stride 1 with a small weight, [`conv2d_weight_grad_shifted`] does without im2col (one
//! GEMM per kernel tap over the padded input's flat pixels) and splits the images into partial
//! sums, one per thread or more: the result depends on the batch and the number of threads
//! only, never on timing.

use rayon::prelude::*;
use std::mem::MaybeUninit;

mod shifted;
pub use shifted::{SHIFTED_RUN, conv2d_weight_grad_shifted, shifted_applies};

/// The smallest inner dimension (images x output pixels) one GEMM call gets, where the batch
/// allows it.
pub const MIN_INNER: usize = 1024;

/// About how many floats one block of columns holds (8 MiB) when an image's columns would be
/// larger: VGG-16's first layers have 576 x 50176-float columns per image, whose writing and
/// reading from memory (and the page faults of a fresh buffer) cost more than the GEMM.
pub const BLOCK_FLOATS: usize = 1 << 21;

pub(crate) use crate::shape::conv_shape;
/// The shape types, defined below both this module and [`crate::winograd`] (which computes a
/// weight gradient too).
pub use crate::shape::{ConvShape, Geometry2};

/// The output range `lo..hi` along one axis whose input index `o·stride + offset - pad` lies in
/// `0..len`.
fn valid_range(out: usize, stride: usize, offset: usize, pad: usize, len: usize) -> (usize, usize) {
    // o·stride + offset >= pad  and  o·stride + offset < pad + len
    let lo = pad.saturating_sub(offset).div_ceil(stride);
    let hi = if pad + len > offset {
        (pad + len - offset).div_ceil(stride)
    } else {
        0
    };
    (lo.min(out), hi.min(out).max(lo.min(out)))
}

/// Fills one row of the columns: kernel tap `(ki, kj)` of input channel plane `plane`
/// (`H x W`) for every output pixel, zero where the tap falls in the padding.
pub(crate) fn fill_row(
    row: &mut [f32],
    plane: &[f32],
    s: &ConvShape,
    ki: usize,
    kj: usize,
    out_rows: std::ops::Range<usize>,
    wo: usize,
) {
    // SAFETY: `fill_row_into` writes only initialized values, so `row` stays initialized.
    let row = unsafe {
        std::slice::from_raw_parts_mut(row.as_mut_ptr().cast::<MaybeUninit<f32>>(), row.len())
    };
    fill_row_into(row, plane, s, ki, kj, out_rows, wo);
}

/// [`fill_row`] into memory not yet written: every value of `row` is written.
pub(crate) fn fill_row_into(
    row: &mut [MaybeUninit<f32>],
    plane: &[f32],
    s: &ConvShape,
    ki: usize,
    kj: usize,
    out_rows: std::ops::Range<usize>,
    wo: usize,
) {
    let zero = MaybeUninit::new(0.0);
    let [_, _, h, w] = s.input;
    let ho_end = out_rows.end;
    let (oh_lo, oh_hi) = valid_range(ho_end, s.stride[0], ki * s.dilation[0], s.padding[0], h);
    let (oh_lo, oh_hi) = (oh_lo.max(out_rows.start), oh_hi.max(out_rows.start));
    let (ow_lo, ow_hi) = valid_range(wo, s.stride[1], kj * s.dilation[1], s.padding[1], w);
    let base = out_rows.start;
    row[..(oh_lo - base) * wo].fill(zero);
    row[(oh_hi - base) * wo..].fill(zero);
    for oh in oh_lo..oh_hi {
        let ih = oh * s.stride[0] + ki * s.dilation[0] - s.padding[0];
        let src = &plane[ih * w..(ih + 1) * w];
        let dst = &mut row[(oh - base) * wo..(oh - base + 1) * wo];
        dst[..ow_lo].fill(zero);
        dst[ow_hi..].fill(zero);
        if ow_lo == ow_hi {
            continue;
        }
        let first = ow_lo * s.stride[1] + kj * s.dilation[1] - s.padding[1];
        if s.stride[1] == 1 {
            let src = &src[first..first + (ow_hi - ow_lo)];
            for (d, &v) in dst[ow_lo..ow_hi].iter_mut().zip(src) {
                d.write(v);
            }
        } else {
            for (k, d) in dst[ow_lo..ow_hi].iter_mut().enumerate() {
                d.write(src[first + k * s.stride[1]]);
            }
        }
    }
}

/// Calls `f(image, output rows, columns)` for every image of `x` and every block of output
/// rows ([`row_blocks`]); the columns (`[Ci·kh·kw, rows·Wo]`, row-major) reuse one buffer.
pub(crate) fn for_each_column_block(
    x: &[f32],
    s: &ConvShape,
    mut f: impl FnMut(usize, &std::ops::Range<usize>, &[f32]),
) {
    let [n, ci, _, _] = s.input;
    let Some([_, _, ho, wo]) = s.output() else {
        return;
    };
    let rows = ci * s.kernel[0] * s.kernel[1];
    let blocks = row_blocks(rows, ho, wo);
    let largest = blocks.iter().map(|r| r.len()).max().unwrap_or(0) * wo;
    let mut cols = vec![0f32; rows * largest];
    for b in 0..n {
        for block in &blocks {
            let cols = fill_columns(&mut cols, x, s, b, block, true);
            f(b, block, cols);
        }
    }
}

/// Image `b`'s columns for output rows `block` (`[Ci·kh·kw, block·Wo]`) in the front of `cols`,
/// their rows filled in parallel when `parallel`.
fn fill_columns<'a>(
    cols: &'a mut [f32],
    x: &[f32],
    s: &ConvShape,
    b: usize,
    block: &std::ops::Range<usize>,
    parallel: bool,
) -> &'a [f32] {
    let [_, ci, h, w] = s.input;
    let wo = s.output().map_or(0, |o| o[3]);
    let [_, kw] = s.kernel;
    let taps = s.kernel[0] * kw;
    let inner = block.len() * wo;
    let cols = &mut cols[..ci * taps * inner];
    let fill = |(r, row): (usize, &mut [f32])| {
        let (c, tap) = (r / taps, r % taps);
        let plane = &x[(b * ci + c) * h * w..][..h * w];
        fill_row(row, plane, s, tap / kw, tap % kw, block.clone(), wo);
    };
    if parallel {
        cols.par_chunks_mut(inner).enumerate().for_each(fill);
    } else {
        cols.chunks_mut(inner).enumerate().for_each(fill);
    }
    cols
}

/// The output rows `oh` of one block of columns: enough rows for [`MIN_INNER`] pixels, and
/// few enough that the block (`taps` rows of columns) stays near [`BLOCK_FLOATS`] floats.
pub(crate) fn row_blocks(rows: usize, ho: usize, wo: usize) -> Vec<std::ops::Range<usize>> {
    let target = (BLOCK_FLOATS / rows.max(1)).max(MIN_INNER);
    let per = target.div_ceil(wo.max(1)).clamp(1, ho.max(1));
    (0..ho).step_by(per).map(|r| r..(r + per).min(ho)).collect()
}

/// The weight gradient `[Co, Ci, kh, kw]` (row-major) of a convolution with shape `s`, from
/// its input `x` (`[N, Ci, H, W]`, row-major) and output gradient `dy` (`[N, Co, Ho, Wo]`):
/// Winograd's F(2x2, 3x3) for a 3x3 stride-1 convolution where
/// [`crate::winograd::weight_grad_pays`] (measured per shape and vector width; not with
/// `HEARTH_WINOGRAD=0`), else [`conv2d_weight_grad_shifted`] for stride 1 with a small weight
/// (wider kernels: at most 256 input and output channels together; 1x1: at most 2¹⁹ weights),
/// and [`conv2d_weight_grad_im2col`] otherwise (with each image its own partial sum where the
/// gradient has at most [`PARTIAL_FLOATS`] values: a stem's).
///
/// Where each won (`kernels/examples/conv_paths.rs`, batch 16, 2-core AVX-512, GFLOP/s
/// shifted against im2col): VGG-16's 64→64 on 224x224 256 against 90, 3→64 103 against 56,
/// 64→128 on 112x112 294 against 167, 128→128 297 against 232; ResNet-50's 64→64 on 56x56
/// 261 against 76, 128→128 on 28x28 280 against 218; DenseNet-121's 128→32 on 56 to 7 px
/// maps 109-198 against 63-98. With more channels im2col's one large product wins (128→256
/// on 56x56: 269 against 296; 512→512 on 7x7: 101 against 305). For 1x1 the images' split
/// into partial sums wins up to 1024→512 (ResNet-50's 256→64 on 56x56: 186 against 88;
/// 512→128 on 28x28: 269 against 172; DenseNet-121's 1x1 layers: 208-328 against 133-290)
/// and loses at 2048→512 on 7x7 (245 against 292).
///
/// Panics when the slices' lengths do not match `s` (callers pass Burn tensors whose shapes
/// Burn already checked).
pub fn conv2d_weight_grad(x: &[f32], dy: &[f32], s: &ConvShape) -> Vec<f32> {
    let [ci, co] = [s.input[1], s.out_channels];
    let small = if s.kernel == [1, 1] && s.padding == [0, 0] {
        ci * co <= 1 << 19
    } else {
        ci + co <= 256
    };
    if crate::base::winograd_enabled()
        && crate::winograd::applies(s)
        && crate::winograd::weight_grad_pays(s)
    {
        return crate::winograd::conv2d_weight_grad(x, dy, s);
    }
    // One image would be one partial sum on one thread.
    if shifted_applies(s) && small && s.input[0] >= 2 {
        conv2d_weight_grad_shifted(x, dy, s)
    } else {
        conv2d_weight_grad_im2col(x, dy, s)
    }
}

/// The weight gradient as im2col and one GEMM per block of columns (see the module's doc).
///
/// Panics when the slices' lengths do not match `s`.
pub fn conv2d_weight_grad_im2col(x: &[f32], dy: &[f32], s: &ConvShape) -> Vec<f32> {
    let [n, ci, h, w] = s.input;
    let [_, co, ho, wo] = s
        .output()
        .unwrap_or_else(|| panic!("conv weight gradient: kernel does not fit {s:?}"));
    assert_eq!(
        x.len(),
        n * ci * h * w,
        "conv weight gradient: input length for {s:?}"
    );
    assert_eq!(
        dy.len(),
        n * co * ho * wo,
        "conv weight gradient: output gradient length for {s:?}"
    );
    let [kh, kw] = s.kernel;
    let taps = kh * kw;
    let rows = ci * taps;
    let pixels = ho * wo;
    let mut dw = vec![0f32; co * rows];
    if n == 0 || pixels == 0 || rows == 0 || co == 0 {
        return dw;
    }
    if pixels >= MIN_INNER && n >= 2 && co * rows <= PARTIAL_FLOATS {
        per_image_partial_sums(x, dy, s, &mut dw);
        return dw;
    }
    let mut acc = Accumulator {
        dw: &mut dw,
        co,
        rows,
        started: false,
        parallelism: gemm::Parallelism::Rayon(0),
    };
    if pixels >= MIN_INNER {
        // Large maps: each image in blocks of output rows, so the columns stay small.
        for_each_column_block(x, s, |b, block, cols| {
            let lhs = &dy[b * co * pixels + block.start * wo..];
            acc.add(lhs, pixels, cols, block.len() * wo);
        });
        return dw;
    }
    // Small maps: chunks of images, so the inner dimension reaches MIN_INNER.
    let chunk = MIN_INNER.div_ceil(pixels).clamp(1, n);
    let mut cols = vec![0f32; rows * chunk * pixels];
    let mut dyc = vec![0f32; co * chunk * pixels];
    for b0 in (0..n).step_by(chunk) {
        let nb = chunk.min(n - b0);
        let inner = nb * pixels;
        let cols = &mut cols[..rows * inner];
        cols.par_chunks_mut(inner).enumerate().for_each(|(r, row)| {
            let (c, tap) = (r / taps, r % taps);
            for b in 0..nb {
                let plane = &x[((b0 + b) * ci + c) * h * w..][..h * w];
                let part = &mut row[b * pixels..(b + 1) * pixels];
                fill_row(part, plane, s, tap / kw, tap % kw, 0..ho, wo);
            }
        });
        // The chunk's output gradient as one [Co, nb·Ho·Wo] matrix (one image needs no copy).
        let lhs: &[f32] = if nb == 1 {
            &dy[b0 * co * pixels..(b0 + 1) * co * pixels]
        } else {
            let dyc = &mut dyc[..co * inner];
            dyc.par_chunks_mut(inner).enumerate().for_each(|(o, row)| {
                for b in 0..nb {
                    let src = &dy[((b0 + b) * co + o) * pixels..][..pixels];
                    row[b * pixels..(b + 1) * pixels].copy_from_slice(src);
                }
            });
            dyc
        };
        acc.add(lhs, inner, cols, inner);
    }
    dw
}

/// The most weight-gradient values for which [`conv2d_weight_grad_im2col`] gives each image
/// its own partial sum, on its own thread. Such a product (a stem's: 64 x 147 values over
/// 12544 pixels an image) has too few output blocks for gemm's threads to share, and each
/// image's columns are filled and then multiplied in turn: the 7x7 stride-2 stem's weight
/// gradient at batch 16 went from 84 to 44-47 ms (Zen 4, 2 cores). Batch 1 keeps the path before.
pub const PARTIAL_FLOATS: usize = 1 << 15;

/// `dw = Σ_b dWᵦ`, each image's `dWᵦ` computed on one thread from its own columns, the
/// partial sums added in image order (deterministic for any thread count).
fn per_image_partial_sums(x: &[f32], dy: &[f32], s: &ConvShape, dw: &mut [f32]) {
    let [n, ci, _, _] = s.input;
    let [_, co, ho, wo] = s.output().unwrap_or_default();
    let rows = ci * s.kernel[0] * s.kernel[1];
    let pixels = ho * wo;
    let blocks = row_blocks(rows, ho, wo);
    let largest = blocks.iter().map(|r| r.len()).max().unwrap_or(0) * wo;
    let partials: Vec<Vec<f32>> = (0..n)
        .into_par_iter()
        .map_init(
            || vec![0f32; rows * largest],
            |cols, b| {
                let mut part = vec![0f32; co * rows];
                let mut acc = Accumulator {
                    dw: &mut part,
                    co,
                    rows,
                    started: false,
                    parallelism: gemm::Parallelism::None,
                };
                for block in &blocks {
                    let cols = fill_columns(cols, x, s, b, block, false);
                    let lhs = &dy[b * co * pixels + block.start * wo..];
                    acc.add(lhs, pixels, cols, block.len() * wo);
                }
                part
            },
        )
        .collect();
    dw.par_chunks_mut(1024).enumerate().for_each(|(i, out)| {
        let at = i * 1024;
        out.fill(0.0);
        for part in &partials {
            for (o, &v) in out.iter_mut().zip(&part[at..]) {
                *o += v;
            }
        }
    });
}

/// `dW[Co, rows]` accumulating `lhs · colsᵀ` one block at a time.
struct Accumulator<'a> {
    dw: &'a mut [f32],
    co: usize,
    rows: usize,
    started: bool,
    /// gemm's threads for each product.
    parallelism: gemm::Parallelism,
}

impl Accumulator<'_> {
    /// `dW (+)= lhs[co, inner] · cols[rows, inner]ᵀ`, where `lhs` rows are `lhs_rs` apart.
    fn add(&mut self, lhs: &[f32], lhs_rs: usize, cols: &[f32], inner: usize) {
        assert!(
            lhs.len() >= (self.co - 1) * lhs_rs + inner && cols.len() >= self.rows * inner,
            "conv weight gradient: block sizes"
        );
        // SAFETY: dst is co x rows row-major (the assert in the caller sized it), lhs covers
        // co rows of `inner` values `lhs_rs` apart, cols is rows x inner row-major and is read
        // as its transpose; the assert above checks both.
        unsafe {
            gemm::gemm(
                self.co,
                self.rows,
                inner,
                self.dw.as_mut_ptr(),
                1,
                self.rows as isize,
                self.started,
                lhs.as_ptr(),
                1,
                lhs_rs as isize,
                cols.as_ptr(),
                inner as isize,
                1,
                1.0f32,
                1.0f32,
                false,
                false,
                false,
                self.parallelism,
            );
        }
        self.started = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_blocks_partition_the_output_rows() {
        for (rows, ho, wo) in [
            (1152, 40, 40),
            (576, 224, 224),
            (27, 224, 224),
            (4608, 7, 7),
            (9, 1, 1),
        ] {
            let blocks = row_blocks(rows, ho, wo);
            assert_eq!(blocks.first().map(|b| b.start), Some(0));
            assert_eq!(blocks.last().map(|b| b.end), Some(ho));
            for pair in blocks.windows(2) {
                assert_eq!(pair[0].end, pair[1].start);
            }
            // Every block but the last has at least MIN_INNER pixels, and blocks are no
            // longer than the budget needs.
            for b in &blocks[..blocks.len() - 1] {
                assert!(
                    b.len() * wo >= MIN_INNER.min(ho * wo),
                    "{rows} {ho}x{wo}: {b:?}"
                );
            }
        }
        assert_eq!(row_blocks(1152, 40, 40).len(), 1);
        assert_eq!(row_blocks(4608, 40, 40).len(), 2);
        assert!(row_blocks(576, 224, 224).len() >= 10);
    }

    #[test]
    fn valid_ranges_cover_exactly_the_inside_taps() {
        // Brute force over small geometries.
        for out in 0..6 {
            for stride in 1..4 {
                for offset in 0..5 {
                    for pad in 0..4 {
                        for len in 0..7 {
                            let (lo, hi) = valid_range(out, stride, offset, pad, len);
                            for o in 0..out {
                                let i = (o * stride + offset) as isize - pad as isize;
                                let inside = i >= 0 && i < len as isize;
                                assert_eq!(
                                    inside,
                                    (lo..hi).contains(&o),
                                    "out {out} stride {stride} offset {offset} pad {pad} len {len} o {o}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
