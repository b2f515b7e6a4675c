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

use crate::weight_grad::{ConvShape, fill_row, for_each_column_block, row_blocks};

fn is_plain_pointwise(s: &ConvShape) -> bool {
    s.kernel == [1, 1] && s.stride == [1, 1] && s.padding == [0, 0]
}

/// `dst[m, n] = a[m, k] · b[k, n]` (all row-major with the given row strides) on gemm's own
/// threads (`Rayon(0)`) or on the calling thread (`None`: the caller's threads split the work).
///
/// # Safety
/// Each pointer must cover its matrix as the sizes and row strides describe.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_rows(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: usize,
    a: *const f32,
    a_cs: usize,
    a_rs: usize,
    b: *const f32,
    b_rs: usize,
    parallelism: gemm::Parallelism,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            false,
            a,
            a_cs as isize,
            a_rs as isize,
            b,
            1,
            b_rs as isize,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// `product(b, out, parallelism)` for every image `b`, `out` its `per` values of `all`: images
/// in parallel with single-threaded products when there are two or more (gemm's own threading
/// splits one image's thin product poorly: `kernels/examples/conv_paths.rs`), one image with
/// gemm's threads.
fn per_image(
    all: &mut [f32],
    per: usize,
    product: impl Fn(usize, &mut [f32], gemm::Parallelism) + Sync,
) {
    if all.len() >= 2 * per {
        all.par_chunks_mut(per)
            .enumerate()
            .for_each(|(b, out)| product(b, out, gemm::Parallelism::None));
    } else {
        for (b, out) in all.chunks_mut(per.max(1)).enumerate() {
            product(b, out, gemm::Parallelism::Rayon(0));
        }
    }
}

/// The forward pass `[N, Co, Ho, Wo]` of `x` (`[N, Ci, H, W]`) with `weight` (`[Co, Ci, kh,
/// kw]`), all row-major.
///
/// Panics when the lengths do not match `s` (callers pass Burn tensors Burn has checked).
pub fn conv2d_forward(x: &[f32], weight: &[f32], s: &ConvShape) -> Vec<f32> {
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
    let mut y = vec![0f32; n * co * pixels];
    if pixels == 0 || co == 0 || rows == 0 {
        return y;
    }
    if is_plain_pointwise(s) {
        let product = |b: usize, out: &mut [f32], parallelism| {
            let rhs = &x[b * ci * pixels..(b + 1) * ci * pixels];
            // SAFETY: out is co x pixels, weight co x rows, rhs rows x pixels, all row-major.
            unsafe {
                gemm_rows(
                    co,
                    pixels,
                    rows,
                    out.as_mut_ptr(),
                    pixels,
                    weight.as_ptr(),
                    1,
                    rows,
                    rhs.as_ptr(),
                    pixels,
                    parallelism,
                );
            }
        };
        per_image(&mut y, co * pixels, product);
        return y;
    }
    if n >= 2 {
        // Images in parallel, each product on one thread: gemm's own threading splits these
        // thin products poorly (the weight gradient measured the same).
        let [kh, kw] = s.kernel;
        let taps = kh * kw;
        let blocks = row_blocks(rows, ho, wo);
        let largest = blocks.iter().map(|r| r.len()).max().unwrap_or(0) * wo;
        y.par_chunks_mut(co * pixels).enumerate().for_each_init(
            || vec![0f32; rows * largest],
            |cols, (b, out)| {
                for block in &blocks {
                    let inner = block.len() * wo;
                    let cols = &mut cols[..rows * inner];
                    for (r, row) in cols.chunks_mut(inner).enumerate() {
                        let (c, tap) = (r / taps, r % taps);
                        let plane = &x[(b * ci + c) * h * w..][..h * w];
                        fill_row(row, plane, s, tap / kw, tap % kw, block.clone(), wo);
                    }
                    let out = &mut out[block.start * wo..];
                    // SAFETY: out covers co rows of `inner` values `pixels` apart (the block's
                    // columns of image b's output), weight is co x rows, cols rows x inner,
                    // all row-major.
                    unsafe {
                        gemm_rows(
                            co,
                            inner,
                            rows,
                            out.as_mut_ptr(),
                            pixels,
                            weight.as_ptr(),
                            1,
                            rows,
                            cols.as_ptr(),
                            inner,
                            gemm::Parallelism::None,
                        );
                    }
                }
            },
        );
        return y;
    }
    // Each image in blocks of output rows, so the columns stay small on large maps.
    for_each_column_block(x, s, |b, block, cols| {
        let inner = block.len() * wo;
        let out = &mut y[b * co * pixels + block.start * wo..];
        // SAFETY: out covers co rows of `inner` values `pixels` apart (the block's columns of
        // image b's output), weight is co x rows, cols rows x inner, all row-major.
        unsafe {
            gemm_rows(
                co,
                inner,
                rows,
                out.as_mut_ptr(),
                pixels,
                weight.as_ptr(),
                1,
                rows,
                cols.as_ptr(),
                inner,
                gemm::Parallelism::Rayon(0),
            );
        }
    });
    y
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
    let mut dx = vec![0f32; n * ci * h * w];
    if pixels == 0 || co == 0 || rows == 0 {
        return dx;
    }
    let pointwise = is_plain_pointwise(s);
    let mut dcols = if pointwise {
        Vec::new()
    } else {
        vec![0f32; rows * pixels]
    };
    if pointwise {
        let product = |b: usize, out: &mut [f32], parallelism| {
            let g = &dy[b * co * pixels..(b + 1) * co * pixels];
            // SAFETY: out is ci x pixels, the weight read transposed is ci x co (column
            // stride `rows` = ci), g is co x pixels, all row-major.
            unsafe {
                gemm_rows(
                    rows,
                    pixels,
                    co,
                    out.as_mut_ptr(),
                    pixels,
                    weight.as_ptr(),
                    rows,
                    1,
                    g.as_ptr(),
                    pixels,
                    parallelism,
                );
            }
        };
        per_image(&mut dx, ci * pixels, product);
        return dx;
    }
    for b in 0..n {
        let g = &dy[b * co * pixels..(b + 1) * co * pixels];
        let dst: *mut f32 = if pointwise {
            dx[b * ci * pixels..].as_mut_ptr()
        } else {
            dcols.as_mut_ptr()
        };
        // SAFETY: dst is rows x pixels (rows = ci for 1x1), the weight read transposed is
        // rows x co (column stride `rows`), g is co x pixels, all row-major.
        unsafe {
            gemm_rows(
                rows,
                pixels,
                co,
                dst,
                pixels,
                weight.as_ptr(),
                rows,
                1,
                g.as_ptr(),
                pixels,
                gemm::Parallelism::Rayon(0),
            );
        }
        if !pointwise {
            col2im(&dcols, b, s, ho, wo, &mut dx);
        }
    }
    dx
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
