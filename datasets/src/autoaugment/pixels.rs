//! The operations' pixel loops, on the image's bytes: the same f32 arithmetic, value for value,
//! as torchvision's (`reference.rs` in the tests keeps the loops written pixel by pixel, and
//! the tests hold these to them bit for bit), in forms the compiler vectorises.
//!
//! Why: written pixel by pixel through `image`'s accessors, one operation on a 224-pixel image
//! took 0.3-2 ms (Sharpness 2.0 ms, the geometric ones 0.55-0.76 ms; 0.52 ms on average over
//! the 14), and RandAugment's two cost Hearth's loader a third of its images/s, more than
//! torchvision loses to them. Here the loops run over the bytes, compiled for AVX2 where the
//! CPU has it, without branches or saturating conversions (which the compiler leaves lane by
//! lane), and the geometric ones compute each row's source offsets first, then copy: 0.1 ms on
//! average (AMD EPYC Zen 3, 2 cores; docs/benchmarks/data-pipeline.md). Equalize's tables and
//! the border of Sharpness go through tables of 256 entries made by the same expressions.

use image::RgbImage;

/// Runs `f` compiled for AVX2 where the CPU has it (the crate is built for the baseline
/// x86-64): f32 arithmetic is IEEE's on any width, so only the speed differs. `f` must be an
/// `#[inline(always)]` closure to be compiled into the AVX2 function.
#[inline(always)]
fn vectorized<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { with_avx2(f) };
    }
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn with_avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// `v.clamp(0.0, 255.0) as u8`, as an i32: the same value (a NaN gives 0 both ways) by
/// conversions the vector units have (a saturating `as` is compiled lane by lane).
#[inline(always)]
fn byte(v: f32) -> i32 {
    // `max` and `min` give the number where the other is NaN, so this is within [0, 255]
    // (`clamp` would keep a NaN).
    #[allow(clippy::manual_clamp)]
    let v = v.max(0.0).min(255.0);
    // SAFETY: `v` is finite and within i32's range.
    unsafe { v.to_int_unchecked::<i32>() }
}

/// `f(v)` for every byte value.
fn table<T: Copy + Default>(f: impl Fn(u8) -> T) -> [T; 256] {
    let mut t = [T::default(); 256];
    for (v, slot) in t.iter_mut().enumerate() {
        *slot = f(v as u8);
    }
    t
}

/// A table of `f` over byte values.
pub(super) fn byte_table(f: impl Fn(u8) -> u8) -> [u8; 256] {
    table(f)
}

/// Each channel's bytes through its own table.
pub(super) fn map_channels(mut img: RgbImage, luts: &[[u8; 256]; 3]) -> RgbImage {
    for p in img.chunks_exact_mut(3) {
        for c in 0..3 {
            p[c] = luts[c][usize::from(p[c])];
        }
    }
    img
}

/// torchvision's `_blend(img, other, ratio)` on 8 bits with one `other` for every value:
/// `ratio * v + (1 - ratio) * other` in f32, clamped to [0, 255] and truncated.
pub(super) fn blend_constant(mut img: RgbImage, other: f32, (ratio, rest): (f32, f32)) -> RgbImage {
    let bytes: &mut [u8] = &mut img;
    let other = rest * other;
    vectorized(
        #[inline(always)]
        || {
            for v in bytes.iter_mut() {
                *v = byte(ratio * f32::from(*v) + other) as u8;
            }
        },
    );
    img
}

/// Every byte masked (Posterize).
pub(super) fn mask(mut img: RgbImage, mask: u8) -> RgbImage {
    for v in img.iter_mut() {
        *v &= mask;
    }
    img
}

/// Values at or above `t` inverted (Solarize): `f64::from(v) >= t` is `v >= first`, the
/// smallest byte value that passes it (256 where none does).
pub(super) fn solarize(mut img: RgbImage, t: f64) -> RgbImage {
    let first = (0u16..256).find(|&v| f64::from(v) >= t).unwrap_or(256);
    for v in img.iter_mut() {
        // 255 - v is v ^ 255; without a branch, which random pixels would mispredict half the
        // time.
        *v ^= u8::from(u16::from(*v) >= first).wrapping_neg();
    }
    img
}

/// torchvision's `rgb_to_grayscale` on 8 bits: `(0.2989 r + 0.587 g) + 0.114 b` in f32,
/// truncated.
#[inline(always)]
fn gray(p: &[u8]) -> f32 {
    0.2989f32 * f32::from(p[0]) + 0.587f32 * f32::from(p[1]) + 0.114f32 * f32::from(p[2])
}

/// The sum of the image's gray values (torchvision's mean before its division).
pub(super) fn gray_sum(img: &RgbImage) -> u64 {
    vectorized(
        #[inline(always)]
        || {
            let mut sum = 0u64;
            for p in img.chunks_exact(3) {
                // A gray value is within [0, 255.9], so the truncation is `byte`'s.
                sum += byte(gray(p)) as u64;
            }
            sum
        },
    )
}

/// `blend(img, gray(img), ratio)`: torchvision's `adjust_saturation`.
pub(super) fn blend_gray(mut img: RgbImage, (ratio, rest): (f32, f32)) -> RgbImage {
    let bytes: &mut [u8] = &mut img;
    vectorized(
        #[inline(always)]
        || {
            for p in bytes.chunks_exact_mut(3) {
                let g = byte(gray(p)) as f32;
                for v in p.iter_mut() {
                    *v = byte(ratio * f32::from(*v) + rest * g) as u8;
                }
            }
        },
    );
    img
}

/// torchvision's `autocontrast` with each channel's `(scale, minimum)`:
/// `(v - minimum) * scale`, clamped and truncated.
pub(super) fn stretch(mut img: RgbImage, by: [(f32, f32); 3]) -> RgbImage {
    let bytes: &mut [u8] = &mut img;
    vectorized(
        #[inline(always)]
        || {
            for p in bytes.chunks_exact_mut(3) {
                for c in 0..3 {
                    let (s, m) = by[c];
                    p[c] = byte((f32::from(p[c]) - m) * s) as u8;
                }
            }
        },
    );
    img
}

/// Each channel's smallest and largest value.
pub(super) fn channel_range(img: &RgbImage) -> ([u8; 3], [u8; 3]) {
    vectorized(
        #[inline(always)]
        || {
            let mut lo = [255u8; 3];
            let mut hi = [0u8; 3];
            for p in img.chunks_exact(3) {
                for c in 0..3 {
                    lo[c] = lo[c].min(p[c]);
                    hi[c] = hi[c].max(p[c]);
                }
            }
            (lo, hi)
        },
    )
}

/// torchvision's `adjust_sharpness`: a blend with the image smoothed by [1 1 1; 1 5 1; 1 1 1]
/// / 13 (rounded to 8 bits) inside a one-pixel border, whose pixels blend with themselves.
/// The nine products are summed in the reference's order (rows top to bottom, each left to
/// right), one output byte per lane.
pub(super) fn sharpness(img: RgbImage, (ratio, rest): (f32, f32)) -> RgbImage {
    let (w, h) = img.dimensions();
    let (w, h) = (w as usize, h as usize);
    if w <= 2 || h <= 2 {
        return img;
    }
    let (edge, centre) = (1.0f32 / 13.0, 5.0f32 / 13.0);
    let src: &[u8] = &img;
    let row = 3 * w;
    let mut out = vec![0u8; src.len()];
    // The border (first and last rows, each row's first and last pixel): blended with
    // itself. The interior is written below.
    let blend_self = table(|v| byte(ratio * f32::from(v) + rest * f32::from(v)) as u8);
    let mut border = |range: std::ops::Range<usize>| {
        for (o, &v) in out[range.clone()].iter_mut().zip(&src[range]) {
            *o = blend_self[usize::from(v)];
        }
    };
    border(0..row);
    border((h - 1) * row..h * row);
    for y in 1..h - 1 {
        border(y * row..y * row + 3);
        border((y + 1) * row - 3..(y + 1) * row);
    }
    let n = row - 6;
    vectorized(
        #[inline(always)]
        || {
            for y in 1..h - 1 {
                // The three rows around row y, each at the three shifts of x - 1, x and x + 1,
                // for x from 1 to w - 2 and every channel (n bytes).
                let taps = |r: usize| {
                    let r = &src[r * row..(r + 1) * row];
                    (&r[..n], &r[3..3 + n], &r[6..6 + n])
                };
                let (ul, uc, ur) = taps(y - 1);
                let (ml, mc, mr) = taps(y);
                let (dl, dc, dr) = taps(y + 1);
                let dst = &mut out[y * row + 3..y * row + 3 + n];
                for i in 0..n {
                    let f = |v: u8| f32::from(v);
                    let mut sum = 0.0f32;
                    sum += edge * f(ul[i]);
                    sum += edge * f(uc[i]);
                    sum += edge * f(ur[i]);
                    sum += edge * f(ml[i]);
                    sum += centre * f(mc[i]);
                    sum += edge * f(mr[i]);
                    sum += edge * f(dl[i]);
                    sum += edge * f(dc[i]);
                    sum += edge * f(dr[i]);
                    let blurred = byte(sum.round()) as f32;
                    dst[i] = byte(ratio * f(mc[i]) + rest * blurred) as u8;
                }
            }
        },
    );
    RgbImage::from_raw(w as u32, h as u32, out).unwrap_or(img)
}

/// torchvision's tensor `affine` with nearest sampling and zero fill: `g` maps an output
/// pixel's centre (coordinates about the image centre, in f32) to grid coordinates in [-1, 1]
/// (`_gen_affine_grid`, theta over [w/2, h/2]); `grid_sample(align_corners=False)` takes the
/// pixel whose centre is nearest, rounding half to even.
pub(super) fn affine(img: &RgbImage, gx: [f32; 3], gy: [f32; 3]) -> RgbImage {
    let (w, h) = img.dimensions();
    let (wf, hf) = (w as f32, h as f32);
    let src: &[u8] = img;
    let row = 3 * w as usize;
    // Offsets in i32, whose products and sums the vector units have (an image's bytes must
    // then fit in i32; larger ones take the same arithmetic in usize).
    if src.len() > i32::MAX as usize {
        return affine_by_pixel(img, gx, gy);
    }
    let row32 = row as i32;
    let mut out = vec![0u8; src.len()];
    // Per row: the source byte offset of each output pixel, or -1 outside.
    let mut from = vec![0i32; w as usize];
    for y in 0..h {
        let yc = -hf * 0.5 + 0.5 + y as f32;
        let (ty, tx) = (yc * gy[1], yc * gx[1]);
        vectorized(
            #[inline(always)]
            || {
                for (x, slot) in from.iter_mut().enumerate() {
                    let xc = -wf * 0.5 + 0.5 + x as f32;
                    let nx = xc * gx[0] + tx + gx[2];
                    let ny = xc * gy[0] + ty + gy[2];
                    let ix = (((nx + 1.0) * wf - 1.0) / 2.0).round_ties_even();
                    let iy = (((ny + 1.0) * hf - 1.0) / 2.0).round_ties_even();
                    // Without branches, so that the lanes run together.
                    let inside = (ix >= 0.0) & (iy >= 0.0) & (ix < wf) & (iy < hf);
                    // Clamped (a NaN to 0), so converted without saturation; the offset is
                    // kept only where the pixel is inside, where the clamp changes nothing.
                    let (ix, iy) = (ix.max(0.0).min(wf - 1.0), iy.max(0.0).min(hf - 1.0));
                    // SAFETY: both finite and within [0, w - 1] and [0, h - 1], which fit i32
                    // as the image's bytes do.
                    let (ix, iy) =
                        unsafe { (ix.to_int_unchecked::<i32>(), iy.to_int_unchecked::<i32>()) };
                    let at = iy * row32 + 3 * ix;
                    *slot = if inside { at } else { -1 };
                }
            },
        );
        let dst = &mut out[y as usize * row..(y as usize + 1) * row];
        for (p, &at) in dst.chunks_exact_mut(3).zip(&from) {
            // -1 (outside) is no offset: those pixels keep the fill.
            if let Ok(at) = usize::try_from(at)
                && let Some(s) = src.get(at..at + 3)
            {
                p.copy_from_slice(s);
            }
        }
    }
    RgbImage::from_raw(w, h, out).unwrap_or_else(|| img.clone())
}

/// [`affine`] a pixel at a time, with offsets in usize: for images of more than 2 GiB, and
/// the tests' reference (the loop as it was first checked against torchvision's fixture).
pub(super) fn affine_by_pixel(img: &RgbImage, gx: [f32; 3], gy: [f32; 3]) -> RgbImage {
    let (w, h) = img.dimensions();
    let (wf, hf) = (w as f32, h as f32);
    let mut out = RgbImage::new(w, h);
    for y in 0..h {
        let yc = -hf * 0.5 + 0.5 + y as f32;
        for x in 0..w {
            let xc = -wf * 0.5 + 0.5 + x as f32;
            let nx = xc * gx[0] + yc * gx[1] + gx[2];
            let ny = xc * gy[0] + yc * gy[1] + gy[2];
            let ix = (((nx + 1.0) * wf - 1.0) / 2.0).round_ties_even();
            let iy = (((ny + 1.0) * hf - 1.0) / 2.0).round_ties_even();
            if ix >= 0.0 && iy >= 0.0 && ix < wf && iy < hf {
                out.put_pixel(x, y, *img.get_pixel(ix as u32, iy as u32));
            }
        }
    }
    out
}
