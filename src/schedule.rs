//! Learning-rate schedules with linear warmup, and large-batch scaling rules.
//!
//! One closed-form [`LrScheduler`] instead of composing Burn's schedulers, so that the rate at
//! any iteration is a pure function of the iteration (exact resume from a checkpoint: the record
//! holds only the iteration).

use burn::optim::LearningRate;
use burn::optim::lr_scheduler::{LrScheduler, LrSchedulerRecord};

use crate::{HearthError, Result};

/// What happens after warmup (`hparams.json` writes it as `{"decay": "step", "step_size": ..}`).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "decay", rename_all = "lowercase")]
pub enum Decay {
    Constant,
    /// Multiply by `gamma` every `step_size` iterations (after warmup).
    Step {
        step_size: usize,
        gamma: f64,
    },
    /// Cosine from the base rate down to `min_lr` at the last iteration.
    Cosine {
        min_lr: f64,
    },
}

/// The schedule names `--schedule` takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum ScheduleKind {
    /// The base rate after warmup.
    Constant,
    /// A tenth of the rate at each third of the run.
    Step,
    /// Cosine down to zero at the last step.
    Cosine,
}

crate::names::named_settings!(ScheduleKind { Constant => "constant", Step => "step", Cosine => "cosine" });

impl ScheduleKind {
    /// The decay it names (the step size of `Step` is set from the run's length).
    pub fn decay(self) -> Decay {
        match self {
            ScheduleKind::Constant => Decay::Constant,
            ScheduleKind::Cosine => Decay::Cosine { min_lr: 0.0 },
            ScheduleKind::Step => Decay::Step {
                step_size: 0,
                gamma: 0.1,
            },
        }
    }
}

/// Warmup then decay, by iteration.
#[derive(Debug, Clone)]
pub struct Schedule {
    pub base_lr: f64,
    pub warmup_iters: usize,
    pub total_iters: usize,
    pub decay: Decay,
    iteration: usize,
}

impl Schedule {
    pub fn new(
        base_lr: f64,
        warmup_iters: usize,
        total_iters: usize,
        decay: Decay,
    ) -> Result<Self> {
        if !(base_lr.is_finite() && base_lr > 0.0) {
            return Err(HearthError::InvalidArgument(format!(
                "learning rate {base_lr} must be positive"
            )));
        }
        if let Decay::Step { step_size: 0, .. } = decay {
            return Err(HearthError::InvalidArgument(
                "step schedule needs a positive step size".into(),
            ));
        }
        Ok(Self {
            base_lr,
            warmup_iters,
            total_iters: total_iters.max(1),
            decay,
            iteration: 0,
        })
    }

    /// The rate at iteration `i` (0-based).
    pub fn lr_at(&self, i: usize) -> f64 {
        if i < self.warmup_iters {
            // Goyal et al.: linear from base/warmup to base.
            return self.base_lr * (i + 1) as f64 / self.warmup_iters as f64;
        }
        let t = i - self.warmup_iters;
        match self.decay {
            Decay::Constant => self.base_lr,
            Decay::Step { step_size, gamma } => {
                self.base_lr * gamma.powi((t / step_size.max(1)) as i32)
            }
            Decay::Cosine { min_lr } => {
                let span = self.total_iters.saturating_sub(self.warmup_iters).max(1);
                let progress = (t as f64 / span as f64).min(1.0);
                min_lr
                    + 0.5
                        * (self.base_lr - min_lr)
                        * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }

    pub fn iteration(&self) -> usize {
        self.iteration
    }
}

impl LrScheduler for Schedule {
    fn step(&mut self) -> LearningRate {
        let lr = self.lr_at(self.iteration);
        self.iteration += 1;
        lr
    }

    fn to_record(&self) -> LrSchedulerRecord {
        LrSchedulerRecord::new().with_scalar("iteration", self.iteration as u64)
    }

    fn load_record(&mut self, record: LrSchedulerRecord) {
        if let Some(i) = record.scalar::<u64>("iteration") {
            self.iteration = i as usize;
        }
    }
}

/// How the learning rate follows the batch size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum LrScaling {
    /// lr * B / B0 (Goyal et al. 2017).
    Linear,
    /// lr * sqrt(B / B0) (Krizhevsky 2014; seed 002).
    Sqrt,
}

crate::names::named_settings!(LrScaling { Linear => "linear", Sqrt => "sqrt" });

/// The learning rate for global batch `batch` given `lr` tuned at `base_batch`.
pub fn scale_lr(lr: f64, rule: LrScaling, batch: usize, base_batch: usize) -> Result<f64> {
    if batch == 0 || base_batch == 0 {
        return Err(HearthError::InvalidArgument(
            "batch sizes for LR scaling must be positive".into(),
        ));
    }
    let ratio = batch as f64 / base_batch as f64;
    Ok(match rule {
        LrScaling::Linear => lr * ratio,
        LrScaling::Sqrt => lr * ratio.sqrt(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_is_linear_then_cosine_reaches_the_floor() {
        let s = Schedule::new(0.4, 4, 14, Decay::Cosine { min_lr: 0.0 }).unwrap();
        let lrs: Vec<f64> = (0..14).map(|i| s.lr_at(i)).collect();
        assert!((lrs[0] - 0.1).abs() < 1e-12 && (lrs[3] - 0.4).abs() < 1e-12);
        assert!(
            (lrs[4] - 0.4).abs() < 1e-12,
            "cosine starts at the base rate"
        );
        assert!(
            (s.lr_at(9) - 0.2).abs() < 1e-12,
            "half way is half the rate"
        );
        assert!(s.lr_at(14) < 1e-12);
        assert!(lrs.windows(2).skip(4).all(|w| w[1] <= w[0]));
    }

    #[test]
    fn step_decay_and_resume_from_a_record() {
        let mut s = Schedule::new(
            1.0,
            0,
            100,
            Decay::Step {
                step_size: 3,
                gamma: 0.5,
            },
        )
        .unwrap();
        let first: Vec<f64> = (0..7).map(|_| s.step()).collect();
        assert_eq!(first, vec![1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25]);
        let record = s.to_record();
        let mut resumed = Schedule::new(
            1.0,
            0,
            100,
            Decay::Step {
                step_size: 3,
                gamma: 0.5,
            },
        )
        .unwrap();
        resumed.load_record(record);
        assert_eq!(resumed.step(), s.step());
    }

    #[test]
    fn scaling_rules() {
        assert_eq!(scale_lr(0.1, LrScaling::Linear, 1024, 256).unwrap(), 0.4);
        assert!((scale_lr(0.1, LrScaling::Sqrt, 1024, 256).unwrap() - 0.2).abs() < 1e-12);
        assert!(scale_lr(0.1, LrScaling::Linear, 0, 256).is_err());
        assert!(Schedule::new(-1.0, 0, 10, Decay::Constant).is_err());
    }
}
