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

/// The smallest inner dimension (images x output pixels) one GEMM call gets, where the batch
/// allows it.
pub const MIN_INNER: usize = 1024;

/// About how many floats one block of columns holds (8 MiB) when an image's columns would be
/// larger: VGG-16's first layers have 576 x 50176-float columns per image, whose writing and
/// reading from memory (and the page faults of a fresh buffer) cost more than the GEMM.
pub const BLOCK_FLOATS: usize = 1 << 21;

/// Convolution geometry passed through the extension (stride, padding, dilation).
pub type Geometry2 = [[usize; 2]; 3];

/// The shape of a convolution of an `input` by a `weight` of these dims.
pub(crate) fn conv_shape(
    input: [usize; 4],
    weight: [usize; 4],
    [stride, padding, dilation]: Geometry2,
) -> ConvShape {
    ConvShape {
        input,
        out_channels: weight[0],
        kernel: [weight[2], weight[3]],
        stride,
        padding,
        dilation,
    }
}

/// The geometry of the convolution whose weight gradient is wanted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConvShape {
    /// Input `[N, Ci, H, W]`.
    pub input: [usize; 4],
    /// Output channels.
    pub out_channels: usize,
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
}

impl ConvShape {
    /// The output side along axis 0 (rows) or 1 (columns); `None` when the kernel does not fit.
    pub fn out_side(&self, axis: usize) -> Option<usize> {
        let input = self.input[2 + axis] + 2 * self.padding[axis];
        let span = self.dilation[axis] * (self.kernel[axis].max(1) - 1) + 1;
        (input >= span && self.stride[axis] > 0).then(|| (input - span) / self.stride[axis] + 1)
    }

    /// The input rows and columns a strided convolution with output `out` left unread at the
    /// far edge: a transposed convolution computing the input gradient gives them back (zero
    /// gradient) to restore the input's size (its `padding_out`).
    pub fn unread_edge(&self, out: [usize; 4]) -> [usize; 2] {
        std::array::from_fn(|a| {
            let reach = self.dilation[a] * (self.kernel[a] - 1) + 1;
            let covered = (out[2 + a].max(1) - 1) * self.stride[a] + reach;
            (self.input[2 + a] + 2 * self.padding[a]).saturating_sub(covered)
        })
    }

    /// `[N, Co, Ho, Wo]`, or `None` when the kernel does not fit.
    pub fn output(&self) -> Option<[usize; 4]> {
        Some([
            self.input[0],
            self.out_channels,
            self.out_side(0)?,
            self.out_side(1)?,
        ])
    }

    /// `[Co, Ci, kh, kw]`.
    pub fn weight(&self) -> [usize; 4] {
        [
            self.out_channels,
            self.input[1],
            self.kernel[0],
            self.kernel[1],
        ]
    }
}

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
    let [_, _, h, w] = s.input;
    let ho_end = out_rows.end;
    let (oh_lo, oh_hi) = valid_range(ho_end, s.stride[0], ki * s.dilation[0], s.padding[0], h);
    let (oh_lo, oh_hi) = (oh_lo.max(out_rows.start), oh_hi.max(out_rows.start));
    let (ow_lo, ow_hi) = valid_range(wo, s.stride[1], kj * s.dilation[1], s.padding[1], w);
    let base = out_rows.start;
    row[..(oh_lo - base) * wo].fill(0.0);
    row[(oh_hi - base) * wo..].fill(0.0);
    for oh in oh_lo..oh_hi {
        let ih = oh * s.stride[0] + ki * s.dilation[0] - s.padding[0];
        let src = &plane[ih * w..(ih + 1) * w];
        let dst = &mut row[(oh - base) * wo..(oh - base + 1) * wo];
        dst[..ow_lo].fill(0.0);
        dst[ow_hi..].fill(0.0);
        if ow_lo == ow_hi {
            continue;
        }
        let first = ow_lo * s.stride[1] + kj * s.dilation[1] - s.padding[1];
        if s.stride[1] == 1 {
            dst[ow_lo..ow_hi].copy_from_slice(&src[first..first + (ow_hi - ow_lo)]);
        } else {
            for (k, d) in dst[ow_lo..ow_hi].iter_mut().enumerate() {
                *d = src[first + k * s.stride[1]];
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
    let [n, ci, h, w] = s.input;
    let Some([_, _, ho, wo]) = s.output() else {
        return;
    };
    let [_, kw] = s.kernel;
    let taps = s.kernel[0] * kw;
    let rows = ci * taps;
    let blocks = row_blocks(rows, ho, wo);
    let largest = blocks.iter().map(|r| r.len()).max().unwrap_or(0) * wo;
    let mut cols = vec![0f32; rows * largest];
    for b in 0..n {
        for block in &blocks {
            let inner = block.len() * wo;
            let cols = &mut cols[..rows * inner];
            cols.par_chunks_mut(inner).enumerate().for_each(|(r, row)| {
                let (c, tap) = (r / taps, r % taps);
                let plane = &x[(b * ci + c) * h * w..][..h * w];
                fill_row(row, plane, s, tap / kw, tap % kw, block.clone(), wo);
            });
            f(b, block, cols);
        }
    }
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
/// [`conv2d_weight_grad_shifted`] for stride 1 with a small weight (wider kernels: at most
/// 256 input and output channels together; 1x1: at most 2¹⁹ weights), and
/// [`conv2d_weight_grad_im2col`] otherwise.
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
    let mut acc = Accumulator {
        dw: &mut dw,
        co,
        rows,
        started: false,
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

/// Whether [`conv2d_weight_grad_shifted`] computes the weight gradient of `s`: stride 1,
/// dilation 1.
pub fn shifted_applies(s: &ConvShape) -> bool {
    s.stride == [1, 1] && s.dilation == [1, 1] && s.output().is_some()
}

/// How many consecutive images one partial sum of [`conv2d_weight_grad_shifted`] holds. Fixed,
/// so a part's value depends on its images alone: a batch's gradient and the sum of its
/// halves' (a pipeline's micro-batches, data-parallel ranks, when their sizes are multiples of
/// it) add the same parts, in another grouping only, and nothing depends on the number of
/// threads or on timing.
pub const SHIFTED_RUN: usize = 4;

/// The weight gradient of a stride-1 convolution without im2col: with the input zero-padded
/// (`Xp`, rows of `Wp = W + 2·pw`) and the output gradient laid out on the same rows (`dYp`,
/// zero in the `kw - 1` columns past `Wo`), the tap `(i, j)` is one matrix product over the
/// flat pixel index `q`:
///
/// `dW[:, :, i, j] = Σ_q dYp[:, q] · Xp[:, q + i·Wp + j]ᵀ`
///
/// where the columns past `Wo` contribute nothing. The input is copied once (padded) instead
/// of `kh·kw` times, and each chunk of pixels is read by the `kh·kw` products while it is in
/// the cache. Images are summed in runs of [`SHIFTED_RUN`], the runs on the threads in
/// parallel, and the runs' sums added in order.
///
/// Where the output has fewer channels than the input and the kernel more than one tap, both
/// copies are channels-last (`[pixel][channel]`) instead: the products' depth is the pixels,
/// and gemm packs its operands along the depth, which from `[channel][pixel]` rows is a
/// gather, once per tap; a transpose once per image makes those reads contiguous, and the
/// shift by a tap stays a pointer offset. Measured against the plain copies side by side
/// (batch 16, AVX2 Zen 3, GFLOP/s, best of 7, two runs): DenseNet-121's 128→32 3x3 on 56 to
/// 14 px maps 71-87 against 59-78, on 7x7 58-62 against 42-43; with the channels-last copies
/// forced everywhere, 1x1 layers lost to the transpose (DenseNet-121's 160→128 on 56x56: 52-61
/// against 80-83), and as many output channels as input lost or tied (ResNet-50's 64→64 on
/// 56x56: 78-85 against 84-91), those two measured before the sums were kept per tap.
/// `kernels/examples/conv_paths.rs` times this function per shape ("weight grad shifted").
///
/// Panics where [`shifted_applies`] is false or the slices' lengths do not match `s`.
pub fn conv2d_weight_grad_shifted(x: &[f32], dy: &[f32], s: &ConvShape) -> Vec<f32> {
    assert!(shifted_applies(s), "shifted weight gradient: {s:?}");
    let [n, ci, h, w] = s.input;
    let [_, co, ho, wo] = s.output().unwrap_or_default();
    assert_eq!(x.len(), n * ci * h * w, "shifted weight gradient: input");
    assert_eq!(
        dy.len(),
        n * co * ho * wo,
        "shifted weight gradient: output gradient"
    );
    let [kh, kw] = s.kernel;
    let [ph, pw] = s.padding;
    let (hp, wp) = (h + 2 * ph, w + 2 * pw);
    let taps = kh * kw;
    // The last tap reads up to `kw - 2` values past the padded image.
    let plane = hp * wp + kw;
    let len = ho * wp;
    let reach = (kh - 1) * wp + kw - 1;
    // Pixels per chunk: its dYp and Xp rows together near 1 MiB.
    let chunk = ((1usize << 18).saturating_sub(ci * reach) / (co + ci).max(1)).clamp(512, 8192);
    let channels_last = taps > 1 && co < ci;
    // A 1x1 kernel without padding reads the image and its gradient where they are: the rows
    // need no padding, so Xp and dYp would be copies of them. Against copying, side by side
    // (batch 16, AVX2 Zen 3, GFLOP/s): DenseNet-121's 1x1 layers 96-108 against 85-94 on 56x56
    // down to 55-56 against 50-51 on 7x7, ResNet-50's 256→64 on 56x56 95-97 against 74-77.
    let in_place = taps == 1 && s.padding == [0, 0];
    // How far apart a pixel's and a channel's values lie in Xp and in dYp.
    let ([x_pixel, x_channel], [dy_pixel, dy_channel]) = if channels_last {
        ([ci, 1], [co, 1])
    } else if in_place {
        ([1, h * w], [1, ho * wo])
    } else {
        ([1, plane], [1, len])
    };
    // Where tap `t`'s `[ci][co]` block starts in a sum and how far apart its rows and columns
    // are: channels-last sums as `[tap][co][ci]` (each product writes one contiguous block;
    // strided by the taps it cost 5-30% on 14x14 and 7x7 maps), permuted to the weight's
    // `[co][ci][tap]` at the end; the plain copies sum in the weight's layout.
    let (tap_at, [dw_row, dw_col]) = if channels_last {
        (co * ci, [1, ci])
    } else {
        (1, [taps, ci * taps])
    };
    let mut dw = vec![0f32; co * ci * taps];
    if n == 0 || len == 0 || co * ci == 0 {
        return dw;
    }
    let runs: Vec<std::ops::Range<usize>> = (0..n)
        .step_by(SHIFTED_RUN)
        .map(|b| b..(b + SHIFTED_RUN).min(n))
        .collect();
    let threads = rayon::current_num_threads().max(1);
    // Waves of one run per thread, so that as many partial sums as threads are held at once.
    for wave in runs.chunks(threads) {
        let partials: Vec<Vec<f32>> = wave
            .par_iter()
            .map_init(
                // Zero once: the borders and the columns past Wo are never written.
                || {
                    if in_place {
                        (Vec::new(), Vec::new())
                    } else {
                        (vec![0f32; ci * plane], vec![0f32; co * len])
                    }
                },
                |(xp, dyp), run| {
                    let mut dw = vec![0f32; co * ci * taps];
                    let mut started = false;
                    for b in run.clone() {
                        let image = &x[b * ci * h * w..][..ci * h * w];
                        let grad = &dy[b * co * ho * wo..][..co * ho * wo];
                        if channels_last {
                            to_channels_last(xp, image, ci, [h, w], ph * wp + pw, wp);
                            to_channels_last(dyp, grad, co, [ho, wo], 0, wp);
                        } else if !in_place {
                            for c in 0..ci {
                                let dst = &mut xp[c * plane..][..plane];
                                copy_rows(
                                    dst,
                                    &image[c * h * w..][..h * w],
                                    h,
                                    w,
                                    ph * wp + pw,
                                    wp,
                                );
                            }
                            for o in 0..co {
                                let dst = &mut dyp[o * len..][..len];
                                copy_rows(dst, &grad[o * ho * wo..][..ho * wo], ho, wo, 0, wp);
                            }
                        }
                        let (xs, ys): (&[f32], &[f32]) =
                            if in_place { (image, grad) } else { (xp, dyp) };
                        for q0 in (0..len).step_by(chunk) {
                            let k = chunk.min(len - q0);
                            for tap in 0..taps {
                                let off = (tap / kw) * wp + tap % kw;
                                // SAFETY: dst is the tap's ci x co block of dw (co·ci·taps
                                // long, either layout); lhs reads ci channels of xs at pixels
                                // q0+off..q0+off+k <= len + reach = ho·wp + (kh-1)·wp + kw - 1
                                // = hp·wp + kw - 1 <= plane (in place: off = 0 and len = h·w,
                                // a channel's plane); rhs reads co channels of ys at pixels
                                // q0..q0+k <= len.
                                unsafe {
                                    gemm::gemm(
                                        ci,
                                        co,
                                        k,
                                        dw.as_mut_ptr().add(tap * tap_at),
                                        dw_col as isize,
                                        dw_row as isize,
                                        started,
                                        xs.as_ptr().add((q0 + off) * x_pixel),
                                        x_pixel as isize,
                                        x_channel as isize,
                                        ys.as_ptr().add(q0 * dy_pixel),
                                        dy_channel as isize,
                                        dy_pixel as isize,
                                        1.0f32,
                                        1.0f32,
                                        false,
                                        false,
                                        false,
                                        gemm::Parallelism::None,
                                    );
                                }
                            }
                            started = true;
                        }
                    }
                    dw
                },
            )
            .collect();
        for p in partials {
            for (a, b) in dw.iter_mut().zip(&p) {
                *a += b;
            }
        }
    }
    if !channels_last {
        return dw;
    }
    let mut weight_order = vec![0f32; co * ci * taps];
    for (tap, block) in dw.chunks_exact(co * ci).enumerate() {
        for (i, &v) in block.iter().enumerate() {
            weight_order[i * taps + tap] = v;
        }
    }
    weight_order
}

/// Copies `rows` rows of `width` values, packed in `src`, into `dst` at `at + r·stride`.
#[inline]
fn copy_rows(dst: &mut [f32], src: &[f32], rows: usize, width: usize, at: usize, stride: usize) {
    for r in 0..rows {
        dst[at + r * stride..][..width].copy_from_slice(&src[r * width..][..width]);
    }
}

/// Writes `channels` planes of `rows x width` values (`src`, `[channel][row][column]`) into
/// `dst` as `[pixel][channel]`, pixel `at + r·stride + column` for row `r`; other pixels are
/// left as they are.
///
/// In blocks of 8 channels by 8 pixels, transposed in registers where the CPU has AVX: a
/// channel at a time over a whole row (each store to another cache line) took half of a 1x1
/// weight gradient's time, and scalar 8x8 blocks a quarter.
fn to_channels_last(
    dst: &mut [f32],
    src: &[f32],
    channels: usize,
    [rows, width]: [usize; 2],
    at: usize,
    stride: usize,
) {
    let area = rows * width;
    if area == 0 || channels == 0 {
        return;
    }
    assert!(
        src.len() >= channels * area && dst.len() >= (at + (rows - 1) * stride + width) * channels,
        "to_channels_last: sizes"
    );
    #[cfg(target_arch = "x86_64")]
    let avx = std::arch::is_x86_feature_detected!("avx");
    #[cfg(not(target_arch = "x86_64"))]
    let avx = false;
    let (full_c, full_p) = (channels / 8 * 8, width / 8 * 8);
    for r in 0..rows {
        let line = (at + r * stride) * channels;
        for c0 in (0..channels).step_by(8) {
            for p0 in (0..width).step_by(8) {
                let from = c0 * area + r * width + p0;
                let to = line + p0 * channels + c0;
                if avx && c0 < full_c && p0 < full_p {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: AVX is present; the 8 rows of 8 read start at `from + i·area`
                    // (channel c0 + i < channels, pixels p0..p0+8 <= width of row r) and the 8
                    // written at `to + j·channels` (pixel p0 + j of the row, channels
                    // c0..c0+8 <= channels), inside the slices by the assert above.
                    unsafe {
                        transpose8x8(
                            src.as_ptr().add(from),
                            area,
                            dst.as_mut_ptr().add(to),
                            channels,
                        )
                    };
                    continue;
                }
                for c in 0..8.min(channels - c0) {
                    for p in 0..8.min(width - p0) {
                        dst[to + p * channels + c] = src[from + c * area + p];
                    }
                }
            }
        }
    }
}

/// `dst[j·dst_stride + i] = src[i·src_stride + j]` for `i, j < 8`.
///
/// # Safety
/// The CPU has AVX; `src` covers 8 rows of 8 values `src_stride` apart, `dst` 8 rows of 8
/// values `dst_stride` apart.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn transpose8x8(src: *const f32, src_stride: usize, dst: *mut f32, dst_stride: usize) {
    use std::arch::x86_64::*;
    // SAFETY: forwarded from the caller.
    unsafe {
        let r = |i: usize| _mm256_loadu_ps(src.add(i * src_stride));
        let (r0, r1, r2, r3) = (r(0), r(1), r(2), r(3));
        let (r4, r5, r6, r7) = (r(4), r(5), r(6), r(7));
        let t0 = _mm256_unpacklo_ps(r0, r1);
        let t1 = _mm256_unpackhi_ps(r0, r1);
        let t2 = _mm256_unpacklo_ps(r2, r3);
        let t3 = _mm256_unpackhi_ps(r2, r3);
        let t4 = _mm256_unpacklo_ps(r4, r5);
        let t5 = _mm256_unpackhi_ps(r4, r5);
        let t6 = _mm256_unpacklo_ps(r6, r7);
        let t7 = _mm256_unpackhi_ps(r6, r7);
        let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        let w = |j: usize, v| _mm256_storeu_ps(dst.add(j * dst_stride), v);
        w(0, _mm256_permute2f128_ps::<0x20>(s0, s4));
        w(1, _mm256_permute2f128_ps::<0x20>(s1, s5));
        w(2, _mm256_permute2f128_ps::<0x20>(s2, s6));
        w(3, _mm256_permute2f128_ps::<0x20>(s3, s7));
        w(4, _mm256_permute2f128_ps::<0x31>(s0, s4));
        w(5, _mm256_permute2f128_ps::<0x31>(s1, s5));
        w(6, _mm256_permute2f128_ps::<0x31>(s2, s6));
        w(7, _mm256_permute2f128_ps::<0x31>(s3, s7));
    }
}

/// `dW[Co, rows]` accumulating `lhs · colsᵀ` one block at a time.
struct Accumulator<'a> {
    dw: &'a mut [f32],
    co: usize,
    rows: usize,
    started: bool,
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
                gemm::Parallelism::Rayon(0),
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
