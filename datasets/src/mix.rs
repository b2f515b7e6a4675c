//! Mixup (Zhang et al. 2018) and CutMix (Yun et al. 2019) on a training batch, by torchvision's
//! reference rule (`references/classification/transforms.py`, `RandomMixup` and
//! `RandomCutmix`; `transforms.v2.MixUp` and `CutMix`) and timm's switches:
//!
//! - each image is mixed with the one before it in the batch (the batch rolled by one), with
//!   one weight `lam` per batch drawn from Beta(alpha, alpha);
//! - mixup blends the two images, `lam * x + (1 - lam) * rolled`;
//! - cutmix pastes a box of the rolled batch: a centre uniform over the image, half-sides
//!   `int(0.5 * sqrt(1 - lam) * side)`, clipped at the borders; `lam` becomes the share of the
//!   image left;
//! - the targets mix with the same `lam` (the caller's: [`Mix::lam`]);
//! - with both on, a batch takes cutmix with probability `switch_prob` (timm's default 0.5),
//!   and a batch is mixed at all with probability `prob` (timm's `mixup_prob`).
//!
//! The draw is a function of (seed, epoch, the batch's sample indices) alone, so a rank that
//! loads the same batch (a pipeline's first and last stages) draws the same, and a resumed run
//! draws what the uninterrupted one drew.

use std::ops::Range;

use burn::prelude::*;

use crate::rng::{Fnv64, SplitMix64};

/// What mixing a run asks for. Alphas of 0 leave that kind off.
#[derive(Debug, Clone, PartialEq)]
pub struct Mixing {
    /// Mixup's Beta(alpha, alpha) (timm's `--mixup`; 0: off).
    pub mixup: f64,
    /// CutMix's Beta(alpha, alpha) (timm's `--cutmix`; 0: off).
    pub cutmix: f64,
    /// Probability that a batch is mixed (timm's `--mixup-prob`, default 1).
    pub prob: f64,
    /// With both on, the probability that a batch takes cutmix rather than mixup (timm's
    /// `--mixup-switch-prob`, default 0.5).
    pub switch_prob: f64,
    /// Mixing stops after this epoch (counted from 1; timm's `--mixup-off-epoch`); 0: never.
    pub off_epoch: u64,
}

impl Default for Mixing {
    fn default() -> Self {
        Self {
            mixup: 0.0,
            cutmix: 0.0,
            prob: 1.0,
            switch_prob: 0.5,
            off_epoch: 0,
        }
    }
}

/// One batch's mixing.
#[derive(Debug, Clone, PartialEq)]
pub enum Mix {
    /// Mixup: `lam * x + (1 - lam) * rolled`.
    Blend { lam: f64 },
    /// CutMix: rows and columns of the rolled batch pasted; `lam` is the share left.
    Paste {
        lam: f64,
        rows: Range<usize>,
        cols: Range<usize>,
    },
}

/// Keeps the draws apart from augmentation's, which use the same seed.
const SALT: u64 = 0x6D69_7875_7063_7574;

impl Mixing {
    /// Whether any mixing is asked for.
    pub fn on(&self) -> bool {
        self.mixup > 0.0 || self.cutmix > 0.0
    }

    /// What is wrong with these settings, if anything: the setting's name (timm's) and why.
    pub fn check(&self) -> Option<(&'static str, String)> {
        for (name, alpha) in [("mixup", self.mixup), ("cutmix", self.cutmix)] {
            if !(alpha.is_finite() && alpha >= 0.0) {
                return Some((name, format!("alpha {alpha} must be 0 (off) or positive")));
            }
        }
        for (name, p) in [
            ("mixup_prob", self.prob),
            ("mixup_switch_prob", self.switch_prob),
        ] {
            if !(0.0..=1.0).contains(&p) {
                return Some((name, format!("{p} must be a probability in 0-1")));
            }
        }
        // A switch that would change nothing is refused, not ignored.
        let alone = Self {
            mixup: self.mixup,
            cutmix: self.cutmix,
            ..Self::default()
        };
        if !self.on() && *self != alone {
            let name = if self.prob != 1.0 {
                "mixup_prob"
            } else if self.off_epoch != 0 {
                "mixup_off_epoch"
            } else {
                "mixup_switch_prob"
            };
            return Some((name, "does nothing without mixup or cutmix".into()));
        }
        if self.switch_prob != 0.5 && !(self.mixup > 0.0 && self.cutmix > 0.0) {
            return Some((
                "mixup_switch_prob",
                "chooses between mixup and cutmix: it needs both on".into(),
            ));
        }
        None
    }

    /// The mixing of the batch of `indices` in epoch `epoch` (counted from 0, the loader's)
    /// for `h` x `w` images: `None` where the batch is left as it is (mixing off, past
    /// `off_epoch`, or the `prob` draw).
    pub fn draw(
        &self,
        seed: u64,
        epoch: u64,
        indices: &[usize],
        h: usize,
        w: usize,
    ) -> Option<Mix> {
        if !self.on() || (self.off_epoch > 0 && epoch >= self.off_epoch) {
            return None;
        }
        let mut key = Fnv64::new();
        for i in indices {
            key.write(&(*i as u64).to_le_bytes());
        }
        let mut rng = SplitMix64::for_sample(seed ^ SALT, epoch, key.finish());
        if rng.next_f64() >= self.prob {
            return None;
        }
        let cutmix = match (self.mixup > 0.0, self.cutmix > 0.0) {
            (true, true) => rng.next_f64() < self.switch_prob,
            (false, true) => true,
            _ => false,
        };
        if !cutmix {
            return Some(Mix::Blend {
                lam: beta(&mut rng, self.mixup),
            });
        }
        let lam = beta(&mut rng, self.cutmix);
        let (cx, cy) = (rng.below(w.max(1)), rng.below(h.max(1)));
        let r = 0.5 * (1.0 - lam).max(0.0).sqrt();
        let (half_w, half_h) = ((r * w as f64) as usize, (r * h as f64) as usize);
        let cols = cx.saturating_sub(half_w)..(cx + half_w).min(w);
        let rows = cy.saturating_sub(half_h)..(cy + half_h).min(h);
        let area = (cols.len() * rows.len()) as f64 / (w * h).max(1) as f64;
        Some(Mix::Paste {
            lam: 1.0 - area,
            rows,
            cols,
        })
    }
}

impl Mix {
    /// The weight of each sample's own target (the rolled batch's takes `1 - lam`).
    pub fn lam(&self) -> f64 {
        match self {
            Self::Blend { lam } | Self::Paste { lam, .. } => *lam,
        }
    }

    /// The batch `[n, c, h, w]` mixed with itself rolled by one (sample `i` with `i - 1`,
    /// the first with the last).
    pub fn images(&self, images: Tensor<4>) -> Tensor<4> {
        let rolled = roll(images.clone());
        match self {
            Self::Blend { lam } => images * (*lam as f32) + rolled * (1.0 - *lam as f32),
            Self::Paste { rows, cols, .. } => {
                if rows.is_empty() || cols.is_empty() {
                    return images;
                }
                let [n, c, _, _] = images.dims();
                let part = rolled.slice([0..n, 0..c, rows.clone(), cols.clone()]);
                images.slice_assign([0..n, 0..c, rows.clone(), cols.clone()], part)
            }
        }
    }
}

/// `t` rolled by one along its first dimension, as `torch.roll(t, 1, 0)`: row `i` holds row
/// `i - 1`, row 0 the last.
pub fn roll<const D: usize, K>(t: Tensor<D, K>) -> Tensor<D, K>
where
    K: burn::tensor::kind::Basic,
{
    let n = t.dims()[0];
    if n < 2 {
        return t;
    }
    Tensor::cat(
        vec![t.clone().narrow(0, n - 1, 1), t.narrow(0, 0, n - 1)],
        0,
    )
}

/// A draw from Beta(alpha, alpha), as `X / (X + Y)` for X, Y from Gamma(alpha), in logs so
/// that a small alpha (mixup's usual 0.2) cannot underflow to 0 / 0.
fn beta(rng: &mut SplitMix64, alpha: f64) -> f64 {
    let (x, y) = (ln_gamma_draw(rng, alpha), ln_gamma_draw(rng, alpha));
    1.0 / (1.0 + (y - x).exp())
}

/// The log of a draw from Gamma(alpha, 1): Marsaglia and Tsang's method (2000), with
/// `Gamma(alpha) = Gamma(alpha + 1) * U^(1 / alpha)` below 1.
pub(crate) fn ln_gamma_draw(rng: &mut SplitMix64, alpha: f64) -> f64 {
    if alpha < 1.0 {
        let u = 1.0 - rng.next_f64(); // in (0, 1]
        return ln_gamma_draw(rng, alpha + 1.0) + u.ln() / alpha;
    }
    let d = alpha - 1.0 / 3.0;
    let c = 1.0 / (9.0 * d).sqrt();
    loop {
        let x = normal(rng);
        let v = 1.0 + c * x;
        if v <= 0.0 {
            continue;
        }
        let v = v * v * v;
        let u = 1.0 - rng.next_f64();
        if u.ln() < 0.5 * x * x + d - d * v + d * v.ln() {
            return d.ln() + v.ln();
        }
    }
}

/// A standard normal draw (Box-Muller).
fn normal(rng: &mut SplitMix64) -> f64 {
    let u = 1.0 - rng.next_f64();
    let v = rng.next_f64();
    (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
}

#[cfg(test)]
mod tests;
