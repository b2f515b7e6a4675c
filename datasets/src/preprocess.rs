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
    // The JPEG decoder fills what a truncated file lacks with gray instead of failing: a file
    // whose last scan has no end-of-image marker after it is cut short.
    if reader.format() == Some(image::ImageFormat::Jpeg) && !jpeg_complete(bytes) {
        return Err(decode(
            "truncated JPEG: no end-of-image marker after the last scan".into(),
        ));
    }
    let img: DynamicImage = reader.decode().map_err(|e| decode(e.to_string()))?;
    if img.width() == 0 || img.height() == 0 {
        return Err(decode("image has no pixels".into()));
    }
    // No copy when the decoder already produced RGB8 (JPEG, most PNGs).
    Ok(img.into_rgb8())
}

/// Whether a JPEG stream holds an end-of-image marker (FF D9) after its last start-of-scan
/// (FF DA). Entropy-coded data stuffs every FF byte (FF 00), so neither pair occurs inside it;
/// data after the end marker (as cameras append) is allowed.
fn jpeg_complete(bytes: &[u8]) -> bool {
    let last_scan = bytes.windows(2).rposition(|w| w == [0xFF, 0xDA]);
    match last_scan {
        Some(at) => bytes[at..].windows(2).any(|w| w == [0xFF, 0xD9]),
        None => false,
    }
}

/// Resizes the `(left, top, width, height)` region of `img` (the whole image when `None`) to
/// `width` x `height`, bilinear with antialiasing when shrinking (as PIL, which torchvision uses).
/// SIMD through `fast_image_resize`; the `image` crate's resize is the fallback.
pub fn resize_region(
    img: &RgbImage,
    region: Option<(u32, u32, u32, u32)>,
    width: u32,
    height: u32,
) -> RgbImage {
    use fast_image_resize::{FilterType as F, PixelType, ResizeAlg, ResizeOptions, Resizer};
    thread_local! {
        static RESIZER: std::cell::RefCell<Resizer> = std::cell::RefCell::new(Resizer::new());
    }
    let (w, h) = img.dimensions();
    let (x, y, cw, ch) = region.unwrap_or((0, 0, w, h));
    let fast = || -> Option<RgbImage> {
        let src =
            fast_image_resize::images::ImageRef::new(w, h, img.as_raw(), PixelType::U8x3).ok()?;
        let mut dst = fast_image_resize::images::Image::new(width, height, PixelType::U8x3);
        let options = ResizeOptions::new()
            .resize_alg(ResizeAlg::Convolution(F::Bilinear))
            .crop(x as f64, y as f64, cw as f64, ch as f64);
        RESIZER
            .with(|r| r.borrow_mut().resize(&src, &mut dst, &options))
            .ok()?;
        RgbImage::from_raw(width, height, dst.into_vec())
    };
    fast().unwrap_or_else(|| {
        let crop = image::imageops::crop_imm(img, x, y, cw, ch).to_image();
        image::imageops::resize(&crop, width, height, FilterType::Triangle)
    })
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
    resize_region(img, None, nw, nh)
}

/// Crops the center `size` x `size` (torchvision `CenterCrop`); pads with black when smaller.
pub fn center_crop(img: &RgbImage, size: u32) -> RgbImage {
    let (w, h) = img.dimensions();
    let mut out = RgbImage::new(size, size);
    // torchvision: top = round((h - size) / 2), left likewise.
    let top = ((h as f64 - size as f64) / 2.0).round() as i64;
    let left = ((w as f64 - size as f64) / 2.0).round() as i64;
    if top >= 0 && left >= 0 {
        // The usual case: the crop lies inside the image.
        return image::imageops::crop_imm(img, left as u32, top as u32, size, size).to_image();
    }
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

/// RGB image to ImageNet-normalised CHW floats, appended to `out` (3 * H * W values).
pub fn to_chw_normalized(img: &RgbImage, out: &mut Vec<f32>) {
    to_chw_normalized_with(img, IMAGENET_MEAN, IMAGENET_STD, out)
}

/// RGB image to CHW floats `(v / 255 - mean) / std`, appended to `out` (3 * H * W values).
pub fn to_chw_normalized_with(img: &RgbImage, mean: [f32; 3], std: [f32; 3], out: &mut Vec<f32>) {
    let (w, h) = img.dimensions();
    let plane = (w * h) as usize;
    let start = out.len();
    out.resize(start + 3 * plane, 0.0);
    let dst = &mut out[start..];
    // (v / 255 - mean) / std  ==  v * scale - offset
    let scale = [0, 1, 2].map(|c| 1.0 / (255.0 * std[c]));
    let offset = [0, 1, 2].map(|c| mean[c] / std[c]);
    let (r, rest) = dst.split_at_mut(plane);
    let (g, b) = rest.split_at_mut(plane);
    for (i, px) in img.as_raw().chunks_exact(3).enumerate() {
        r[i] = px[0] as f32 * scale[0] - offset[0];
        g[i] = px[1] as f32 * scale[1] - offset[1];
        b[i] = px[2] as f32 * scale[2] - offset[2];
    }
}

/// torchvision's evaluation pipeline: `Resize(resize)`, `CenterCrop(crop)`, `ToTensor()`,
/// `Normalize(IMAGENET_MEAN, IMAGENET_STD)`. Returns `3 * crop * crop` CHW floats.
pub fn eval_preprocess(img: &RgbImage, resize: u32, crop: u32) -> Result<Vec<f32>> {
    eval_preprocess_with(img, resize, crop, IMAGENET_MEAN, IMAGENET_STD)
}

/// [`eval_preprocess`] with another normalisation.
pub fn eval_preprocess_with(
    img: &RgbImage,
    resize: u32,
    crop: u32,
    mean: [f32; 3],
    std: [f32; 3],
) -> Result<Vec<f32>> {
    if resize == 0 || crop == 0 || std.iter().any(|s| !(s.is_finite() && *s > 0.0)) {
        return Err(DataError::InvalidTransform(format!(
            "resize ({resize}), crop ({crop}) and std ({std:?}) must be positive"
        )));
    }
    let resized = resize_shorter(img, resize);
    let cropped = center_crop(&resized, crop);
    let mut out = Vec::with_capacity(3 * (crop * crop) as usize);
    to_chw_normalized_with(&cropped, mean, std, &mut out);
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
    fn simd_resize_matches_the_reference_filter_closely() {
        let img = RgbImage::from_fn(97, 61, |x, y| {
            image::Rgb([
                (x * 3 % 256) as u8,
                (y * 4 % 256) as u8,
                ((x + y) % 256) as u8,
            ])
        });
        let fast = resize_region(&img, Some((10, 5, 60, 50)), 40, 33);
        let crop = image::imageops::crop_imm(&img, 10, 5, 60, 50).to_image();
        let slow = image::imageops::resize(&crop, 40, 33, FilterType::Triangle);
        assert_eq!(fast.dimensions(), (40, 33));
        let diff: f64 = fast
            .as_raw()
            .iter()
            .zip(slow.as_raw())
            .map(|(a, b)| (*a as f64 - *b as f64).abs())
            .sum::<f64>()
            / fast.as_raw().len() as f64;
        assert!(diff < 3.0, "mean absolute difference {diff}");
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

#[cfg(test)]
mod truncation_tests {
    use super::*;

    /// A 64x64 PNG and a JPEG of noise (incompressible: every byte counts).
    fn encoded(format: image::ImageFormat) -> Vec<u8> {
        let mut state = 1u32;
        let img = RgbImage::from_fn(64, 64, |_, _| {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let b = state.to_le_bytes();
            image::Rgb([b[1], b[2], b[3]])
        });
        let mut out = std::io::Cursor::new(Vec::new());
        img.write_to(&mut out, format).unwrap();
        out.into_inner()
    }

    #[test]
    fn truncated_images_are_errors_never_partial_pixels() {
        for format in [image::ImageFormat::Png, image::ImageFormat::Jpeg] {
            let bytes = encoded(format);
            assert!(decode_rgb(&bytes, Path::new("whole")).is_ok());
            // Bytes after the end (a camera's trailer) are no truncation.
            let mut trailer = bytes.clone();
            trailer.extend_from_slice(b"trailing data");
            assert!(
                decode_rgb(&trailer, Path::new("trailer")).is_ok(),
                "{format:?}"
            );
            for keep in [
                bytes.len() / 2,
                bytes.len() * 9 / 10,
                bytes.len() / 10,
                bytes.len() - 16,
                bytes.len() - 13,
            ] {
                if format == image::ImageFormat::Jpeg && keep + 2 >= bytes.len() {
                    continue;
                }
                match decode_rgb(&bytes[..keep], Path::new("cut.img")) {
                    Ok(_) => panic!("{format:?} cut at {keep} of {} decoded", bytes.len()),
                    Err(e) => assert!(e.to_string().contains("cut.img"), "{e}"),
                }
            }
        }
    }
}
