//! Composable, seeded image transforms. A [`Pipeline`] applied to the same image with the same
//! (seed, epoch, index) gives the same pixels, whatever thread or machine runs it.
//!
//! The train and eval defaults are torchvision's ImageNet recipes:
//! `RandomResizedCrop(224) + RandomHorizontalFlip()` and `Resize(256) + CenterCrop(224)`, both
//! followed by `ToTensor() + Normalize(mean, std)`.

use image::{Rgb, RgbImage};

use crate::autoaugment::Policy;
use crate::preprocess::{center_crop, resize_region, resize_shorter, to_chw_normalized};
use crate::rng::SplitMix64;
use crate::{DataError, Result};

/// One step of a pipeline.
#[derive(Debug, Clone, PartialEq)]
pub enum Transform {
    /// Shorter side to this size (torchvision `Resize(int)`).
    Resize(u32),
    /// Exact size, ignoring the aspect ratio (torchvision `Resize((h, w))`).
    ResizeExact(u32, u32),
    /// torchvision `RandomResizedCrop(size, scale, ratio)`.
    RandomResizedCrop {
        size: u32,
        scale: (f64, f64),
        ratio: (f64, f64),
    },
    CenterCrop(u32),
    /// Mirror left-right with this probability.
    HorizontalFlip(f64),
    /// Rotate by a uniform angle in [-degrees, degrees] about the centre, black fill.
    Rotation(f64),
    /// Shear along x by a uniform angle in [-degrees, degrees] (torchvision `RandomAffine(0,
    /// shear=degrees)`), black fill.
    Shear(f64),
    /// Brightness, contrast and saturation factors uniform in [1 - x, 1 + x], applied in that
    /// order (torchvision picks a random order; a fixed one keeps the pipeline cheaper).
    ColorJitter {
        brightness: f64,
        contrast: f64,
        saturation: f64,
    },
    /// torchvision's `RandAugment` or `TrivialAugmentWide` (their operations and magnitude
    /// tables, nearest sampling, fill 0).
    AutoAugment(Policy),
    /// torchvision `RandomErasing(p)` with its defaults (scale 0.02-0.33, ratio 0.3-3.3,
    /// value 0): with probability `p` a rectangle of the normalised tensor set to 0 (the
    /// mean colour). It acts on the tensor, so it runs after every image step.
    RandomErasing(f64),
}

impl Transform {
    fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(DataError::InvalidTransform(m));
        match *self {
            Transform::Resize(0) | Transform::CenterCrop(0) => bad("size must be positive".into()),
            Transform::ResizeExact(h, w) if h == 0 || w == 0 => bad("size must be positive".into()),
            Transform::RandomResizedCrop { size, scale, ratio } => {
                if size == 0 || !(0.0 < scale.0 && scale.0 <= scale.1 && scale.1 <= 1.0) {
                    return bad(format!("RandomResizedCrop size {size}, scale {scale:?}"));
                }
                if !(0.0 < ratio.0 && ratio.0 <= ratio.1) {
                    return bad(format!("RandomResizedCrop ratio {ratio:?}"));
                }
                Ok(())
            }
            Transform::HorizontalFlip(p) if !(0.0..=1.0).contains(&p) => {
                bad(format!("flip probability {p}"))
            }
            Transform::RandomErasing(p) if !(0.0..=1.0).contains(&p) => {
                bad(format!("random erasing probability {p}"))
            }
            Transform::Rotation(d) | Transform::Shear(d) if !(0.0..=180.0).contains(&d) => {
                bad(format!("angle {d} must be in [0, 180]"))
            }
            Transform::ColorJitter {
                brightness,
                contrast,
                saturation,
            } if [brightness, contrast, saturation]
                .iter()
                .any(|v| !(0.0..=1.0).contains(v)) =>
            {
                bad("color jitter strengths must be in [0, 1]".into())
            }
            Transform::AutoAugment(p) => p.validate(),
            _ => Ok(()),
        }
    }

    fn apply(&self, img: RgbImage, rng: &mut SplitMix64) -> RgbImage {
        match *self {
            Transform::Resize(s) => resize_shorter(&img, s),
            Transform::ResizeExact(h, w) => {
                if img.dimensions() == (w, h) {
                    img
                } else {
                    resize_region(&img, None, w, h)
                }
            }
            Transform::CenterCrop(s) => center_crop(&img, s),
            Transform::RandomResizedCrop { size, scale, ratio } => {
                let (x, y, w, h) =
                    random_resized_crop_box(img.width(), img.height(), scale, ratio, rng);
                resize_region(&img, Some((x, y, w, h)), size, size)
            }
            Transform::HorizontalFlip(p) => {
                if rng.next_f64() < p {
                    image::imageops::flip_horizontal(&img)
                } else {
                    img
                }
            }
            Transform::Rotation(deg) => {
                let angle = rng.uniform(-deg, deg).to_radians();
                affine(&img, angle, 0.0)
            }
            Transform::Shear(deg) => {
                let shear = rng.uniform(-deg, deg).to_radians();
                affine(&img, 0.0, shear)
            }
            Transform::ColorJitter {
                brightness,
                contrast,
                saturation,
            } => {
                let b = rng.uniform(1.0 - brightness, 1.0 + brightness) as f32;
                let c = rng.uniform(1.0 - contrast, 1.0 + contrast) as f32;
                let s = rng.uniform(1.0 - saturation, 1.0 + saturation) as f32;
                color_jitter(img, b, c, s)
            }
            Transform::AutoAugment(p) => p.apply(img, rng),
            // A tensor step: `Pipeline::apply` runs it on the floats.
            Transform::RandomErasing(_) => img,
        }
    }
}

/// torchvision's `RandomErasing.get_params` for an `h` x `w` image: up to 10 tries at an area
/// of 2-33% and a log-uniform aspect in 0.3-3.3; the box (top, left, height, width), or `None`
/// where no try fits (nothing is erased then, as in torchvision).
fn erasing_box(h: usize, w: usize, rng: &mut SplitMix64) -> Option<(usize, usize, usize, usize)> {
    let area = (h * w) as f64;
    let (lo, hi) = (0.3f64.ln(), 3.3f64.ln());
    for _ in 0..10 {
        let erase = area * rng.uniform(0.02, 0.33);
        let aspect = rng.uniform(lo, hi).exp();
        let eh = (erase * aspect).sqrt().round() as usize;
        let ew = (erase / aspect).sqrt().round() as usize;
        if eh == 0 || ew == 0 || eh >= h || ew >= w {
            continue;
        }
        let top = rng.below(h - eh + 1);
        let left = rng.below(w - ew + 1);
        return Some((top, left, eh, ew));
    }
    None
}

/// Sets the box of every channel of the CHW `image` (`size` x `size`) to 0.
fn erase(image: &mut [f32], size: usize, (top, left, h, w): (usize, usize, usize, usize)) {
    for plane in image.chunks_exact_mut(size * size) {
        for row in top..top + h {
            plane[row * size + left..row * size + left + w].fill(0.0);
        }
    }
}

/// torchvision's RandomResizedCrop box: 10 tries at a random area and log-uniform aspect, then
/// a centre crop with the ratio clamped.
fn random_resized_crop_box(
    width: u32,
    height: u32,
    scale: (f64, f64),
    ratio: (f64, f64),
    rng: &mut SplitMix64,
) -> (u32, u32, u32, u32) {
    let (wf, hf) = (width as f64, height as f64);
    let area = wf * hf;
    let (lr0, lr1) = (ratio.0.ln(), ratio.1.ln());
    for _ in 0..10 {
        let target = area * rng.uniform(scale.0, scale.1);
        let aspect = rng.uniform(lr0, lr1).exp();
        let w = (target * aspect).sqrt().round();
        let h = (target / aspect).sqrt().round();
        if w > 0.0 && h > 0.0 && w <= wf && h <= hf {
            let (w, h) = (w as u32, h as u32);
            let y = rng.below((height - h + 1) as usize) as u32;
            let x = rng.below((width - w + 1) as usize) as u32;
            return (x, y, w, h);
        }
    }
    let in_ratio = wf / hf;
    let (w, h) = if in_ratio < ratio.0 {
        (wf, (wf / ratio.0).round())
    } else if in_ratio > ratio.1 {
        ((hf * ratio.1).round(), hf)
    } else {
        (wf, hf)
    };
    let (w, h) = ((w as u32).clamp(1, width), (h as u32).clamp(1, height));
    ((width - w) / 2, (height - h) / 2, w, h)
}

/// Rotation by `angle` and x-shear by `shear` (radians) about the centre, inverse-mapped with
/// bilinear sampling and black fill.
fn affine(img: &RgbImage, angle: f64, shear: f64) -> RgbImage {
    let (w, h) = img.dimensions();
    let (cx, cy) = (w as f64 / 2.0, h as f64 / 2.0);
    // Forward: p' = R * S * p, with S = [[1, tan(shear)], [0, 1]]. Inverse: S^-1 * R^-1.
    let (sin, cos) = angle.sin_cos();
    let t = shear.tan();
    let mut out = RgbImage::new(w, h);
    for y in 0..h {
        for x in 0..w {
            let (dx, dy) = (x as f64 + 0.5 - cx, y as f64 + 0.5 - cy);
            // R^-1
            let (rx, ry) = (cos * dx + sin * dy, -sin * dx + cos * dy);
            // S^-1
            let (sx, sy) = (rx - t * ry, ry);
            let (fx, fy) = (sx + cx - 0.5, sy + cy - 0.5);
            if let Some(px) = bilinear(img, fx, fy) {
                out.put_pixel(x, y, px);
            }
        }
    }
    out
}

fn bilinear(img: &RgbImage, x: f64, y: f64) -> Option<Rgb<u8>> {
    let (w, h) = (img.width() as f64, img.height() as f64);
    if x < -0.5 || y < -0.5 || x > w - 0.5 || y > h - 0.5 {
        return None;
    }
    let x = x.clamp(0.0, w - 1.0);
    let y = y.clamp(0.0, h - 1.0);
    let (x0, y0) = (x.floor() as u32, y.floor() as u32);
    let (x1, y1) = (
        (x0 + 1).min(img.width() - 1),
        (y0 + 1).min(img.height() - 1),
    );
    let (ax, ay) = (x - x0 as f64, y - y0 as f64);
    let p = |xx, yy| img.get_pixel(xx, yy).0;
    let (p00, p10, p01, p11) = (p(x0, y0), p(x1, y0), p(x0, y1), p(x1, y1));
    let mut out = [0u8; 3];
    for c in 0..3 {
        let top = p00[c] as f64 * (1.0 - ax) + p10[c] as f64 * ax;
        let bottom = p01[c] as f64 * (1.0 - ax) + p11[c] as f64 * ax;
        out[c] = (top * (1.0 - ay) + bottom * ay).round().clamp(0.0, 255.0) as u8;
    }
    Some(Rgb(out))
}

fn color_jitter(mut img: RgbImage, brightness: f32, contrast: f32, saturation: f32) -> RgbImage {
    let gray = |p: &[u8; 3]| 0.299 * p[0] as f32 + 0.587 * p[1] as f32 + 0.114 * p[2] as f32;
    let n = (img.width() * img.height()).max(1) as f32;
    let mean: f32 = img.pixels().map(|p| gray(&p.0) * brightness).sum::<f32>() / n;
    for px in img.pixels_mut() {
        let mut v = px.0.map(|c| (c as f32 * brightness).clamp(0.0, 255.0));
        v = v.map(|c| ((c - mean) * contrast + mean).clamp(0.0, 255.0));
        let g = 0.299 * v[0] + 0.587 * v[1] + 0.114 * v[2];
        v = v.map(|c| ((c - g) * saturation + g).clamp(0.0, 255.0));
        px.0 = v.map(|c| c.round() as u8);
    }
    img
}

/// Transforms applied in order, then `ToTensor` + ImageNet `Normalize` to CHW floats.
#[derive(Debug, Clone, PartialEq)]
pub struct Pipeline {
    pub steps: Vec<Transform>,
    /// Output side: every pipeline must end at `size` x `size` (checked on each image).
    pub size: u32,
}

impl Pipeline {
    pub fn new(steps: Vec<Transform>, size: u32) -> Result<Self> {
        for s in &steps {
            s.validate()?;
        }
        if size == 0 {
            return Err(DataError::InvalidTransform(
                "output size must be positive".into(),
            ));
        }
        if size > crate::MAX_IMAGE_SIZE {
            return Err(DataError::InvalidTransform(format!(
                "output size {size} is above the largest image side, {}",
                crate::MAX_IMAGE_SIZE
            )));
        }
        Ok(Self { steps, size })
    }

    /// torchvision's training recipe: RandomResizedCrop(size), RandomHorizontalFlip(0.5).
    pub fn train(size: u32) -> Self {
        Self {
            steps: vec![
                Transform::RandomResizedCrop {
                    size,
                    scale: (0.08, 1.0),
                    ratio: (3.0 / 4.0, 4.0 / 3.0),
                },
                Transform::HorizontalFlip(0.5),
            ],
            size,
        }
    }

    /// torchvision's evaluation recipe: Resize(size * 8 / 7), CenterCrop(size) (256/224).
    pub fn eval(size: u32) -> Self {
        Self {
            steps: vec![
                Transform::Resize((size as f64 * 256.0 / 224.0).round() as u32),
                Transform::CenterCrop(size),
            ],
            size,
        }
    }

    /// Adds a step (builder style).
    pub fn with(mut self, step: Transform) -> Result<Self> {
        step.validate()?;
        self.steps.push(step);
        Ok(self)
    }

    /// The augmented image for (seed, epoch, index), before the tensor steps (random erasing).
    pub fn apply_image(&self, img: RgbImage, seed: u64, epoch: u64, index: u64) -> RgbImage {
        self.image_steps(img, &mut SplitMix64::for_sample(seed, epoch, index))
    }

    fn image_steps(&self, img: RgbImage, rng: &mut SplitMix64) -> RgbImage {
        let mut img = img;
        for step in &self.steps {
            img = step.apply(img, rng);
        }
        if img.dimensions() != (self.size, self.size) {
            img = resize_region(&img, None, self.size, self.size);
        }
        img
    }

    /// Appends the normalised CHW floats of the augmented image to `out`: the image steps,
    /// then the tensor steps on the floats, drawing from the same stream.
    pub fn apply(&self, img: RgbImage, seed: u64, epoch: u64, index: u64, out: &mut Vec<f32>) {
        let mut rng = SplitMix64::for_sample(seed, epoch, index);
        let img = self.image_steps(img, &mut rng);
        let start = out.len();
        to_chw_normalized(&img, out);
        let size = self.size as usize;
        for step in &self.steps {
            if let Transform::RandomErasing(p) = *step
                && rng.next_f64() < p
                && let Some(b) = erasing_box(size, size, &mut rng)
            {
                erase(&mut out[start..], size, b);
            }
        }
    }
}

/// A training augmentation recipe, as `hearth train` exposes it: an optional random resized
/// crop, a horizontal flip, rotation, shear and color jitter, each off at zero. Without a crop
/// the image is resized and center-cropped as in evaluation.
#[derive(Debug, Clone, PartialEq)]
pub struct Augmentation {
    /// Area fraction range of torchvision's `RandomResizedCrop` (aspect 3/4 to 4/3).
    pub crop_scale: Option<(f64, f64)>,
    pub flip: bool,
    /// Maximum rotation in degrees.
    pub rotate: f64,
    /// Maximum shear along x in degrees.
    pub shear: f64,
    /// Brightness, contrast and saturation strength.
    pub color_jitter: f64,
    /// RandAugment or TrivialAugmentWide after the flip (`None`: off).
    pub auto_augment: Option<Policy>,
    /// Probability of torchvision's `RandomErasing` (0: off).
    pub random_erasing: f64,
}

impl Augmentation {
    /// Nothing random: resize and center crop as in evaluation.
    pub fn none() -> Self {
        Self {
            crop_scale: None,
            flip: false,
            rotate: 0.0,
            shear: 0.0,
            color_jitter: 0.0,
            auto_augment: None,
            random_erasing: 0.0,
        }
    }

    /// Crops of 70-100% of the image and a horizontal flip: enough variety for a short
    /// fine-tuning run without hiding what small images show.
    pub fn light() -> Self {
        Self {
            crop_scale: Some((0.7, 1.0)),
            flip: true,
            ..Self::none()
        }
    }

    /// torchvision's ImageNet training recipe: crops of 8-100%, horizontal flip.
    pub fn imagenet() -> Self {
        Self {
            crop_scale: Some((0.08, 1.0)),
            flip: true,
            ..Self::none()
        }
    }

    /// The pipeline producing `size` x `size` images; an error names a bad setting.
    pub fn pipeline(&self, size: u32) -> Result<Pipeline> {
        let mut steps = match self.crop_scale {
            Some(scale) => vec![Transform::RandomResizedCrop {
                size,
                scale,
                ratio: (3.0 / 4.0, 4.0 / 3.0),
            }],
            None => Pipeline::eval(size).steps,
        };
        // Off at zero; any other value is a step, whose check refuses a negative angle (one
        // was taken as off).
        if self.rotate != 0.0 {
            steps.push(Transform::Rotation(self.rotate));
        }
        if self.shear != 0.0 {
            steps.push(Transform::Shear(self.shear));
        }
        if self.flip {
            steps.push(Transform::HorizontalFlip(0.5));
        }
        // torchvision's reference recipe: crop, flip, then the policy, on 8-bit pixels.
        if let Some(p) = self.auto_augment {
            steps.push(Transform::AutoAugment(p));
        }
        if self.color_jitter > 0.0 {
            let x = self.color_jitter;
            steps.push(Transform::ColorJitter {
                brightness: x,
                contrast: x,
                saturation: x,
            });
        }
        if self.random_erasing > 0.0 {
            steps.push(Transform::RandomErasing(self.random_erasing));
        }
        Pipeline::new(steps, size)
    }
}

impl std::fmt::Display for Augmentation {
    /// One line for logs and `hparams.json`, e.g. `crop 0.7-1, flip, rotate 10`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = vec![match self.crop_scale {
            Some((a, b)) => format!("random crop {a}-{b}"),
            None => "resize + center crop".into(),
        }];
        if self.flip {
            parts.push("flip".into());
        }
        if self.rotate > 0.0 {
            parts.push(format!("rotate {}", self.rotate));
        }
        if self.shear > 0.0 {
            parts.push(format!("shear {}", self.shear));
        }
        if self.color_jitter > 0.0 {
            parts.push(format!("color jitter {}", self.color_jitter));
        }
        if let Some(p) = self.auto_augment {
            parts.push(format!("auto augment {p}"));
        }
        if self.random_erasing > 0.0 {
            parts.push(format!("random erasing {}", self.random_erasing));
        }
        write!(f, "{}", parts.join(", "))
    }
}

#[cfg(test)]
mod tests;
