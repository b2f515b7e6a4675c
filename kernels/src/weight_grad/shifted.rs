//! The weight gradient of a stride-1 convolution without im2col: one GEMM per kernel tap
//! over the flat pixels of the zero-padded input ([`conv2d_weight_grad_shifted`]).

use rayon::prelude::*;

use super::ConvShape;

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
    let plan = Shifted::new(s);
    let mut sum = vec![0f32; co * ci * plan.taps];
    if n == 0 || plan.len == 0 || co * ci == 0 {
        return sum;
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
                || plan.scratch(),
                |(xp, dyp), run| plan.run_sum(x, dy, run.clone(), xp, dyp),
            )
            .collect();
        for p in partials {
            for (a, b) in sum.iter_mut().zip(&p) {
                *a += b;
            }
        }
    }
    plan.in_weight_order(sum)
}

/// How [`conv2d_weight_grad_shifted`] lays out what its products read.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Copies {
    /// Padded copies, `[channel][pixel]`.
    Plain,
    /// Padded copies, `[pixel][channel]`, and each tap's sum a contiguous block.
    ChannelsLast,
    /// The image and its gradient where they are (1x1, no padding).
    InPlace,
}

/// What one call of [`conv2d_weight_grad_shifted`] computes its runs with.
struct Shifted {
    input: [usize; 3],
    output: [usize; 3],
    padding: [usize; 2],
    kw: usize,
    taps: usize,
    /// Padded row length, floats of one channel of `Xp`, and of `dYp`.
    wp: usize,
    plane: usize,
    len: usize,
    /// Pixels per chunk of the products.
    chunk: usize,
    copies: Copies,
    /// How far apart a pixel's and a channel's values lie in what the products read.
    x_strides: [usize; 2],
    dy_strides: [usize; 2],
    /// Where tap `t`'s `[ci][co]` block starts in a sum (`t · tap_at`), and how far apart its
    /// rows (input channels) and columns (output channels) are.
    tap_at: usize,
    sum_strides: [usize; 2],
}

impl Shifted {
    fn new(s: &ConvShape) -> Self {
        let [_, ci, h, w] = s.input;
        let [_, co, ho, wo] = s.output().unwrap_or_default();
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
        // A 1x1 kernel without padding reads the image and its gradient where they are: the
        // rows need no padding, so Xp and dYp would be copies of them. Against copying, side by
        // side (batch 16, AVX2 Zen 3, GFLOP/s): DenseNet-121's 1x1 layers 96-108 against 85-94
        // on 56x56 down to 55-56 against 50-51 on 7x7, ResNet-50's 256→64 on 56x56 95-97
        // against 74-77.
        let copies = if taps > 1 && co < ci {
            Copies::ChannelsLast
        } else if taps == 1 && s.padding == [0, 0] {
            Copies::InPlace
        } else {
            Copies::Plain
        };
        let (x_strides, dy_strides) = match copies {
            Copies::ChannelsLast => ([ci, 1], [co, 1]),
            Copies::InPlace => ([1, h * w], [1, ho * wo]),
            Copies::Plain => ([1, plane], [1, len]),
        };
        // Channels-last sums each tap as a contiguous `[co][ci]` block (strided by the taps it
        // cost 5-30% on 14x14 and 7x7 maps), permuted to the weight's `[co][ci][tap]` at the
        // end; the others sum in the weight's layout.
        let (tap_at, sum_strides) = if copies == Copies::ChannelsLast {
            (co * ci, [1, ci])
        } else {
            (1, [taps, ci * taps])
        };
        Shifted {
            input: [ci, h, w],
            output: [co, ho, wo],
            padding: [ph, pw],
            kw,
            taps,
            wp,
            plane,
            len,
            chunk,
            copies,
            x_strides,
            dy_strides,
            tap_at,
            sum_strides,
        }
    }

    /// A thread's `Xp` and `dYp`, zeroed once: the borders and the columns past Wo are never
    /// written.
    fn scratch(&self) -> (Vec<f32>, Vec<f32>) {
        let ([ci, ..], [co, ..]) = (self.input, self.output);
        if self.copies == Copies::InPlace {
            (Vec::new(), Vec::new())
        } else {
            (vec![0f32; ci * self.plane], vec![0f32; co * self.len])
        }
    }

    /// The weight gradient of the images `run`, in the sum's layout.
    fn run_sum(
        &self,
        x: &[f32],
        dy: &[f32],
        run: std::ops::Range<usize>,
        xp: &mut [f32],
        dyp: &mut [f32],
    ) -> Vec<f32> {
        let ([ci, h, w], [co, ho, wo]) = (self.input, self.output);
        let [x_pixel, x_channel] = self.x_strides;
        let [dy_pixel, dy_channel] = self.dy_strides;
        let [sum_row, sum_col] = self.sum_strides;
        let mut sum = vec![0f32; co * ci * self.taps];
        let mut started = false;
        for b in run {
            let image = &x[b * ci * h * w..][..ci * h * w];
            let grad = &dy[b * co * ho * wo..][..co * ho * wo];
            self.lay_out(image, grad, xp, dyp);
            let (xs, ys): (&[f32], &[f32]) = if self.copies == Copies::InPlace {
                (image, grad)
            } else {
                (xp, dyp)
            };
            for q0 in (0..self.len).step_by(self.chunk) {
                let k = self.chunk.min(self.len - q0);
                for tap in 0..self.taps {
                    let off = (tap / self.kw) * self.wp + tap % self.kw;
                    // SAFETY: dst is the tap's ci x co block of the sum (co·ci·taps long,
                    // either layout); lhs reads ci channels of xs at pixels q0+off..q0+off+k
                    // <= len + reach = ho·wp + (kh-1)·wp + kw - 1 = hp·wp + kw - 1 <= plane
                    // (in place: off = 0 and len = h·w, a channel's plane); rhs reads co
                    // channels of ys at pixels q0..q0+k <= len.
                    unsafe {
                        gemm::gemm(
                            ci,
                            co,
                            k,
                            sum.as_mut_ptr().add(tap * self.tap_at),
                            sum_col as isize,
                            sum_row as isize,
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
        sum
    }

    /// Copies one image and its output gradient into `xp` and `dyp` as [`Copies`] says
    /// (nothing in place).
    fn lay_out(&self, image: &[f32], grad: &[f32], xp: &mut [f32], dyp: &mut [f32]) {
        let ([ci, h, w], [co, ho, wo]) = (self.input, self.output);
        let [ph, pw] = self.padding;
        let (wp, plane, len) = (self.wp, self.plane, self.len);
        match self.copies {
            Copies::InPlace => {}
            Copies::ChannelsLast => {
                to_channels_last(xp, image, ci, [h, w], ph * wp + pw, wp);
                to_channels_last(dyp, grad, co, [ho, wo], 0, wp);
            }
            Copies::Plain => {
                for c in 0..ci {
                    let src = &image[c * h * w..][..h * w];
                    copy_rows(&mut xp[c * plane..][..plane], src, h, w, ph * wp + pw, wp);
                }
                for o in 0..co {
                    let src = &grad[o * ho * wo..][..ho * wo];
                    copy_rows(&mut dyp[o * len..][..len], src, ho, wo, 0, wp);
                }
            }
        }
    }

    /// The summed gradient in the weight's `[co][ci][tap]` layout.
    fn in_weight_order(&self, sum: Vec<f32>) -> Vec<f32> {
        if self.copies != Copies::ChannelsLast {
            return sum;
        }
        let (ci, co, taps) = (self.input[0], self.output[0], self.taps);
        let mut weight = vec![0f32; co * ci * taps];
        for (tap, block) in sum.chunks_exact(co * ci).enumerate() {
            for (i, &v) in block.iter().enumerate() {
                weight[i * taps + tap] = v;
            }
        }
        weight
    }
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
