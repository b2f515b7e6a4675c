//! The operations of torchvision's automatic augmentations on 8-bit pixels, with its
//! arithmetic, and the draws the policies share (sign, magnitude tables).

use image::RgbImage;

use super::pixels;
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
    /// The operation `OPS[index]` at `magnitude` (Posterize keeps that many bits, truncated;
    /// Identity past the end of [`OPS`]).
    pub fn at(index: usize, magnitude: f64) -> Op {
        make_op(index, magnitude)
    }

    /// The inverse map of a geometric operation on a `w` x `h` image, in centred coordinates
    /// (`[a, b, c, d, e, f]`: input = [a b; d e] output + [c, f]); `None` for the others.
    pub(super) fn inverse_map(&self, w: f64, h: f64) -> Option<[f64; 6]> {
        Some(match *self {
            // torchvision: affine(shear=[degrees(atan(m)), 0], center=[0, 0]); its inverse map
            // in centred coordinates is [1, m, m h/2; 0, 1, 0].
            Op::ShearX(m) => [1.0, m, m * h / 2.0, 0.0, 1.0, 0.0],
            Op::ShearY(m) => [1.0, 0.0, 0.0, m, 1.0, m * w / 2.0],
            Op::TranslateX(m) => [1.0, 0.0, -m.trunc(), 0.0, 1.0, 0.0],
            Op::TranslateY(m) => [1.0, 0.0, 0.0, 0.0, 1.0, -m.trunc()],
            Op::Rotate(deg) => {
                // rotate(angle) is the affine map of -angle; its inverse [d, -b; -c, a].
                let (sin, cos) = (-deg).to_radians().sin_cos();
                [cos, sin, 0.0, -sin, cos, 0.0]
            }
            _ => return None,
        })
    }

    /// The operation on an 8-bit RGB image, with torchvision's tensor arithmetic.
    pub fn apply(&self, img: RgbImage) -> RgbImage {
        if let Some(m) = self.inverse_map(f64::from(img.width()), f64::from(img.height())) {
            let (gx, gy) = grid(&img, m);
            return pixels::affine(&img, gx, gy);
        }
        match *self {
            Op::Identity
            | Op::ShearX(_)
            | Op::ShearY(_)
            | Op::TranslateX(_)
            | Op::TranslateY(_)
            | Op::Rotate(_) => img,
            Op::Brightness(m) => blend_with(img, 1.0 + m, 0.0),
            Op::Color(m) => pixels::blend_gray(img, weights(1.0 + m)),
            Op::Contrast(m) => {
                // torch.mean of the gray image: an exact sum of whole numbers, over n in f32.
                let n = (img.width() * img.height()).max(1) as f32;
                let mean = pixels::gray_sum(&img) as f32 / n;
                blend_with(img, 1.0 + m, mean)
            }
            Op::Sharpness(m) => pixels::sharpness(img, weights(1.0 + m)),
            Op::Posterize(bits) => {
                pixels::mask(img, (0xFFu16 << (8 - u16::from(bits.min(8)))) as u8)
            }
            Op::Solarize(t) => pixels::solarize(img, t),
            Op::AutoContrast => autocontrast(img),
            Op::Equalize => equalize(img),
        }
    }
}

/// The two weights of torchvision's `_blend(img, other, ratio)` on 8 bits (`ratio * img + (1 -
/// ratio) * other` in f32, clamped to [0, 255] and truncated): `ratio` and `1 - ratio`
/// computed in f64, then each in f32.
fn weights(ratio: f64) -> (f32, f32) {
    (ratio as f32, (1.0 - ratio) as f32)
}

/// Every value blended with the same `other`.
fn blend_with(img: RgbImage, ratio: f64, other: f32) -> RgbImage {
    pixels::blend_constant(img, other, weights(ratio))
}

/// torchvision's `autocontrast`: each channel stretched to [0, 255] (a flat channel kept).
fn autocontrast(img: RgbImage) -> RgbImage {
    let (lo, hi) = pixels::channel_range(&img);
    let by = [0, 1, 2].map(|c| {
        if hi[c] > lo[c] {
            (255.0f32 / f32::from(hi[c] - lo[c]), f32::from(lo[c]))
        } else {
            (1.0, 0.0)
        }
    });
    pixels::stretch(img, by)
}

/// torchvision's `equalize` (PIL's rule): per channel, a lookup table from the cumulative
/// histogram with a step of (pixels but the last value's) / 255, integer arithmetic; a
/// channel whose step is 0 is kept.
fn equalize(img: RgbImage) -> RgbImage {
    let mut hist = [[0u64; 256]; 3];
    for p in img.chunks_exact(3) {
        for c in 0..3 {
            hist[c][usize::from(p[c])] += 1;
        }
    }
    let luts = hist.map(|hist| {
        let mut lut = pixels::byte_table(|v| v);
        let nonzero: Vec<u64> = hist.iter().copied().filter(|&n| n > 0).collect();
        let step = nonzero[..nonzero.len().saturating_sub(1)]
            .iter()
            .sum::<u64>()
            / 255;
        let mut cum = 0u64;
        for (v, n) in hist.iter().enumerate().take(255) {
            cum += n;
            // A step of 0 keeps the channel: its table stays the identity.
            if let Some(q) = (cum + step / 2).checked_div(step) {
                lut[v + 1] = q.min(255) as u8;
            }
        }
        lut
    });
    pixels::map_channels(img, &luts)
}

/// torchvision's tensor `affine` with nearest sampling and zero fill, as its grid
/// (`_gen_affine_grid`) computes it in f32: the inverse map `m` (about the image centre)
/// transposed and divided by [w/2, h/2], one row for x and one for y.
pub(super) fn grid(img: &RgbImage, m: [f64; 6]) -> ([f32; 3], [f32; 3]) {
    let (wf, hf) = (img.width() as f32, img.height() as f32);
    let t = m.map(|v| v as f32);
    let (hw, hh) = (0.5 * wf, 0.5 * hf);
    (
        [t[0] / hw, t[1] / hw, t[2] / hw],
        [t[3] / hh, t[4] / hh, t[5] / hh],
    )
}
