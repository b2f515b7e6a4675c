//! The operations written pixel by pixel, as they were first checked against torchvision's
//! fixture: the reference the vectorised loops of `pixels.rs` are held to, bit for bit, on
//! images larger and odder than the fixture's.

use image::RgbImage;

use super::ops::{Op, grid};
use super::pixels::affine_by_pixel;

/// The operation on an 8-bit RGB image, with torchvision's tensor arithmetic.
pub(super) fn apply(op: &Op, img: RgbImage) -> RgbImage {
    // The geometric operations' maps and grid are shared with the fast path (torchvision's
    // fixture checks them); what differs is the sampling loop.
    if let Some(m) = op.inverse_map(f64::from(img.width()), f64::from(img.height())) {
        let (gx, gy) = grid(&img, m);
        return affine_by_pixel(&img, gx, gy);
    }
    match *op {
        Op::Brightness(m) => blend_with(img, 1.0 + m, |_| [0.0; 3]),
        Op::Color(m) => blend_with(img, 1.0 + m, |p| [f32::from(gray(p)); 3]),
        Op::Contrast(m) => {
            // torch.mean of the gray image: an exact sum of whole numbers, over n in f32.
            let n = (img.width() * img.height()).max(1) as f32;
            let sum: u64 = img.pixels().map(|p| u64::from(gray(&p.0))).sum();
            let mean = sum as f32 / n;
            blend_with(img, 1.0 + m, |_| [mean; 3])
        }
        Op::Sharpness(m) => sharpness(img, 1.0 + m),
        Op::Posterize(bits) => {
            let mask = (0xFFu16 << (8 - u16::from(bits.min(8)))) as u8;
            map_pixels(img, |c| c & mask)
        }
        Op::Solarize(t) => map_pixels(img, |c| if f64::from(c) >= t { 255 - c } else { c }),
        Op::AutoContrast => autocontrast(img),
        Op::Equalize => equalize(img),
        // Identity, and the geometric operations (above).
        _ => img,
    }
}

fn map_pixels(mut img: RgbImage, f: impl Fn(u8) -> u8) -> RgbImage {
    img.pixels_mut().for_each(|p| p.0 = p.0.map(&f));
    img
}

/// torchvision's `rgb_to_grayscale` on 8 bits: the f32 sum truncated.
fn gray(p: &[u8; 3]) -> u8 {
    (0.2989f32 * f32::from(p[0]) + 0.587f32 * f32::from(p[1]) + 0.114f32 * f32::from(p[2])) as u8
}

/// torchvision's `_blend(img, other, ratio)` on 8 bits: `ratio * img + (1 - ratio) * other`
/// in f32 (both weights rounded from Python's doubles), clamped to [0, 255] and truncated.
fn blend(a: u8, b: f32, (ratio, rest): (f32, f32)) -> u8 {
    (ratio * f32::from(a) + rest * b).clamp(0.0, 255.0) as u8
}

/// The two weights of [`blend`]: `ratio` and `1 - ratio` computed in f64, then each in f32.
fn weights(ratio: f64) -> (f32, f32) {
    (ratio as f32, (1.0 - ratio) as f32)
}

fn blend_with(mut img: RgbImage, ratio: f64, other: impl Fn(&[u8; 3]) -> [f32; 3]) -> RgbImage {
    let ratio = weights(ratio);
    for p in img.pixels_mut() {
        let o = other(&p.0);
        p.0 = [0, 1, 2].map(|c| blend(p.0[c], o[c], ratio));
    }
    img
}

/// torchvision's `adjust_sharpness`: a blend with the image smoothed by [1 1 1; 1 5 1; 1 1 1]
/// / 13 (rounded to 8 bits) inside a one-pixel border kept as it is.
fn sharpness(img: RgbImage, factor: f64) -> RgbImage {
    let (w, h) = img.dimensions();
    if w <= 2 || h <= 2 {
        return img;
    }
    let mut blurred = img.clone();
    let weight = |dx: i64, dy: i64| {
        if dx == 0 && dy == 0 {
            5.0f32 / 13.0
        } else {
            1.0 / 13.0
        }
    };
    for y in 1..h - 1 {
        for x in 1..w - 1 {
            let mut sum = [0f32; 3];
            for dy in -1i64..=1 {
                for dx in -1i64..=1 {
                    let p = img
                        .get_pixel((x as i64 + dx) as u32, (y as i64 + dy) as u32)
                        .0;
                    for c in 0..3 {
                        sum[c] += weight(dx, dy) * f32::from(p[c]);
                    }
                }
            }
            blurred.get_pixel_mut(x, y).0 = sum.map(|s| s.round().clamp(0.0, 255.0) as u8);
        }
    }
    let ratio = weights(factor);
    let mut out = img;
    for (p, b) in out.pixels_mut().zip(blurred.pixels()) {
        p.0 = [0, 1, 2].map(|c| blend(p.0[c], f32::from(b.0[c]), ratio));
    }
    out
}

/// torchvision's `autocontrast`: each channel stretched to [0, 255] (a flat channel kept).
fn autocontrast(mut img: RgbImage) -> RgbImage {
    let mut lo = [255u8; 3];
    let mut hi = [0u8; 3];
    for p in img.pixels() {
        for c in 0..3 {
            lo[c] = lo[c].min(p.0[c]);
            hi[c] = hi[c].max(p.0[c]);
        }
    }
    let scale = [0, 1, 2].map(|c| {
        if hi[c] > lo[c] {
            (255.0f32 / f32::from(hi[c] - lo[c]), f32::from(lo[c]))
        } else {
            (1.0, 0.0)
        }
    });
    for p in img.pixels_mut() {
        p.0 = [0, 1, 2].map(|c| {
            let (s, m) = scale[c];
            ((f32::from(p.0[c]) - m) * s).clamp(0.0, 255.0) as u8
        });
    }
    img
}

/// torchvision's `equalize` (PIL's rule): per channel, a lookup table from the cumulative
/// histogram with a step of (pixels but the last value's) / 255, integer arithmetic.
fn equalize(mut img: RgbImage) -> RgbImage {
    for c in 0..3 {
        let mut hist = [0u64; 256];
        for p in img.pixels() {
            hist[usize::from(p.0[c])] += 1;
        }
        let nonzero: Vec<u64> = hist.iter().copied().filter(|&n| n > 0).collect();
        let step = nonzero[..nonzero.len().saturating_sub(1)]
            .iter()
            .sum::<u64>()
            / 255;
        if step == 0 {
            continue;
        }
        let mut lut = [0u8; 256];
        let mut cum = 0u64;
        for (v, n) in hist.iter().enumerate().take(255) {
            cum += n;
            lut[v + 1] = ((cum + step / 2) / step).min(255) as u8;
        }
        for p in img.pixels_mut() {
            p.0[c] = lut[usize::from(p.0[c])];
        }
    }
    img
}
