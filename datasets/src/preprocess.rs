//! torchvision's standard evaluation preprocessing: resize the shorter side, center crop,
//! scale to [0, 1], normalise with the ImageNet mean and std, CHW layout.

use std::path::Path;

use image::imageops::FilterType;
use image::{DynamicImage, RgbImage};

use crate::{DataError, Result};

/// ImageNet channel means (RGB), as torchvision's `transforms.Normalize` uses them.
pub const IMAGENET_MEAN: [f32; 3] = [0.485, 0.456, 0.406];
/// ImageNet channel standard deviations (RGB).
pub const IMAGENET_STD: [f32; 3] = [0.229, 0.224, 0.225];

/// Opens and decodes an image file as RGB, with an error that names the file.
pub fn load_rgb(path: &Path) -> Result<RgbImage> {
    let bytes = std::fs::read(path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    decode_rgb(&bytes, path)
}

/// Decodes image bytes (format guessed from the content) as RGB.
pub fn decode_rgb(bytes: &[u8], path: &Path) -> Result<RgbImage> {
    let decode = |reason: String| DataError::Decode {
        path: path.to_path_buf(),
        reason,
    };
    if bytes.is_empty() {
        return Err(decode("empty file".into()));
    }
    let reader = image::ImageReader::new(std::io::Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| decode(e.to_string()))?;
    if reader.format().is_none() {
        return Err(decode("not a known image format".into()));
    }
    let img: DynamicImage = reader.decode().map_err(|e| decode(e.to_string()))?;
    if img.width() == 0 || img.height() == 0 {
        return Err(decode("image has no pixels".into()));
    }
    Ok(img.to_rgb8())
}

/// Resizes so the shorter side is `size` (torchvision `Resize(int)`), bilinear.
pub fn resize_shorter(img: &RgbImage, size: u32) -> RgbImage {
    let (w, h) = img.dimensions();
    let (nw, nh) = if w <= h {
        (size, ((h as u64 * size as u64) / w as u64).max(1) as u32)
    } else {
        (((w as u64 * size as u64) / h as u64).max(1) as u32, size)
    };
    if (nw, nh) == (w, h) {
        return img.clone();
    }
    image::imageops::resize(img, nw, nh, FilterType::Triangle)
}

/// Crops the center `size` x `size` (torchvision `CenterCrop`); pads with black when smaller.
pub fn center_crop(img: &RgbImage, size: u32) -> RgbImage {
    let (w, h) = img.dimensions();
    let mut out = RgbImage::new(size, size);
    // torchvision: top = round((h - size) / 2), left likewise.
    let top = ((h as f64 - size as f64) / 2.0).round() as i64;
    let left = ((w as f64 - size as f64) / 2.0).round() as i64;
    for y in 0..size {
        for x in 0..size {
            let (sx, sy) = (x as i64 + left, y as i64 + top);
            if sx >= 0 && sy >= 0 && (sx as u32) < w && (sy as u32) < h {
                out.put_pixel(x, y, *img.get_pixel(sx as u32, sy as u32));
            }
        }
    }
    out
}

/// RGB image to normalised CHW floats, appended to `out` (3 * H * W values).
pub fn to_chw_normalized(img: &RgbImage, out: &mut Vec<f32>) {
    let (w, h) = img.dimensions();
    let plane = (w * h) as usize;
    let start = out.len();
    out.resize(start + 3 * plane, 0.0);
    let dst = &mut out[start..];
    for (i, px) in img.pixels().enumerate() {
        for c in 0..3 {
            dst[c * plane + i] = (px[c] as f32 / 255.0 - IMAGENET_MEAN[c]) / IMAGENET_STD[c];
        }
    }
}

/// torchvision's evaluation pipeline: `Resize(resize)`, `CenterCrop(crop)`, `ToTensor()`,
/// `Normalize(IMAGENET_MEAN, IMAGENET_STD)`. Returns `3 * crop * crop` CHW floats.
pub fn eval_preprocess(img: &RgbImage, resize: u32, crop: u32) -> Result<Vec<f32>> {
    if resize == 0 || crop == 0 {
        return Err(DataError::InvalidTransform(format!(
            "resize ({resize}) and crop ({crop}) must be positive"
        )));
    }
    let resized = resize_shorter(img, resize);
    let cropped = center_crop(&resized, crop);
    let mut out = Vec::with_capacity(3 * (crop * crop) as usize);
    to_chw_normalized(&cropped, &mut out);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resize_keeps_aspect_and_sets_shorter_side() {
        let img = RgbImage::new(400, 300);
        assert_eq!(resize_shorter(&img, 256).dimensions(), (341, 256));
        let tall = RgbImage::new(100, 300);
        assert_eq!(resize_shorter(&tall, 50).dimensions(), (50, 150));
    }

    #[test]
    fn center_crop_takes_the_middle() {
        let mut img = RgbImage::new(5, 5);
        img.put_pixel(2, 2, image::Rgb([9, 9, 9]));
        let c = center_crop(&img, 1);
        assert_eq!(c.get_pixel(0, 0), &image::Rgb([9, 9, 9]));
    }

    #[test]
    fn normalisation_matches_torchvision_constants() {
        let img = RgbImage::from_pixel(1, 1, image::Rgb([255, 0, 128]));
        let mut out = Vec::new();
        to_chw_normalized(&img, &mut out);
        let expect = [
            (1.0 - 0.485) / 0.229,
            (0.0 - 0.456) / 0.224,
            (128.0 / 255.0 - 0.406) / 0.225,
        ];
        for (a, b) in out.iter().zip(expect) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
    }

    #[test]
    fn garbage_bytes_are_an_error_naming_the_file() {
        let err = decode_rgb(b"not an image at all", Path::new("x/bad.jpg")).unwrap_err();
        assert!(err.to_string().contains("x/bad.jpg"), "{err}");
        let err = decode_rgb(b"", Path::new("empty.png")).unwrap_err();
        assert!(err.to_string().contains("empty file"), "{err}");
        // A PNG signature followed by nothing: truncated.
        let err = decode_rgb(b"\x89PNG\r\n\x1a\n\0\0", Path::new("t.png")).unwrap_err();
        assert!(err.to_string().contains("t.png"), "{err}");
    }
}
