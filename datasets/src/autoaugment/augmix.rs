//! AugMix as torchvision's `AugMix` computes it on 8-bit images (`all_ops=True`): its operation
//! space of 13 operations (no Identity) over 10 magnitude bins, `width` chains of operations
//! from the image, the chains weighed by a Dirichlet(alpha) draw, the image by a Beta(alpha,
//! alpha) one, summed in f32 and truncated back to 8 bits (`.to(torch.uint8)`). The draws
//! come from Hearth's seeded stream, not torch's, so a draw is AugMix's distribution, not
//! torchvision's bits for the same seed. Geometric operations sample the nearest pixel, as
//! the other policies here do; torchvision's `AugMix` defaults to bilinear sampling.

use image::RgbImage;

use super::ops::{linspace, make_op, round_half_even, signed_draw};
use crate::DataError;
use crate::mix::ln_gamma_draw;
use crate::rng::SplitMix64;

/// Magnitude bins of AugMix's tables (torchvision's `_PARAMETER_MAX`); a severity is 1 to this.
pub(super) const BINS: usize = 10;

/// AugMix's operations in torchvision's dict order, as indices into [`super::OPS`]: ShearX,
/// ShearY, TranslateX, TranslateY, Rotate, Posterize, Solarize, AutoContrast, Equalize, then
/// (`all_ops`) Brightness, Color, Contrast, Sharpness.
const SPACE: [usize; 13] = [1, 2, 3, 4, 5, 10, 11, 12, 13, 6, 7, 8, 9];

/// AugMix's magnitude table of operation `op` (an index into [`super::OPS`]) for a `w` x `h`
/// image, and whether a sign is drawn.
pub(super) fn space(op: usize, w: u32, h: u32) -> (Vec<f64>, bool) {
    let lin = |end: f32| linspace(0.0, end, BINS);
    match op {
        1 | 2 => (lin(0.3), true),
        3 => (lin(w as f32 / 3.0), true),
        4 => (lin(h as f32 / 3.0), true),
        5 => (lin(30.0), true),
        6..=9 => (lin(0.9), true),
        // 4 - (arange(10) / (9 / 4)).round(): 4, 4, 3, 3, 2, 2, 1, 1, 0, 0.
        10 => {
            let step = (BINS as f64 - 1.0) / 4.0;
            let bits = (0..BINS).map(|i| 4.0 - round_half_even((i as f32 / step as f32) as f64));
            (bits.collect(), false)
        }
        11 => (linspace(255.0, 0.0, BINS), false),
        _ => (Vec::new(), false),
    }
}

/// `n` weights from Dirichlet(alpha), summing to 1, in f32 as torch's sampler gives them.
fn dirichlet(rng: &mut SplitMix64, alpha: f64, n: usize) -> Vec<f32> {
    let logs: Vec<f64> = (0..n).map(|_| ln_gamma_draw(rng, alpha)).collect();
    let top = logs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = logs.iter().map(|l| (l - top).exp()).collect();
    let sum: f64 = e.iter().sum();
    e.iter().map(|v| (v / sum) as f32).collect()
}

/// One AugMix draw on `img`: `[severity, width, depth]` (depth 0: 1 to 3 per chain).
pub(super) fn apply(
    img: RgbImage,
    [severity, width, depth]: [u32; 3],
    alpha: f32,
    rng: &mut SplitMix64,
) -> RgbImage {
    let (w, h) = img.dimensions();
    let alpha = f64::from(alpha);
    let m = dirichlet(rng, alpha, 2);
    let chains: Vec<f32> = dirichlet(rng, alpha, width as usize)
        .into_iter()
        .map(|c| c * m[1])
        .collect();
    let mut mix: Vec<f32> = img.as_raw().iter().map(|&v| m[0] * f32::from(v)).collect();
    for weight in chains {
        let mut aug = img.clone();
        let steps = if depth > 0 {
            depth as usize
        } else {
            1 + rng.below(3)
        };
        for _ in 0..steps {
            let op = SPACE[rng.below(SPACE.len())];
            let (table, signed) = space(op, w, h);
            let magnitude = if table.is_empty() {
                0.0
            } else {
                table[rng.below((severity as usize).clamp(1, BINS))]
            };
            aug = make_op(op, signed_draw(magnitude, signed, rng)).apply(aug);
        }
        for (acc, &v) in mix.iter_mut().zip(aug.as_raw()) {
            *acc += weight * f32::from(v);
        }
    }
    let mut out = img;
    for (o, v) in out.iter_mut().zip(mix) {
        // `.to(torch.uint8)`: truncated (a convex mix stays within 0-255).
        *o = v.clamp(0.0, 255.0) as u8;
    }
    out
}

/// `augmix` or `augmix-mS-wW-dD-aA`, each part optional (torchvision's defaults: severity 3,
/// 3 chains, depth 0 for 1 to 3 drawn, alpha 1) as `([severity, width, depth], alpha)`; timm's
/// `b` (blended) and `mstd` are refused by name.
pub(super) fn parse(s: &str) -> Result<([u32; 3], f32), DataError> {
    let bad = |why: String| DataError::InvalidTransform(format!("auto augment {s:?}: {why}"));
    let (mut severity, mut width, mut depth, mut alpha) = (3u32, 3u32, 0u32, 1.0f32);
    for part in s.split('-').skip(1) {
        let at = part
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(part.len());
        let (key, value) = part.split_at(at);
        let whole = || {
            value
                .parse::<u32>()
                .map_err(|_| bad(format!("{part:?}: {key} takes a whole number")))
        };
        match key {
            "m" => severity = whole()?,
            "w" => width = whole()?,
            "d" => depth = whole()?,
            "a" => {
                alpha = value
                    .parse::<f32>()
                    .map_err(|_| bad(format!("{part:?}: a takes a number")))?
            }
            "b" | "mstd" => return Err(bad(format!("timm's {key:?} is not built"))),
            _ => {
                return Err(bad(format!(
                    "unknown part {part:?} (augmix takes m, w, d and a)"
                )));
            }
        }
    }
    Ok(([severity, width, depth], alpha))
}

#[cfg(test)]
mod tests {
    use super::super::Policy;
    use super::*;

    #[test]
    fn the_spelling_round_trips_and_bad_settings_are_named() {
        let p: Policy = "augmix".parse().unwrap();
        assert_eq!(
            p,
            Policy::AugMix {
                severity: 3,
                width: 3,
                depth: 0,
                alpha: 1.0
            }
        );
        for s in ["augmix-m3-w3-d0-a1", "augmix-m10-w1-d2-a0.5"] {
            let p: Policy = s.parse().unwrap();
            assert_eq!(p.to_string(), s);
            assert_eq!(p.to_string().parse::<Policy>().unwrap(), p);
        }
        for (s, says) in [
            ("augmix-m11", "severity 11"),
            ("augmix-m0", "severity 0"),
            ("augmix-w0", "0 chains"),
            ("augmix-a0", "alpha 0"),
            ("augmix-b", "\"b\" is not built"),
            ("augmix-x3", "unknown part"),
            ("augmix-m3x", "m takes a whole number"),
            ("augmix-aq", "unknown part \"aq\""),
        ] {
            let e = s.parse::<Policy>().unwrap_err().to_string();
            assert!(e.contains(says), "{s}: {e}");
        }
    }

    /// torchvision's tables: `linspace(0, 0.3, 10)`, posterize 4 4 3 3 2 2 1 1 0 0, solarize
    /// from 255 down to 0, translation to a third of the side.
    #[test]
    fn the_magnitude_tables_are_torchvisions() {
        let (shear, signed) = space(1, 30, 60);
        assert!(signed && shear.len() == BINS);
        assert!((shear[9] - 0.3).abs() < 1e-7 && shear[0] == 0.0);
        assert_eq!(
            space(10, 30, 60).0,
            [4.0, 4.0, 3.0, 3.0, 2.0, 2.0, 1.0, 1.0, 0.0, 0.0]
        );
        let (solarize, signed) = space(11, 30, 60);
        assert!(!signed && solarize[0] == 255.0 && solarize[9] == 0.0);
        assert!((space(3, 30, 60).0[9] - 10.0).abs() < 1e-5);
        assert!((space(4, 30, 60).0[9] - 20.0).abs() < 1e-5);
        assert!(space(12, 30, 60).0.is_empty() && space(0, 30, 60).0.is_empty());
    }

    /// Dirichlet(1) over n: each weight's mean 1/n and, for n = 2, Beta(1, 1)'s variance 1/12.
    #[test]
    fn the_mixing_weights_follow_their_distributions() {
        let mut rng = SplitMix64::new(5);
        let draws = 20_000;
        for n in [2usize, 3] {
            let mut sums = vec![0.0f64; n];
            let mut squares = 0.0f64;
            for _ in 0..draws {
                let w = dirichlet(&mut rng, 1.0, n);
                assert!((w.iter().sum::<f32>() - 1.0).abs() < 1e-5);
                for (s, v) in sums.iter_mut().zip(&w) {
                    *s += f64::from(*v);
                }
                squares += f64::from(w[0]).powi(2);
            }
            for s in &sums {
                let mean = s / draws as f64;
                assert!((mean - 1.0 / n as f64).abs() < 0.01, "n {n}: mean {mean}");
            }
            if n == 2 {
                let mean = sums[0] / draws as f64;
                let var = squares / draws as f64 - mean * mean;
                assert!((var - 1.0 / 12.0).abs() < 0.005, "variance {var}");
            }
        }
    }

    /// A draw repeats for the same stream and differs between streams; the severity bounds
    /// the magnitudes (at severity 1, bin 0, a black image stays black, where solarize's
    /// higher bins would turn it white).
    #[test]
    fn a_draw_repeats_for_its_stream_and_changes_with_it() {
        let img = RgbImage::from_fn(24, 20, |x, y| {
            image::Rgb([(x * 10) as u8, (y * 12) as u8, 128])
        });
        let p: Policy = "augmix".parse().unwrap();
        let a = p.apply(img.clone(), &mut SplitMix64::new(9));
        assert_eq!(a, p.apply(img.clone(), &mut SplitMix64::new(9)));
        let others = (10..20)
            .filter(|s| p.apply(img.clone(), &mut SplitMix64::new(*s)) != a)
            .count();
        assert!(
            others >= 9,
            "{others} of 10 other streams gave a different image"
        );
        assert_eq!(a.dimensions(), img.dimensions());
        // With severity 1 every magnitude is bin 0: no shear, shift, rotation or colour change,
        // posterize to 4 bits, solarize at 255; a black image stays black under all of them
        // but autocontrast and equalize, which leave a flat image as it is.
        let black = RgbImage::new(8, 8);
        let p: Policy = "augmix-m1".parse().unwrap();
        for seed in 0..20 {
            assert_eq!(p.apply(black.clone(), &mut SplitMix64::new(seed)), black);
        }
    }
}
