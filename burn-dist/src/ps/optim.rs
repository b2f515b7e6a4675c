//! The optimizer a parameter server runs on its shard (sync mode) and a worker runs for its
//! local steps (asynchronous modes), as plain loops over flat `f32` slices.
//!
//! The arithmetic is burn-optim 0.22's, operation for operation, so that a sync server equals
//! allreduce data parallel on Burn's own optimizers:
//!
//! | update | per value, gradient `g` (weight decay `λ` added first where it applies) |
//! | --- | --- |
//! | `Sgd` | `v ← m·v + g` (`v = g` on the first step; no dampening), Nesterov: `g ← m·v + g`, else `g ← v`; `p ← p − lr·g` |
//! | `Adam` | `m ← β₁m + (1−β₁)g`, `s ← β₂s + (1−β₂)g²`; with `t` steps taken, `c = √(1−β₂ᵗ)`: `p ← p − lr · m·c/(1−β₁ᵗ) / (√s + ε·c)` |
//! | `AdamW` | moments as Adam; `p ← p(1 − lr·λ) − lr · (m/(1−β₁ᵗ)) / (√(s/(1−β₂ᵗ)) + ε)` (decay decoupled, never on the gradient) |
//!
//! Weight decay applies to the values in [`ShardOptimizer::decay`] only (Hearth decays the
//! weights of layers, not biases or batch-norm scales). The state is one flat vector: the
//! velocity (`Sgd` with momentum, `n` values) or both moments (`Adam`, `AdamW`, `2n` values);
//! the step count comes from the caller (a server's version), so a checkpoint needs nothing
//! else. The learning rate is a function of that step count (warmup and decay schedules).

use std::ops::Range;
use std::sync::Arc;

use crate::{DistError, Result};

/// The learning rate at an update, by the number of updates before it (0 for the first).
pub type LrFn = Arc<dyn Fn(u64) -> f32 + Send + Sync>;

/// Which update rule, with its constants.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Update {
    /// SGD, with momentum when `momentum > 0` (PyTorch's: no dampening).
    Sgd { momentum: f32, nesterov: bool },
    /// Adam with L2 weight decay on the gradient.
    Adam {
        beta_1: f32,
        beta_2: f32,
        epsilon: f32,
    },
    /// Adam with decoupled weight decay.
    AdamW {
        beta_1: f32,
        beta_2: f32,
        epsilon: f32,
    },
}

impl Update {
    /// Burn's `AdamConfig` defaults.
    pub fn adam() -> Self {
        Update::Adam {
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-5,
        }
    }

    /// Burn's `AdamWConfig` defaults.
    pub fn adamw() -> Self {
        Update::AdamW {
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-5,
        }
    }
}

/// An update rule, its weight decay and learning rate schedule, for a slice of `len` values.
#[derive(Clone)]
pub struct ShardOptimizer {
    pub update: Update,
    pub weight_decay: f32,
    /// The value ranges (indices into the slice) weight decay applies to.
    pub decay: Vec<Range<usize>>,
    pub lr: LrFn,
}

impl std::fmt::Debug for ShardOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardOptimizer")
            .field("update", &self.update)
            .field("weight_decay", &self.weight_decay)
            .field("decay", &self.decay)
            .field("lr(0)", &(self.lr)(0))
            .finish()
    }
}

impl ShardOptimizer {
    /// SGD with `momentum` at a constant `lr`, no weight decay.
    pub fn sgd(lr: f32, momentum: f32) -> Self {
        Self {
            update: Update::Sgd {
                momentum,
                nesterov: false,
            },
            weight_decay: 0.0,
            decay: Vec::new(),
            lr: Arc::new(move |_| lr),
        }
    }

    /// The state's length for a slice of `n` values (0: stateless).
    pub fn state_len(&self, n: usize) -> usize {
        match self.update {
            Update::Sgd { momentum, .. } if momentum > 0.0 => n,
            Update::Sgd { .. } => 0,
            Update::Adam { .. } | Update::AdamW { .. } => 2 * n,
        }
    }

    /// `state` fits a slice of `n` values: empty (nothing stepped yet) or [`Self::state_len`].
    pub fn check_state(&self, n: usize, state: &[f32]) -> Result<()> {
        if state.is_empty() || state.len() == self.state_len(n) {
            return Ok(());
        }
        Err(DistError::Config(format!(
            "optimizer state of {} values for {n} parameters; {:?} keeps {}",
            state.len(),
            self.update,
            self.state_len(n)
        )))
    }

    /// The learning rate of the update after `step` updates.
    pub fn lr_at(&self, step: u64) -> f32 {
        (self.lr)(step)
    }

    /// One update of `values` by `grad`, `step` updates having come before it; `state` as
    /// [`Self::check_state`] accepts (an empty one is started).
    pub fn step(&self, step: u64, values: &mut [f32], grad: &[f32], state: &mut Vec<f32>) {
        let n = values.len();
        let lr = self.lr_at(step);
        let first = state.is_empty();
        if first {
            *state = vec![0.0; self.state_len(n)];
        }
        // The gradient after L2 weight decay (Sgd, Adam).
        let mut g: Vec<f32> = grad[..n].to_vec();
        let l2 = !matches!(self.update, Update::AdamW { .. }) && self.weight_decay > 0.0;
        if l2 {
            for r in &self.decay {
                let r = r.start.min(n)..r.end.min(n);
                for i in r {
                    g[i] += values[i] * self.weight_decay;
                }
            }
        }
        match self.update {
            Update::Sgd { momentum, nesterov } => {
                if momentum > 0.0 {
                    for ((gi, v), p) in g.iter_mut().zip(state.iter_mut()).zip(values.iter_mut()) {
                        *v = if first { *gi } else { *gi + *v * momentum };
                        let d = if nesterov { *v * momentum + *gi } else { *v };
                        *p -= d * lr;
                    }
                } else {
                    for (gi, p) in g.iter().zip(values.iter_mut()) {
                        *p -= gi * lr;
                    }
                }
            }
            Update::Adam {
                beta_1,
                beta_2,
                epsilon,
            } => {
                let t = (step + 1).min(i32::MAX as u64) as i32;
                let (m, s) = state.split_at_mut(n);
                moments(m, s, &g, beta_1, beta_2);
                let c2 = (1.0 - beta_2.powi(t)).sqrt();
                let combined = c2 / (1.0 - beta_1.powi(t));
                for i in 0..n {
                    let d = (m[i] * combined) / (s[i].sqrt() + epsilon * c2);
                    values[i] -= d * lr;
                }
            }
            Update::AdamW {
                beta_1,
                beta_2,
                epsilon,
            } => {
                let t = (step + 1).min(i32::MAX as u64) as i32;
                let (m, s) = state.split_at_mut(n);
                moments(m, s, &g, beta_1, beta_2);
                let (b1, b2) = (1.0 - beta_1.powi(t), 1.0 - beta_2.powi(t));
                if self.weight_decay > 0.0 {
                    // Decoupled: the values shrink before the step, never the gradient.
                    let keep = 1.0 - (f64::from(lr) * f64::from(self.weight_decay)) as f32;
                    for r in &self.decay {
                        values[r.start.min(n)..r.end.min(n)]
                            .iter_mut()
                            .for_each(|p| *p *= keep);
                    }
                }
                for i in 0..n {
                    let d = (m[i] / b1) / ((s[i] / b2).sqrt() + epsilon);
                    values[i] -= d * lr;
                }
            }
        }
    }

    /// The same optimizer on the values `range` of this one's slice (a shard of a whole
    /// vector): decay ranges clipped and shifted to start at 0.
    pub fn restrict(&self, range: Range<usize>) -> Self {
        let decay = self
            .decay
            .iter()
            .filter_map(|r| {
                let (a, b) = (r.start.max(range.start), r.end.min(range.end));
                (a < b).then(|| a - range.start..b - range.start)
            })
            .collect();
        Self {
            decay,
            ..self.clone()
        }
    }
}

/// Adam's moment updates, as burn-optim writes them (`m·β₁ + g(1−β₁)`, `s·β₂ + g²(1−β₂)`; zero
/// moments give its first step's values exactly).
fn moments(m: &mut [f32], s: &mut [f32], g: &[f32], beta_1: f32, beta_2: f32) {
    for ((mi, si), gi) in m.iter_mut().zip(s.iter_mut()).zip(g) {
        *mi = *mi * beta_1 + gi * (1.0 - beta_1);
        *si = *si * beta_2 + gi * gi * (1.0 - beta_2);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sgd_with_momentum_nesterov_and_masked_decay() {
        let mut o = ShardOptimizer::sgd(0.1, 0.9);
        o.weight_decay = 0.5;
        o.decay = std::iter::once(0..1).collect();
        let mut p = vec![1.0, 1.0];
        let mut s = Vec::new();
        o.step(0, &mut p, &[1.0, 1.0], &mut s);
        // value 0: g = 1 + 0.5 = 1.5, v = 1.5, p = 1 - 0.15; value 1: no decay.
        assert_eq!(s, vec![1.5, 1.0]);
        assert!(
            (p[0] - 0.85).abs() < 1e-7 && (p[1] - 0.9).abs() < 1e-7,
            "{p:?}"
        );
        o.step(1, &mut p, &[0.0, 0.0], &mut s);
        assert!((s[1] - 0.9).abs() < 1e-7);
        assert!((p[1] - 0.81).abs() < 1e-6, "{p:?}");

        let mut n = ShardOptimizer::sgd(0.1, 0.5);
        n.update = Update::Sgd {
            momentum: 0.5,
            nesterov: true,
        };
        let (mut p, mut s) = (vec![0.0], Vec::new());
        n.step(0, &mut p, &[1.0], &mut s);
        // v = 1, d = 0.5 * 1 + 1.
        assert!((p[0] + 0.15).abs() < 1e-7, "{p:?}");
        assert!(o.check_state(2, &[0.0; 3]).is_err());
        assert!(o.check_state(2, &[]).is_ok());
    }

    #[test]
    fn adam_first_step_moves_every_value_by_about_lr() {
        let o = ShardOptimizer {
            update: Update::adam(),
            weight_decay: 0.0,
            decay: Vec::new(),
            lr: Arc::new(|_| 0.01),
        };
        let mut p = vec![1.0, -2.0, 3.0];
        let mut s = Vec::new();
        o.step(0, &mut p, &[4.0, -0.5, 1e-3], &mut s);
        assert_eq!(s.len(), 6);
        for (after, before) in p.iter().zip([1.0f32, -2.0, 3.0]) {
            assert!(((after - before).abs() - 0.01).abs() < 2e-4, "{p:?}");
        }
        let mut w = o.clone();
        w.update = Update::adamw();
        w.weight_decay = 0.1;
        w.decay = std::iter::once(0..3).collect();
        let (mut q, mut s) = (vec![1.0], Vec::new());
        w.step(0, &mut q, &[0.0], &mut s);
        assert!((q[0] - (1.0 - 0.01 * 0.1)).abs() < 1e-7, "{q:?}");
    }

    #[test]
    fn restrict_shifts_the_decay_ranges_into_the_shard() {
        let mut o = ShardOptimizer::sgd(0.1, 0.0);
        o.decay = vec![0..4, 6..10];
        assert_eq!(o.restrict(3..8).decay, vec![0..1, 3..5]);
        assert!(o.restrict(4..6).decay.is_empty());
    }
}
