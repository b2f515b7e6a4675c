//! The operations of torchvision's automatic augmentations on 8-bit pixels, with its
//! arithmetic, and the draws the policies share (sign, magnitude tables).

use image::RgbImage;

use crate::rng::SplitMix64;

/// One operation at its magnitude, as torchvision's `_apply_op` applies it (fill 0, nearest
/// sampling).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Op {
    Identity,
    /// x moves by `m` times the row's distance from the top edge.
    ShearX(f64),
    ShearY(f64),
    /// Pixels (truncated to a whole number, as torchvision does).
    TranslateX(f64),
    TranslateY(f64),
    /// Degrees, counter-clockwise, about the centre.
    Rotate(f64),
    /// Factors are `1 + m`.
    Brightness(f64),
    Color(f64),
    Contrast(f64),
    Sharpness(f64),
    /// Bits kept per channel.
    Posterize(u8),
    /// Values at or above this are inverted.
    Solarize(f64),
    AutoContrast,
    Equalize,
}

/// The operations in torchvision's order (the order its `_augmentation_space` lists them).
pub const OPS: [&str; 14] = [
    "Identity",
    "ShearX",
    "ShearY",
    "TranslateX",
    "TranslateY",
    "Rotate",
    "Brightness",
    "Color",
    "Contrast",
    "Sharpness",
    "Posterize",
    "Solarize",
    "AutoContrast",
    "Equalize",
];

/// torchvision's sign: `if signed and torch.randint(2, (1,)): magnitude *= -1`.
pub(super) fn signed_draw(m: f64, signed: bool, rng: &mut SplitMix64) -> f64 {
    if signed && rng.below(2) == 1 { -m } else { m }
}

pub(super) fn make_op(op: usize, m: f64) -> Op {
    match op {
        1 => Op::ShearX(m),
        2 => Op::ShearY(m),
        3 => Op::TranslateX(m),
        4 => Op::TranslateY(m),
        5 => Op::Rotate(m),
        6 => Op::Brightness(m),
        7 => Op::Color(m),
        8 => Op::Contrast(m),
        9 => Op::Sharpness(m),
        10 => Op::Posterize(m as u8),
        11 => Op::Solarize(m),
        12 => Op::AutoContrast,
        13 => Op::Equalize,
        _ => Op::Identity,
    }
}

/// `torch.linspace(start, end, n)` in f32, as torch computes it (the first half from `start`,
/// the second from `end`), widened to f64 as `float(tensor[i])` is.
pub(super) fn linspace(start: f32, end: f32, n: usize) -> Vec<f64> {
    let step = (end - start) / (n as f32 - 1.0);
    let half = n / 2;
    (0..n)
        .map(|i| {
            // One rounding per value, as torch's vectorised kernel (a fused multiply-add).
            let v = if i < half {
                step.mul_add(i as f32, start)
            } else {
                (-step).mul_add((n - i - 1) as f32, end)
            };
            f64::from(v)
        })
        .collect()
}

pub(super) fn round_half_even(x: f64) -> f64 {
    let r = x.round();
    if (x - x.trunc()).abs() == 0.5 && r % 2.0 != 0.0 {
        r - x.signum()
    } else {
        r
    }
}

impl Op {
    /// The operation on an 8-bit RGB image, with torchvision's tensor arithmetic.
    pub fn apply(&self, img: RgbImage) -> RgbImage {
        let (w, h) = (img.width() as f64, img.height() as f64);
        match *self {
            Op::Identity => img,
            // torchvision: affine(shear=[degrees(atan(m)), 0], center=[0, 0]); its inverse map
            // in centred coordinates is [1, m, m h/2; 0, 1, 0].
            Op::ShearX(m) => affine(&img, [1.0, m, m * h / 2.0, 0.0, 1.0, 0.0]),
            Op::ShearY(m) => affine(&img, [1.0, 0.0, 0.0, m, 1.0, m * w / 2.0]),
            Op::TranslateX(m) => affine(&img, [1.0, 0.0, -m.trunc(), 0.0, 1.0, 0.0]),
            Op::TranslateY(m) => affine(&img, [1.0, 0.0, 0.0, 0.0, 1.0, -m.trunc()]),
            Op::Rotate(deg) => {
                // rotate(angle) is the affine map of -angle; its inverse [d, -b; -c, a].
                let (sin, cos) = (-deg).to_radians().sin_cos();
                affine(&img, [cos, sin, 0.0, -sin, cos, 0.0])
            }
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
        }
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

/// torchvision's tensor `affine` with nearest sampling and zero fill: `m` maps an output
/// pixel's centre (coordinates about the image centre) to the input, computed in f32 as its
/// grid (`_gen_affine_grid`) and `grid_sample(align_corners=False)` do.
fn affine(img: &RgbImage, m: [f64; 6]) -> RgbImage {
    let (w, h) = img.dimensions();
    let (wf, hf) = (w as f32, h as f32);
    // theta transposed and divided by [w/2, h/2], as `_gen_affine_grid` does.
    let t = m.map(|v| v as f32);
    let (hw, hh) = (0.5 * wf, 0.5 * hf);
    let gx = [t[0] / hw, t[1] / hw, t[2] / hw];
    let gy = [t[3] / hh, t[4] / hh, t[5] / hh];
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
