//! A learnable synthetic image-folder data set: each class is a shape with a colour, drawn at
//! varied positions, sizes and shades over a noisy background. Tests, examples, benches and
//! `hearth train`'s default all use it (`hearth data synth`).

use std::path::{Path, PathBuf};

use image::{Rgb, RgbImage};

use crate::rng::SplitMix64;
use crate::{DataError, Result};

const SHAPES: [&str; 5] = ["disc", "square", "triangle", "ring", "cross"];
const COLOURS: [(&str, [u8; 3]); 6] = [
    ("red", [220, 40, 40]),
    ("green", [40, 190, 60]),
    ("blue", [50, 80, 220]),
    ("yellow", [230, 210, 40]),
    ("magenta", [200, 50, 200]),
    ("cyan", [40, 200, 210]),
];

/// What to generate.
#[derive(Debug, Clone)]
pub struct SynthConfig {
    pub classes: usize,
    pub per_class: usize,
    /// Image side in pixels.
    pub size: u32,
    pub seed: u64,
    /// Also write `val/` with this many images per class (0: only the flat class folders).
    pub val_per_class: usize,
    /// Write JPEG (quality 90) instead of PNG.
    pub jpeg: bool,
}

impl SynthConfig {
    pub fn new(classes: usize, per_class: usize, size: u32) -> Self {
        Self {
            classes,
            per_class,
            size,
            seed: 0,
            val_per_class: 0,
            jpeg: false,
        }
    }
    pub fn with_jpeg(mut self, on: bool) -> Self {
        self.jpeg = on;
        self
    }
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }
    pub fn with_val(mut self, per_class: usize) -> Self {
        self.val_per_class = per_class;
        self
    }
}

/// Class names in class order: `c00_red_disc`, `c01_green_square`, ...
pub fn class_names(classes: usize) -> Vec<String> {
    (0..classes)
        .map(|c| {
            let shape = SHAPES[c % SHAPES.len()];
            let colour = COLOURS[c % COLOURS.len()].0;
            format!("c{c:02}_{colour}_{shape}")
        })
        .collect()
}

/// Shape `c mod 5` and colour `c mod 6`: distinct pairs for every class below 30 (5 and 6 are
/// coprime), so no two classes look alike.
fn colour_of(class: usize) -> [u8; 3] {
    COLOURS[class % COLOURS.len()].1
}

fn inside(shape: usize, dx: f64, dy: f64, r: f64) -> bool {
    match shape {
        0 => dx * dx + dy * dy <= r * r,
        1 => dx.abs() <= r * 0.8 && dy.abs() <= r * 0.8,
        2 => dy <= r * 0.8 && dy >= -r && dx.abs() <= (dy + r) * 0.6,
        3 => {
            let d = (dx * dx + dy * dy).sqrt();
            d <= r && d >= r * 0.55
        }
        _ => (dx.abs() <= r * 0.3 && dy.abs() <= r) || (dy.abs() <= r * 0.3 && dx.abs() <= r),
    }
}

/// One image of `class`; the same (seed, class, index) always gives the same pixels.
pub fn render(class: usize, index: usize, size: u32, seed: u64) -> RgbImage {
    let mut rng = SplitMix64::for_sample(seed, class as u64, index as u64);
    let s = size as f64;
    let r = s * rng.uniform(0.18, 0.32);
    let cx = rng.uniform(r, s - r);
    let cy = rng.uniform(r, s - r);
    let base = colour_of(class);
    let shade = rng.uniform(0.75, 1.15);
    let bg = [
        rng.uniform(20.0, 120.0),
        rng.uniform(20.0, 120.0),
        rng.uniform(20.0, 120.0),
    ];
    let shape = class % SHAPES.len();
    let mut img = RgbImage::new(size, size);
    for y in 0..size {
        for x in 0..size {
            let (dx, dy) = (x as f64 + 0.5 - cx, y as f64 + 0.5 - cy);
            let mut px = if inside(shape, dx, dy, r) {
                [
                    base[0] as f64 * shade,
                    base[1] as f64 * shade,
                    base[2] as f64 * shade,
                ]
            } else {
                bg
            };
            for v in &mut px {
                *v += rng.uniform(-25.0, 25.0);
            }
            img.put_pixel(x, y, Rgb(px.map(|v| v.clamp(0.0, 255.0) as u8)));
        }
    }
    img
}

fn write_split(dir: &Path, cfg: &SynthConfig, per_class: usize, offset: usize) -> Result<usize> {
    let names = class_names(cfg.classes);
    let mut written = 0;
    for (class, name) in names.iter().enumerate() {
        let class_dir = dir.join(name);
        std::fs::create_dir_all(&class_dir).map_err(|source| DataError::Io {
            path: class_dir.clone(),
            source,
        })?;
        for i in 0..per_class {
            let img = render(class, offset + i, cfg.size, cfg.seed);
            let ext = if cfg.jpeg { "jpg" } else { "png" };
            let path = class_dir.join(format!("{:05}.{ext}", offset + i));
            let saved = if cfg.jpeg {
                std::fs::File::create(&path)
                    .map_err(|e| e.to_string())
                    .and_then(|f| {
                        let mut w = std::io::BufWriter::new(f);
                        image::codecs::jpeg::JpegEncoder::new_with_quality(&mut w, 90)
                            .encode_image(&img)
                            .map_err(|e| e.to_string())
                    })
            } else {
                img.save(&path).map_err(|e| e.to_string())
            };
            saved.map_err(|reason| DataError::Write {
                path: path.clone(),
                reason,
            })?;
            written += 1;
        }
    }
    Ok(written)
}

/// Writes the data set under `out`: `out/<class>/NNNNN.png`, or with `val_per_class > 0`,
/// `out/train/<class>/...` and `out/val/<class>/...`. Returns the image count.
pub fn generate(out: &Path, cfg: &SynthConfig) -> Result<usize> {
    if cfg.classes < 2
        || cfg.classes > 30
        || cfg.per_class == 0
        || !(8..=crate::MAX_IMAGE_SIZE).contains(&cfg.size)
    {
        return Err(DataError::InvalidArgument(format!(
            "synthetic data needs 2..=30 classes, at least 1 image per class and a size of \
             8..={} (got {} classes, {} per class, size {})",
            crate::MAX_IMAGE_SIZE,
            cfg.classes,
            cfg.per_class,
            cfg.size
        )));
    }
    if cfg.val_per_class == 0 {
        write_split(out, cfg, cfg.per_class, 0)
    } else {
        let train: PathBuf = out.join("train");
        let val: PathBuf = out.join("val");
        Ok(write_split(&train, cfg, cfg.per_class, 0)?
            + write_split(&val, cfg, cfg.val_per_class, cfg.per_class)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rendering_is_deterministic_and_classes_differ() {
        assert_eq!(render(3, 7, 32, 1), render(3, 7, 32, 1));
        assert_ne!(render(3, 7, 32, 1), render(3, 8, 32, 1));
        assert_ne!(render(2, 7, 32, 1), render(3, 7, 32, 1));
        // Every class up to the maximum of 30 has its own (shape, colour) pair.
        let names = class_names(30);
        let unique: std::collections::HashSet<_> = names
            .iter()
            .map(|n| n.split_once('_').map(|(_, rest)| rest.to_string()))
            .collect();
        assert_eq!(unique.len(), 30);
    }

    /// A side past `MAX_IMAGE_SIZE` is refused before anything is written (a 100000-pixel side
    /// was a 30 GB allocation that ended the process).
    #[test]
    fn a_side_past_the_largest_is_refused_before_writing() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("set");
        let err = generate(&out, &SynthConfig::new(2, 1, 100_000)).unwrap_err();
        assert!(err.to_string().contains("size of 8..=4096"), "{err}");
        assert!(!out.exists());
    }
}
