//! A 2-D convolution's forward pass and input gradient (one group) as im2col / col2im around
//! one GEMM per image, on plain `f32` slices, in the layouts of [`crate::weight_grad`]:
//!
//! - forward: `Yₙ[Co, Ho·Wo] = W[Co, Ci·kh·kw] · colsₙ[Ci·kh·kw, Ho·Wo]`;
//! - input gradient: `dcolsₙ = Wᵀ · dYₙ`, then col2im adds every tap back onto the input
//!   pixel it came from;
//! - or, for a stride of 1, the input gradient as a forward convolution of `dY` with the
//!   kernel flipped and its channel axes swapped ([`conv2d_input_grad_as_conv`]): its columns
//!   have `Co·kh·kw` rows where col2im scatters `Ci·kh·kw`, which wins where `Co < Ci`
//!   (DenseNet's 128→32 3x3: Flex's transposed convolution spends most of its time scattering).
//!
//! A 1x1 convolution with stride 1 and no padding needs no columns: the image is the matrix.
//! Burn Flex converts every input to channels-last and builds its columns in tiles of 512
//! pixels; measured per ResNet-50 shape in `kernels/examples/conv_paths.rs`.

use rayon::prelude::*;

use crate::base::{Out, gemm_rows};
use crate::epilogue::Epilogue;
use crate::weight_grad::{ConvShape, fill_row_into, row_blocks};

fn is_plain_pointwise(s: &ConvShape) -> bool {
    s.kernel == [1, 1] && s.stride == [1, 1] && s.padding == [0, 0]
}

/// Pieces of work for the threads: with one image, split it so that there are up to two per
/// thread (gemm's own threading splits one thin product poorly, `conv_paths`), but keep each
/// at least this many output pixels.
const MIN_PIECE_PIXELS: usize = 256;

/// Column ranges of `pixels` output pixels for `n` images: the whole image when there are two
/// or more, else as many pieces of at least [`MIN_PIECE_PIXELS`] as fit, up to two per thread
/// and a multiple of the threads, of about equal width (multiples of 16). ResNet-50's 28x28
/// maps had been cut 256, 256, 256, 16: three pieces' work on one thread, one on the other
/// (512→128 at batch 1: 158-168 GFLOP/s against Flex's 194, `conv_paths`).
fn column_pieces(n: usize, pixels: usize) -> Vec<std::ops::Range<usize>> {
    let per = if n >= 2 {
        pixels
    } else {
        let threads = rayon::current_num_threads().max(1);
        let fit = (pixels / MIN_PIECE_PIXELS).min(2 * threads);
        let pieces = if fit >= threads {
            fit - fit % threads
        } else {
            fit.max(1)
        };
        pixels.div_ceil(pieces).next_multiple_of(16)
    };
    (0..pixels)
        .step_by(per.max(1))
        .map(|p| p..(p + per).min(pixels))
        .collect()
}

/// With one image, about how many floats of columns one piece of output rows gets: the
/// weight is packed once per piece, so pieces want to be large, and their columns are written
/// and then read back, so they want to fit the caches. Measured on VGG-16's 3x3 layers at
/// batch 1 (`kernels/examples/forward_b1.rs`, 2-core Zen 5): a budget of 2²⁰ floats (4 MiB)
/// took the thirteen convolutions from 89-117 ms to 81-93 ms against the earlier split (about
/// two pieces per thread, each up to [`BLOCK_FLOATS`](crate::weight_grad::BLOCK_FLOATS));
/// 2¹⁹ and 2²¹ were slower.
const ONE_IMAGE_PIECE_FLOATS: usize = 1 << 20;

/// Output row blocks for `n` images of `ho x wo` outputs whose columns have `rows` rows: with
/// two images or more, [`row_blocks`] (images in parallel); with one, pieces of about
/// [`ONE_IMAGE_PIECE_FLOATS`] floats of columns, as many as a multiple of the thread count so
/// that no thread waits on the last piece, and at most one per output row.
fn row_pieces(n: usize, rows: usize, ho: usize, wo: usize) -> Vec<std::ops::Range<usize>> {
    if n >= 2 {
        return row_blocks(rows, ho, wo);
    }
    let threads = rayon::current_num_threads().max(1);
    let pixels_per_piece = (ONE_IMAGE_PIECE_FLOATS / rows.max(1)).max(1);
    let pieces = (ho * wo)
        .div_ceil(pixels_per_piece)
        .next_multiple_of(threads)
        .clamp(1, ho.max(1));
    let per = ho.div_ceil(pieces).max(1);
    (0..ho).step_by(per).map(|r| r..(r + per).min(ho)).collect()
}

/// Runs `piece(b, range)` for every image `b` and every range of `ranges`, in parallel when
/// there are two pieces or more, each product then on its thread (`Parallelism::None`); a
/// single piece gets gemm's threads.
fn for_pieces(
    n: usize,
    ranges: &[std::ops::Range<usize>],
    piece: impl Fn(usize, std::ops::Range<usize>, gemm::Parallelism) + Sync,
) {
    let items: Vec<(usize, std::ops::Range<usize>)> = (0..n)
        .flat_map(|b| ranges.iter().map(move |r| (b, r.clone())))
        .collect();
    if items.len() >= 2 {
        items
            .into_par_iter()
            .for_each(|(b, r)| piece(b, r, gemm::Parallelism::None));
    } else {
        for (b, r) in items {
            piece(b, r, gemm::Parallelism::Rayon(0));
        }
    }
}

/// The forward pass `[N, Co, Ho, Wo]` of `x` (`[N, Ci, H, W]`) with `weight` (`[Co, Ci, kh,
/// kw]`), all row-major: Winograd's F(2x2, 3x3) where it applies and measured faster
/// ([`crate::winograd`], unless `HEARTH_WINOGRAD=0`), else [`conv2d_forward_im2col`].
///
/// Panics when the lengths do not match `s` (callers pass Burn tensors Burn has checked).
pub fn conv2d_forward(x: &[f32], weight: &[f32], s: &ConvShape) -> Vec<f32> {
    forward_then(x, weight, s, None)
}

/// [`conv2d_forward`], each piece of the output through `epi` as soon as it is computed.
pub(crate) fn forward_then(
    x: &[f32],
    weight: &[f32],
    s: &ConvShape,
    epi: Option<&Epilogue>,
) -> Vec<f32> {
    use crate::winograd;
    if winograd::takes(s) {
        return winograd::forward_then(x, weight, s, winograd::BAND_FLOATS, epi);
    }
    im2col_then(x, weight, s, epi)
}

/// The forward pass as im2col and one GEMM per piece of output rows (1x1 with stride 1 and no
/// padding: the image is the matrix).
///
/// Panics when the lengths do not match `s`.
pub fn conv2d_forward_im2col(x: &[f32], weight: &[f32], s: &ConvShape) -> Vec<f32> {
    im2col_then(x, weight, s, None)
}

/// [`conv2d_forward_im2col`], each piece of the output through `epi`.
fn im2col_then(x: &[f32], weight: &[f32], s: &ConvShape, epi: Option<&Epilogue>) -> Vec<f32> {
    let [n, ci, h, w] = s.input;
    let [_, co, ho, wo] = s
        .output()
        .unwrap_or_else(|| panic!("conv forward: kernel does not fit {s:?}"));
    let rows = ci * s.kernel[0] * s.kernel[1];
    assert_eq!(
        x.len(),
        n * ci * h * w,
        "conv forward: input length for {s:?}"
    );
    assert_eq!(
        weight.len(),
        co * rows,
        "conv forward: weight length for {s:?}"
    );
    let pixels = ho * wo;
    if pixels == 0 || co == 0 || rows == 0 {
        let mut y = vec![0f32; n * co * pixels];
        if let Some(epi) = epi {
            // No input: every output is the epilogue of zero.
            let out = Out(y.as_mut_ptr());
            for b in 0..n {
                // SAFETY: the whole (zeroed) output, only here.
                unsafe { epi.apply_block(out, [b, co, pixels], 0..co, 0..pixels, false) };
            }
        }
        return y;
    }
    // SAFETY: the pieces below partition the images and their output rows (or, 1x1, their
    // columns), and each piece's GEMM writes its part of every output channel without reading
    // it (`gemm_rows` does not read the destination).
    unsafe { crate::base::written_by(n * co * pixels, |out| forward_into(x, weight, s, out, epi)) }
}

/// [`conv2d_forward_im2col`]'s work, writing every value of the output at `out`.
fn forward_into(x: &[f32], weight: &[f32], s: &ConvShape, out: Out, epi: Option<&Epilogue>) {
    let [n, ci, h, w] = s.input;
    let [_, co, ho, wo] = s.output().unwrap_or_default();
    let rows = ci * s.kernel[0] * s.kernel[1];
    let pixels = ho * wo;
    if is_plain_pointwise(s) {
        pointwise_products(n, [co, ci], pixels, weight, [1, ci], x, out, epi);
        return;
    }
    // Pieces of output rows, each with its own columns (im2col): images in parallel, one image
    // split by rows (`row_pieces`).
    let [kh, kw] = s.kernel;
    let taps = kh * kw;
    let blocks = row_pieces(n, rows, ho, wo);
    let largest = blocks.iter().map(|r| r.len()).max().unwrap_or(0) * wo;
    // The columns' buffer is not zeroed first: every value the product reads is written by
    // `fill_row_into` (a memset of megabytes per call, on one thread, at batch 1).
    type Columns = Box<[std::mem::MaybeUninit<f32>]>;
    let fill_and_multiply = |cols: &mut Columns, b: usize, block: std::ops::Range<usize>, par| {
        let inner = block.len() * wo;
        let cols = &mut cols[..rows * inner];
        let fill = |(r, row): (usize, &mut [std::mem::MaybeUninit<f32>])| {
            let (c, tap) = (r / taps, r % taps);
            let plane = &x[(b * ci + c) * h * w..][..h * w];
            fill_row_into(row, plane, s, tap / kw, tap % kw, block.clone(), wo);
        };
        if matches!(par, gemm::Parallelism::None) {
            cols.chunks_mut(inner).enumerate().for_each(fill);
        } else {
            cols.par_chunks_mut(inner).enumerate().for_each(fill);
        }
        // SAFETY: the piece writes rows `block` of every channel of image b's co x pixels
        // output (no other piece does), from the weight (co x rows) and its columns (rows x
        // inner, every value written just above), all row-major.
        unsafe {
            gemm_rows(
                co,
                inner,
                rows,
                out.at(b * co * pixels + block.start * wo),
                pixels,
                weight.as_ptr(),
                1,
                rows,
                cols.as_ptr().cast::<f32>(),
                inner,
                par,
            );
        }
        if let Some(epi) = epi {
            let at = block.start * wo;
            let parallel = !matches!(par, gemm::Parallelism::None);
            // SAFETY: the values the product above wrote, which no other piece touches.
            unsafe { epi.apply_block(out, [b, co, pixels], 0..co, at..at + inner, parallel) };
        }
    };
    let items: Vec<(usize, std::ops::Range<usize>)> = (0..n)
        .flat_map(|b| blocks.iter().map(move |r| (b, r.clone())))
        .collect();
    if items.len() >= 2 {
        items.into_par_iter().for_each_init(
            || Box::<[f32]>::new_uninit_slice(rows * largest),
            |cols, (b, block)| fill_and_multiply(cols, b, block, gemm::Parallelism::None),
        );
    } else {
        let mut cols = Box::<[f32]>::new_uninit_slice(rows * largest);
        for (b, block) in items {
            fill_and_multiply(&mut cols, b, block, gemm::Parallelism::Rayon(0));
        }
    }
}

/// Adds the columns `[Ci·kh·kw, Ho·Wo]` of image `b` back onto `dx` (`[N, Ci, H, W]`).
fn col2im(dcols: &[f32], b: usize, s: &ConvShape, ho: usize, wo: usize, dx: &mut [f32]) {
    let [_, ci, h, w] = s.input;
    let [kh, kw] = s.kernel;
    let pixels = ho * wo;
    let image = &mut dx[b * ci * h * w..(b + 1) * ci * h * w];
    image
        .par_chunks_mut(h * w)
        .enumerate()
        .for_each(|(c, plane)| {
            for i in 0..kh {
                for j in 0..kw {
                    let row = &dcols[((c * kh + i) * kw + j) * pixels..][..pixels];
                    for oh in 0..ho {
                        let ih =
                            (oh * s.stride[0] + i * s.dilation[0]) as isize - s.padding[0] as isize;
                        if ih < 0 || ih >= h as isize {
                            continue;
                        }
                        let dst = &mut plane[ih as usize * w..][..w];
                        let src = &row[oh * wo..(oh + 1) * wo];
                        for (ow, &g) in src.iter().enumerate() {
                            let iw = (ow * s.stride[1] + j * s.dilation[1]) as isize
                                - s.padding[1] as isize;
                            if iw >= 0 && iw < w as isize {
                                dst[iw as usize] += g;
                            }
                        }
                    }
                }
            }
        });
}

/// The input gradient `[N, Ci, H, W]` for the output gradient `dy` (`[N, Co, Ho, Wo]`).
pub fn conv2d_input_grad(weight: &[f32], dy: &[f32], s: &ConvShape) -> Vec<f32> {
    let [n, ci, h, w] = s.input;
    let [_, co, ho, wo] = s
        .output()
        .unwrap_or_else(|| panic!("conv input gradient: kernel does not fit {s:?}"));
    let rows = ci * s.kernel[0] * s.kernel[1];
    let pixels = ho * wo;
    assert_eq!(
        weight.len(),
        co * rows,
        "conv input gradient: weight length for {s:?}"
    );
    assert_eq!(
        dy.len(),
        n * co * pixels,
        "conv input gradient: output gradient length for {s:?}"
    );
    if pixels == 0 || co == 0 || rows == 0 {
        return vec![0f32; n * ci * h * w];
    }
    if is_plain_pointwise(s) {
        // SAFETY: the pieces partition the images' columns, and each piece's GEMM writes its
        // columns of every input channel without reading them.
        return unsafe {
            crate::base::written_by(n * ci * pixels, |out| {
                pointwise_products(n, [ci, co], pixels, weight, [ci, 1], dy, out, None)
            })
        };
    }
    let mut dx = vec![0f32; n * ci * h * w];
    let mut dcols = vec![0f32; rows * pixels];
    for b in 0..n {
        let g = &dy[b * co * pixels..(b + 1) * co * pixels];
        // SAFETY: dcols is rows x pixels, the weight read transposed is
        // rows x co (column stride `rows`), g is co x pixels, all row-major.
        unsafe {
            gemm_rows(
                rows,
                pixels,
                co,
                dcols.as_mut_ptr(),
                pixels,
                weight.as_ptr(),
                rows,
                1,
                g.as_ptr(),
                pixels,
                gemm::Parallelism::Rayon(0),
            );
        }
        col2im(&dcols, b, s, ho, wo, &mut dx);
    }
    dx
}

/// `outₙ[m, pixels] = W · srcₙ[k, pixels]` for each of `n` images, `W` an `m x k` matrix read
/// with column and row strides `[w_cs, w_rs]` (a 1x1 convolution's forward reads the weight as it
/// is, its input gradient transposed), writing every value at `out`: images in parallel, or
/// one image's columns in pieces ([`column_pieces`]), or, where that leaves one piece, its
/// rows ([`one_image_row_pieces`]).
#[allow(clippy::too_many_arguments)]
fn pointwise_products(
    n: usize,
    [m, k]: [usize; 2],
    pixels: usize,
    weight: &[f32],
    [w_cs, w_rs]: [usize; 2],
    src: &[f32],
    out: Out,
    epi: Option<&Epilogue>,
) {
    let columns = column_pieces(n, pixels);
    if n == 1 && columns.len() == 1 {
        for_pieces(1, &one_image_row_pieces(m), |_, r, parallelism| {
            // SAFETY: the piece writes rows `r` of the image's m x pixels output (no other
            // piece does), from those rows of the weight (m x k with the given strides) and
            // the image's k x pixels source, all row-major.
            unsafe {
                gemm_rows(
                    r.len(),
                    pixels,
                    k,
                    out.at(r.start * pixels),
                    pixels,
                    weight[r.start * w_rs..].as_ptr(),
                    w_cs,
                    w_rs,
                    src.as_ptr(),
                    pixels,
                    parallelism,
                );
            }
            if let Some(epi) = epi {
                let parallel = !matches!(parallelism, gemm::Parallelism::None);
                // SAFETY: the rows the product above wrote, which no other piece touches.
                unsafe { epi.apply_block(out, [0, m, pixels], r, 0..pixels, parallel) };
            }
        });
        return;
    }
    for_pieces(n, &columns, |b, cols, parallelism| {
        // SAFETY: the piece writes columns `cols` of image b's m x pixels output (no other
        // piece does), from the weight (m x k with the given strides) and those columns of
        // image b's k x pixels source, all row-major.
        unsafe {
            gemm_rows(
                m,
                cols.len(),
                k,
                out.at(b * m * pixels + cols.start),
                pixels,
                weight.as_ptr(),
                w_cs,
                w_rs,
                src[b * k * pixels + cols.start..].as_ptr(),
                pixels,
                parallelism,
            );
        }
        if let Some(epi) = epi {
            let parallel = !matches!(parallelism, gemm::Parallelism::None);
            // SAFETY: the columns the product above wrote, which no other piece touches.
            unsafe { epi.apply_block(out, [b, m, pixels], 0..m, cols, parallel) };
        }
    });
}

/// Rows of one image's product too narrow for [`column_pieces`] (1x1 convolutions on 14x14
/// and 7x7 maps at batch 1): as many pieces as threads, of a multiple of 16 rows, so that
/// each thread packs its share of the weight once (gemm's own threading split these products
/// with one core waiting, `perf` on ResNet-50 at batch 1). Every output value is the same
/// chain of multiply-adds over `k` whichever rows its piece holds (gemm blocks `k` by `k`
/// alone), so the bits are those of one product.
fn one_image_row_pieces(m: usize) -> Vec<std::ops::Range<usize>> {
    let threads = rayon::current_num_threads().max(1);
    let per = m.div_ceil(threads).next_multiple_of(16).max(16);
    (0..m).step_by(per).map(|r| r..(r + per).min(m)).collect()
}

/// Whether [`conv2d_input_grad_as_conv`] applies: stride 1, and padding at most the dilated
/// kernel's reach (`p ≤ d·(k - 1)`), so the flipped convolution's padding is not negative.
pub fn input_grad_as_conv_applies(s: &ConvShape) -> bool {
    s.stride == [1, 1]
        && s.kernel.iter().all(|&k| k > 0)
        && (0..2).all(|a| s.padding[a] <= s.dilation[a] * s.kernel[a].saturating_sub(1))
}

/// The input gradient `[N, Ci, H, W]` of a stride-1 convolution, as the forward convolution
/// of `dy` (`[N, Co, Ho, Wo]`) with `W'[ci, co, i, j] = W[co, ci, kh-1-i, kw-1-j]`, the same
/// dilation and padding `d·(k - 1) - p`: every input pixel gathers the output gradients of the
/// taps that read it, which is what col2im scatters. Panics where
/// [`input_grad_as_conv_applies`] is false.
pub fn conv2d_input_grad_as_conv(weight: &[f32], dy: &[f32], s: &ConvShape) -> Vec<f32> {
    assert!(
        input_grad_as_conv_applies(s),
        "conv input gradient as a convolution: needs stride 1 and padding within the kernel, {s:?}"
    );
    let [n, ci, h, w] = s.input;
    let [_, co, ho, wo] = s
        .output()
        .unwrap_or_else(|| panic!("conv input gradient: kernel does not fit {s:?}"));
    let [kh, kw] = s.kernel;
    assert_eq!(
        weight.len(),
        co * ci * kh * kw,
        "conv input gradient: weight length for {s:?}"
    );
    let taps = kh * kw;
    let mut flipped = vec![0f32; weight.len()];
    for o in 0..co {
        for i in 0..ci {
            let src = &weight[(o * ci + i) * taps..][..taps];
            let dst = &mut flipped[(i * co + o) * taps..][..taps];
            for (d, &v) in dst.iter_mut().zip(src.iter().rev()) {
                *d = v;
            }
        }
    }
    let transposed = ConvShape {
        input: [n, co, ho, wo],
        out_channels: ci,
        kernel: s.kernel,
        stride: [1, 1],
        padding: [
            s.dilation[0] * (kh - 1) - s.padding[0],
            s.dilation[1] * (kw - 1) - s.padding[1],
        ],
        dilation: s.dilation,
    };
    debug_assert_eq!(transposed.output(), Some([n, ci, h, w]));
    conv2d_forward(dy, &flipped, &transposed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_image_pieces_partition_the_rows_in_a_multiple_of_the_threads() {
        let threads = rayon::current_num_threads().max(1);
        // VGG-16's 3x3 layers at 224, a 1x1 output, a map with fewer rows than threads.
        for (rows, ho, wo) in [
            (27, 224, 224),
            (576, 224, 224),
            (1152, 112, 112),
            (2304, 56, 56),
            (4608, 28, 28),
            (4608, 14, 14),
            (4608, 1, 1),
            (9, 3, 40),
        ] {
            let pieces = row_pieces(1, rows, ho, wo);
            partition(&pieces, ho, &format!("{rows} {ho}"));
            if ho >= 2 * threads && ho % (2 * threads) == 0 {
                assert_eq!(pieces.len() % threads, 0, "{rows} {ho}x{wo}: {pieces:?}");
            }
            // Each piece's columns stay near the budget unless one row is already over it.
            let largest = pieces.iter().map(|p| p.len()).max().unwrap_or(0);
            assert!(
                largest == 1 || rows * (largest - 1) * wo <= ONE_IMAGE_PIECE_FLOATS,
                "{rows} {ho}x{wo}: {pieces:?}"
            );
        }
        // Images in parallel keep the cache-sized blocks.
        assert_eq!(row_pieces(16, 576, 224, 224), row_blocks(576, 224, 224));
    }

    /// `pieces` cover `0..len` in order, none empty.
    fn partition(pieces: &[std::ops::Range<usize>], len: usize, what: &str) {
        assert_eq!(
            pieces.first().map(|p| p.start),
            Some(0),
            "{what}: {pieces:?}"
        );
        assert_eq!(
            pieces.last().map(|p| p.end),
            Some(len),
            "{what}: {pieces:?}"
        );
        for pair in pieces.windows(2) {
            assert_eq!(pair[0].end, pair[1].start, "{what}: {pieces:?}");
        }
        assert!(pieces.iter().all(|p| !p.is_empty()), "{what}: {pieces:?}");
    }

    #[test]
    fn one_image_column_and_row_pieces_share_the_work_evenly() {
        let threads = rayon::current_num_threads().max(1);
        // ResNet-50's and DenseNet-121's maps at batch 1, and two odd ones.
        for pixels in [12544, 3136, 784, 400, 196, 49, 1, 520] {
            let pieces = column_pieces(1, pixels);
            partition(&pieces, pixels, &format!("{pixels} pixels"));
            let widths: Vec<usize> = pieces.iter().map(|p| p.len()).collect();
            if pieces.len() >= threads {
                assert_eq!(pieces.len() % threads, 0, "{pixels}: {widths:?}");
                assert!(pieces.len() <= 2 * threads, "{pixels}: {widths:?}");
            }
            if pieces.len() > 1 {
                assert!(
                    widths.iter().all(|&w| w >= MIN_PIECE_PIXELS / 2),
                    "{widths:?}"
                );
                // The widths differ only by the rounding to multiples of 16 (and the last's rest).
                let (lo, hi) = (widths.iter().min(), widths.iter().max());
                let spread = hi.zip(lo).map_or(0, |(h, l)| h - l);
                assert!(spread <= 16 * pieces.len(), "{pixels}: {widths:?}");
            }
        }
        // Two images or more: whole images.
        assert_eq!(column_pieces(2, 784), vec![0..784]);
        for m in [2048, 512, 256, 128, 32, 16, 7, 1] {
            let pieces = one_image_row_pieces(m);
            partition(&pieces, m, &format!("{m} rows"));
            assert!(pieces.len() <= threads, "{m}: {pieces:?}");
            assert!(pieces[..pieces.len() - 1].iter().all(|p| p.len() % 16 == 0));
        }
    }

    /// A 1x1 convolution at batch 1, cut by rows or by columns, gives the bits of the same
    /// image in a batch of two (whole products), forward and input gradient.
    #[test]
    fn one_image_pieces_give_the_bits_of_a_whole_product() {
        for (ci, co, side) in [(64, 96, 7), (48, 40, 14), (32, 64, 28), (16, 32, 23)] {
            let s1 = ConvShape {
                input: [1, ci, side, side],
                out_channels: co,
                kernel: [1, 1],
                stride: [1, 1],
                padding: [0, 0],
                dilation: [1, 1],
            };
            let s2 = ConvShape {
                input: [2, ci, side, side],
                ..s1
            };
            let wave = |len: usize, seed: usize| -> Vec<f32> {
                (0..len)
                    .map(|i| ((i * 2654435761 + seed) % 2003) as f32 / 1001.0 - 1.0)
                    .collect()
            };
            let plane = ci * side * side;
            let (x, w) = (wave(2 * plane, 1), wave(co * ci, 2));
            let one = conv2d_forward_im2col(&x[plane..], &w, &s1);
            let two = conv2d_forward_im2col(&x, &w, &s2);
            assert!(
                one == two[co * side * side..],
                "forward {ci}->{co} on {side}"
            );
            let dy = wave(2 * co * side * side, 3);
            let one = conv2d_input_grad(&w, &dy[co * side * side..], &s1);
            let two = conv2d_input_grad(&w, &dy, &s2);
            assert!(one == two[plane..], "input gradient {ci}->{co} on {side}");
        }
    }
}
