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

use rayon::prelude::*;

/// The smallest inner dimension (images x output pixels) one GEMM call gets, where the batch
/// allows it.
pub const MIN_INNER: usize = 1024;

/// The geometry of the convolution whose weight gradient is wanted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
    ho: usize,
    wo: usize,
) {
    let [_, _, h, w] = s.input;
    let (oh_lo, oh_hi) = valid_range(ho, s.stride[0], ki * s.dilation[0], s.padding[0], h);
    let (ow_lo, ow_hi) = valid_range(wo, s.stride[1], kj * s.dilation[1], s.padding[1], w);
    row[..oh_lo * wo].fill(0.0);
    row[oh_hi * wo..].fill(0.0);
    for oh in oh_lo..oh_hi {
        let ih = oh * s.stride[0] + ki * s.dilation[0] - s.padding[0];
        let src = &plane[ih * w..(ih + 1) * w];
        let dst = &mut row[oh * wo..(oh + 1) * wo];
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

/// The weight gradient `[Co, Ci, kh, kw]` (row-major) of a convolution with shape `s`, from
/// its input `x` (`[N, Ci, H, W]`, row-major) and output gradient `dy` (`[N, Co, Ho, Wo]`).
///
/// Panics when the slices' lengths do not match `s` (callers pass Burn tensors whose shapes
/// Burn already checked).
pub fn conv2d_weight_grad(x: &[f32], dy: &[f32], s: &ConvShape) -> Vec<f32> {
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
    let chunk = MIN_INNER.div_ceil(pixels).clamp(1, n);
    let mut cols = vec![0f32; rows * chunk * pixels];
    let mut dyc = vec![0f32; co * chunk * pixels];
    let mut first_chunk = true;
    for b0 in (0..n).step_by(chunk) {
        let nb = chunk.min(n - b0);
        let inner = nb * pixels;
        let cols = &mut cols[..rows * inner];
        cols.par_chunks_mut(inner).enumerate().for_each(|(r, row)| {
            let (c, tap) = (r / taps, r % taps);
            for b in 0..nb {
                let plane = &x[((b0 + b) * ci + c) * h * w..][..h * w];
                let part = &mut row[b * pixels..(b + 1) * pixels];
                fill_row(part, plane, s, tap / kw, tap % kw, ho, wo);
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
        // dW[co, r] (+)= Σ_p lhs[co, p] · cols[r, p]
        // SAFETY: every pointer covers the matrix its strides describe: dst is co x rows
        // row-major, lhs is co x inner row-major, rhs reads cols (rows x inner, row-major)
        // as its transpose.
        unsafe {
            gemm::gemm(
                co,
                rows,
                inner,
                dw.as_mut_ptr(),
                1,
                rows as isize,
                !first_chunk,
                lhs.as_ptr(),
                1,
                inner as isize,
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
        first_chunk = false;
    }
    dw
}

/// The same gradient by the definition, one multiply-add at a time: the reference the tests
/// compare [`conv2d_weight_grad`] with.
pub fn conv2d_weight_grad_naive(x: &[f32], dy: &[f32], s: &ConvShape) -> Vec<f32> {
    let [n, ci, h, w] = s.input;
    let Some([_, co, ho, wo]) = s.output() else {
        return vec![0.0; s.weight().iter().product()];
    };
    let [kh, kw] = s.kernel;
    let mut dw = vec![0f64; co * ci * kh * kw];
    for b in 0..n {
        for o in 0..co {
            for c in 0..ci {
                for i in 0..kh {
                    for j in 0..kw {
                        let mut acc = 0f64;
                        for oh in 0..ho {
                            let ih = (oh * s.stride[0] + i * s.dilation[0]) as isize
                                - s.padding[0] as isize;
                            if ih < 0 || ih >= h as isize {
                                continue;
                            }
                            for ow in 0..wo {
                                let iw = (ow * s.stride[1] + j * s.dilation[1]) as isize
                                    - s.padding[1] as isize;
                                if iw < 0 || iw >= w as isize {
                                    continue;
                                }
                                let xv = x[((b * ci + c) * h + ih as usize) * w + iw as usize];
                                let g = dy[((b * co + o) * ho + oh) * wo + ow];
                                acc += xv as f64 * g as f64;
                            }
                        }
                        dw[((o * ci + c) * kh + i) * kw + j] += acc;
                    }
                }
            }
        }
    }
    dw.into_iter().map(|v| v as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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
