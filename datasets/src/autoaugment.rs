//! RandAugment, TrivialAugmentWide and AugMix, as torchvision defines them
//! (`torchvision.transforms.RandAugment`, `TrivialAugmentWide`, `AugMix`): the same 14 operations, the
//! same magnitude tables (31 bins) and the same arithmetic on 8-bit pixels as torchvision's
//! tensor functions, so that an operation at a magnitude gives torchvision's pixels (checked
//! against fixtures that torchvision made, `scripts/make_autoaugment_fixtures.py`). The draws
//! come from Hearth's seeded stream, so a (seed, epoch, index) always gets the same policy.

use std::fmt;
use std::str::FromStr;

use image::RgbImage;

use crate::DataError;
use crate::rng::SplitMix64;

mod augmix;
mod ops;
mod pixels;
#[cfg(test)]
mod reference;

pub use ops::{OPS, Op};
use ops::{linspace, make_op, round_half_even, signed_draw};

/// Bins of the magnitude tables (torchvision's default `num_magnitude_bins`).
pub const BINS: usize = 31;

/// An augmentation policy drawn per image.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Policy {
    /// `ops` operations in a row, each drawn uniformly, all at magnitude bin `magnitude`
    /// (0-30) with a random sign where the operation has one (torchvision's defaults: 2, 9).
    RandAugment { ops: u32, magnitude: u32 },
    /// One operation with a uniform magnitude bin, over the wide ranges.
    TrivialAugmentWide,
    /// AugMix (Hendrycks et al. 2020, torchvision's `AugMix` with all operations): `width`
    /// chains of `depth` operations (0: 1 to 3, drawn per chain), each at a magnitude bin
    /// below `severity` of 10, mixed with Dirichlet(`alpha`) weights, and that mix blended with
    /// the image by a Beta(`alpha`, `alpha`) weight (torchvision's defaults: 3, 3, 0, 1).
    AugMix {
        severity: u32,
        width: u32,
        depth: u32,
        alpha: f32,
    },
}

impl Policy {
    /// The magnitude table of operation `op` (an index into [`OPS`]) for a `w` x `h` image:
    /// its values (31 bins; AugMix's 10) and whether a sign is drawn. Operations without a
    /// magnitude have none, and so has Identity under AugMix, which leaves it out.
    pub fn space(&self, op: usize, w: u32, h: u32) -> (Vec<f64>, bool) {
        if let Policy::AugMix { .. } = self {
            return augmix::space(op, w, h);
        }
        let wide = matches!(self, Policy::TrivialAugmentWide);
        let lin = |end: f32| linspace(0.0, end, BINS);
        match op {
            1 | 2 => (lin(if wide { 0.99 } else { 0.3 }), true),
            3 => (
                lin(if wide { 32.0 } else { 150.0 / 331.0 * w as f32 }),
                true,
            ),
            4 => (
                lin(if wide { 32.0 } else { 150.0 / 331.0 * h as f32 }),
                true,
            ),
            5 => (lin(if wide { 135.0 } else { 30.0 }), true),
            6..=9 => (lin(if wide { 0.99 } else { 0.9 }), true),
            10 => {
                // 8 - round(arange(31) / ((31 - 1) / k)): k = 4 here, 6 for the wide ranges.
                let k = if wide { 6.0 } else { 4.0 };
                let step = (BINS as f64 - 1.0) / k;
                let bits = (0..BINS).map(|i| 8.0 - round_half_even(i as f64 / step));
                (bits.collect(), false)
            }
            11 => (linspace(255.0, 0.0, BINS), false),
            _ => (Vec::new(), false),
        }
    }

    /// The operations for one image.
    pub fn draw(&self, w: u32, h: u32, rng: &mut SplitMix64) -> Vec<Op> {
        match *self {
            Policy::RandAugment { ops, magnitude } => (0..ops)
                .map(|_| {
                    let op = rng.below(OPS.len());
                    let (table, signed) = self.space(op, w, h);
                    let m = table.get(magnitude as usize).copied().unwrap_or(0.0);
                    make_op(op, signed_draw(m, signed, rng))
                })
                .collect(),
            // AugMix's chains are drawn as they are applied (`augmix.rs`).
            Policy::AugMix { .. } => Vec::new(),
            Policy::TrivialAugmentWide => {
                let op = rng.below(OPS.len());
                let (table, signed) = self.space(op, w, h);
                let m = if table.is_empty() {
                    0.0
                } else {
                    table[rng.below(BINS)]
                };
                vec![make_op(op, signed_draw(m, signed, rng))]
            }
        }
    }

    /// An error naming a setting outside torchvision's ranges (a policy built in code rather
    /// than parsed).
    pub fn validate(&self) -> Result<(), DataError> {
        match *self {
            Policy::RandAugment { ops, magnitude } if ops == 0 || magnitude >= BINS as u32 => {
                Err(DataError::InvalidTransform(format!(
                    "RandAugment with {ops} operations at magnitude {magnitude}: need at least 1 \
                     operation and a magnitude of 0-{}",
                    BINS - 1
                )))
            }
            Policy::AugMix {
                severity,
                width,
                alpha,
                ..
            } if !(1..=augmix::BINS as u32).contains(&severity)
                || width == 0
                || !(alpha.is_finite() && alpha > 0.0) =>
            {
                Err(DataError::InvalidTransform(format!(
                    "AugMix with severity {severity}, {width} chains and alpha {alpha}: need a \
                     severity of 1-{}, at least 1 chain and a positive alpha",
                    augmix::BINS
                )))
            }
            _ => Ok(()),
        }
    }

    /// The drawn operations applied in turn.
    pub fn apply(&self, img: RgbImage, rng: &mut SplitMix64) -> RgbImage {
        if let Policy::AugMix {
            severity,
            width,
            depth,
            alpha,
        } = *self
        {
            return augmix::apply(img, [severity, width, depth], alpha, rng);
        }
        let ops = self.draw(img.width(), img.height(), rng);
        ops.into_iter().fold(img, |img, op| op.apply(img))
    }
}

impl FromStr for Policy {
    type Err = DataError;

    /// `rand-m9-n2` (timm's spelling; `m` the magnitude bin 0-30, `n` the operations, each
    /// optional: `rand` is `rand-m9-n2`) or `trivialaugment` (also `ta_wide`, torchvision's
    /// reference scripts' name). timm's `mstd` and `inc` are refused by name: they are not
    /// built, and a policy silently without them would not be the one asked for.
    fn from_str(s: &str) -> Result<Self, DataError> {
        let bad = |why: String| {
            Err(DataError::InvalidTransform(format!(
                "auto augment {s:?}: {why}"
            )))
        };
        match s {
            "trivialaugment" | "ta_wide" | "trivial" => return Ok(Policy::TrivialAugmentWide),
            _ if s == "augmix" || s.starts_with("augmix-") => {
                let ([severity, width, depth], alpha) = augmix::parse(s)?;
                let p = Policy::AugMix {
                    severity,
                    width,
                    depth,
                    alpha,
                };
                return p.validate().map(|()| p);
            }
            _ => {}
        }
        let mut parts = s.split('-');
        if parts.next() != Some("rand") {
            return bad(
                "expected rand[-mM][-nN] (RandAugment), trivialaugment or augmix[-mS-wW-dD-aA]"
                    .into(),
            );
        }
        let (mut ops, mut magnitude) = (2u32, 9u32);
        for part in parts {
            let (key, value) = part.split_at(
                part.find(|c: char| c.is_ascii_digit())
                    .unwrap_or(part.len()),
            );
            let number = || {
                value
                    .parse::<u32>()
                    .map_err(|_| format!("{part:?}: {key} takes a whole number"))
            };
            match key {
                "m" => match number() {
                    Ok(m) if m < BINS as u32 => magnitude = m,
                    Ok(m) => return bad(format!("magnitude {m} is above {}", BINS - 1)),
                    Err(e) => return bad(e),
                },
                "n" => match number() {
                    Ok(n) if n > 0 => ops = n,
                    Ok(_) => return bad("n must be at least 1".into()),
                    Err(e) => return bad(e),
                },
                "mstd" | "mmax" | "inc" | "w" => {
                    return bad(format!("timm's {key:?} is not built (rand-mM-nN is)"));
                }
                _ => return bad(format!("unknown part {part:?} (rand takes m and n)")),
            }
        }
        Ok(Policy::RandAugment { ops, magnitude })
    }
}

impl fmt::Display for Policy {
    /// The spelling [`FromStr`] reads back: `rand-m9-n2`, `trivialaugment` or
    /// `augmix-m3-w3-d0-a1`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Policy::RandAugment { ops, magnitude } => write!(f, "rand-m{magnitude}-n{ops}"),
            Policy::TrivialAugmentWide => write!(f, "trivialaugment"),
            Policy::AugMix {
                severity,
                width,
                depth,
                alpha,
            } => write!(f, "augmix-m{severity}-w{width}-d{depth}-a{alpha}"),
        }
    }
}

#[cfg(test)]
mod tests;
