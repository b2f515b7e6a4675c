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
//! | `Lars` | per tensor `T`: `local = η‖w_T‖ / (‖g_T‖ + λ‖w_T‖ + ε)` (1 when a norm is 0), `u ← lr·local·(g + λw)`; `v ← m·v + u` (`v = u` first); `p ← p − v`; 1-d tensors (`exclude_1d`): `u ← lr·g` |
//!
//! LARS's trust ratio needs each tensor's whole norms. A slice holding whole tensors computes
//! them itself ([`ShardOptimizer::step`]); a shard cut through a tensor gets them from the
//! caller ([`ShardOptimizer::step_at`] with `norms`): the sums of squares of
//! [`ShardOptimizer::partial_norms`] added over the shards (one small allreduce). The tensors'
//! extents are kept in whole-vector coordinates ([`ShardOptimizer::tensors`]) with the slice's
//! place in it ([`ShardOptimizer::origin`]), so every shard indexes the tensors alike.
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
    /// LARS (You, Gitman, Ginsburg 2017) as `hearth::optim::Lars` computes it: a trust ratio
    /// per tensor, weight decay on the tensors it applies to, momentum on the scaled update.
    Lars {
        momentum: f32,
        /// η, the trust coefficient.
        trust: f32,
        epsilon: f32,
        /// Plain SGD with momentum (no trust ratio, no decay) for 1-d tensors.
        exclude_1d: bool,
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

/// Where one tensor lies in the whole flat vector, and whether it is a layer's weight (rank 2
/// or more) rather than a bias or a batch-norm scale.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Extent {
    pub range: Range<usize>,
    pub matrix: bool,
}

/// An update rule, its weight decay and learning rate schedule, for a slice of `len` values.
#[derive(Clone)]
pub struct ShardOptimizer {
    pub update: Update,
    pub weight_decay: f32,
    /// The value ranges (indices into the slice) weight decay applies to (not LARS, whose
    /// decay follows [`Extent::matrix`]).
    pub decay: Vec<Range<usize>>,
    pub lr: LrFn,
    /// The whole vector's tensors, in whole-vector coordinates (LARS; the others ignore it).
    pub tensors: Vec<Extent>,
    /// Where the slice this optimizer updates starts in the whole vector (see
    /// [`Self::restrict`]).
    pub origin: usize,
    /// Per tensor of [`Self::tensors`]: the update count when it joined the optimizer (empty:
    /// all 0). Adam and AdamW count a tensor's steps from there for their bias correction, as
    /// burn's optimizers count each tensor's own (a fine-tuning phase's backbone after a
    /// frozen one); the other rules have no count.
    pub born: Vec<u64>,
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
            tensors: Vec::new(),
            origin: 0,
            born: Vec::new(),
        }
    }

    /// The state's length for a slice of `n` values (0: stateless).
    pub fn state_len(&self, n: usize) -> usize {
        match self.update {
            Update::Sgd { momentum, .. } if momentum > 0.0 => n,
            Update::Sgd { .. } => 0,
            Update::Lars { momentum, .. } if momentum > 0.0 => n,
            Update::Lars { .. } => 0,
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

    /// What the state's values are called, slot by slot (each slot `n` values): a checkpoint
    /// names them `<tensor>.<slot>`.
    pub fn state_slots(&self) -> &'static [&'static str] {
        match self.update {
            Update::Sgd { momentum, .. } | Update::Lars { momentum, .. } if momentum > 0.0 => {
                &["velocity"]
            }
            Update::Sgd { .. } | Update::Lars { .. } => &[],
            Update::Adam { .. } | Update::AdamW { .. } => &["moment_1", "moment_2"],
        }
    }

    /// Whether an update needs each tensor's whole norms (LARS).
    pub fn needs_norms(&self) -> bool {
        matches!(self.update, Update::Lars { .. })
    }

    /// The tensors of [`Self::tensors`] (all of them, in order) as they meet a slice of `n`
    /// values starting at [`Self::origin`]: their index and their part, in slice coordinates.
    fn parts(&self, n: usize) -> Vec<(usize, Range<usize>, bool)> {
        let (lo, hi) = (self.origin, self.origin + n);
        if self.tensors.is_empty() {
            // No extents given: the slice is one weight tensor.
            return vec![(0, 0..n, true)];
        }
        self.tensors
            .iter()
            .enumerate()
            .filter_map(|(i, e)| {
                let (a, b) = (e.range.start.max(lo), e.range.end.min(hi));
                (a < b).then(|| (i, a - lo..b - lo, e.matrix))
            })
            .collect()
    }

    /// Adam's step count (from 1) at update `step` over a slice of `n` values: one range with
    /// `step + 1`, or per tensor where [`Self::born`] says some joined later.
    fn counts(&self, step: u64, n: usize) -> Vec<(i32, Range<usize>)> {
        let count = |born: u64| (step + 1).saturating_sub(born).clamp(1, i32::MAX as u64) as i32;
        if self.born.iter().all(|&b| b == 0) {
            return vec![(count(0), 0..n)];
        }
        self.parts(n)
            .into_iter()
            .map(|(i, r, _)| (count(self.born.get(i).copied().unwrap_or(0)), r))
            .collect()
    }

    /// This slice's share of every tensor's squared norms: `[Σw², Σg²]` per tensor of
    /// [`Self::tensors`] (zeros for the tensors it does not meet). Added over all the shards
    /// of a vector they are the `norms` [`Self::step_at`] takes.
    pub fn partial_norms(&self, values: &[f32], grad: &[f32]) -> Vec<f32> {
        let mut out = vec![0f32; 2 * self.tensors.len().max(1)];
        for (i, r, _) in self.parts(values.len()) {
            let w: f64 = values[r.clone()]
                .iter()
                .map(|x| f64::from(*x).powi(2))
                .sum();
            let g: f64 = grad[r].iter().map(|x| f64::from(*x).powi(2)).sum();
            out[2 * i] = w as f32;
            out[2 * i + 1] = g as f32;
        }
        out
    }

    /// One update of `values` by `grad`, `step` updates having come before it; `state` as
    /// [`Self::check_state`] accepts (an empty one is started). LARS takes the norms from
    /// the slice itself, which is right when the slice holds whole tensors.
    pub fn step(&self, step: u64, values: &mut [f32], grad: &[f32], state: &mut Vec<f32>) {
        self.step_at(step, self.lr_at(step), values, grad, state, None);
    }

    /// [`Self::step`] at the learning rate `lr` (the caller's schedule) and, for LARS, with
    /// every tensor's whole squared norms (`[Σw², Σg²]` per tensor, as [`Self::partial_norms`]
    /// summed over the shards; `None` takes them from this slice).
    pub fn step_at(
        &self,
        step: u64,
        lr: f32,
        values: &mut [f32],
        grad: &[f32],
        state: &mut Vec<f32>,
        norms: Option<&[f32]>,
    ) {
        let n = values.len();
        let first = state.is_empty();
        if first {
            *state = vec![0.0; self.state_len(n)];
        }
        let norms_own;
        let norms = match (self.needs_norms(), norms) {
            (true, None) => {
                norms_own = self.partial_norms(values, grad);
                Some(norms_own.as_slice())
            }
            (_, given) => given,
        };
        let mut slice = Slice {
            step,
            lr,
            g: self.decayed_gradient(values, &grad[..n]),
            values,
            state,
            first,
        };
        match self.update {
            Update::Sgd { momentum, nesterov } => slice.sgd(momentum, nesterov),
            Update::Adam {
                beta_1,
                beta_2,
                epsilon,
            } => self.adam(&mut slice, beta_1, beta_2, epsilon),
            Update::AdamW {
                beta_1,
                beta_2,
                epsilon,
            } => self.adamw(&mut slice, beta_1, beta_2, epsilon),
            Update::Lars {
                momentum,
                trust,
                epsilon,
                exclude_1d,
            } => {
                self.lars_scale(&mut slice, norms.unwrap_or(&[]), trust, epsilon, exclude_1d);
                slice.descend_with_momentum(momentum);
            }
        }
    }

    /// The gradient after L2 weight decay (Sgd, Adam; AdamW and LARS decay their own way).
    fn decayed_gradient(&self, values: &[f32], grad: &[f32]) -> Vec<f32> {
        let n = values.len();
        let mut g = grad.to_vec();
        let l2 = matches!(self.update, Update::Sgd { .. } | Update::Adam { .. })
            && self.weight_decay > 0.0;
        if l2 {
            for r in &self.decay {
                for i in r.start.min(n)..r.end.min(n) {
                    g[i] += values[i] * self.weight_decay;
                }
            }
        }
        g
    }

    fn adam(&self, s: &mut Slice, beta_1: f32, beta_2: f32, epsilon: f32) {
        let n = s.values.len();
        let (m, v) = s.state.split_at_mut(n);
        moments(m, v, &s.g, beta_1, beta_2);
        for (t, r) in self.counts(s.step, n) {
            let c2 = (1.0 - beta_2.powi(t)).sqrt();
            let combined = c2 / (1.0 - beta_1.powi(t));
            for i in r {
                let d = (m[i] * combined) / (v[i].sqrt() + epsilon * c2);
                s.values[i] -= d * s.lr;
            }
        }
    }

    fn adamw(&self, s: &mut Slice, beta_1: f32, beta_2: f32, epsilon: f32) {
        let n = s.values.len();
        let (m, v) = s.state.split_at_mut(n);
        moments(m, v, &s.g, beta_1, beta_2);
        if self.weight_decay > 0.0 {
            // Decoupled: the values shrink before the step, never the gradient.
            let keep = 1.0 - (f64::from(s.lr) * f64::from(self.weight_decay)) as f32;
            for r in &self.decay {
                s.values[r.start.min(n)..r.end.min(n)]
                    .iter_mut()
                    .for_each(|p| *p *= keep);
            }
        }
        for (t, r) in self.counts(s.step, n) {
            let (b1, b2) = (1.0 - beta_1.powi(t), 1.0 - beta_2.powi(t));
            for i in r {
                let d = (m[i] / b1) / ((v[i] / b2).sqrt() + epsilon);
                s.values[i] -= d * s.lr;
            }
        }
    }

    /// LARS's update before momentum, into the slice's gradient (hearth::optim::Lars, in its
    /// order): each weight tensor's gradient, with weight decay, scaled by its trust ratio
    /// from `norms` (`[Σw², Σg²]` per tensor).
    fn lars_scale(&self, s: &mut Slice, norms: &[f32], trust: f32, epsilon: f32, exclude_1d: bool) {
        let (lr, wd) = (s.lr, self.weight_decay);
        for (i, r, matrix) in self.parts(s.values.len()) {
            if exclude_1d && !matrix {
                s.g[r].iter_mut().for_each(|x| *x *= lr);
                continue;
            }
            let w_norm = f64::from(norms.get(2 * i).copied().unwrap_or(0.0)).sqrt();
            let g_norm = f64::from(norms.get(2 * i + 1).copied().unwrap_or(0.0)).sqrt();
            let local = if w_norm > 0.0 && g_norm > 0.0 {
                f64::from(trust) * w_norm / (g_norm + f64::from(wd) * w_norm + f64::from(epsilon))
            } else {
                1.0
            };
            let factor = (f64::from(lr) * local) as f32;
            for j in r {
                let gj = if wd > 0.0 {
                    s.g[j] + s.values[j] * wd
                } else {
                    s.g[j]
                };
                s.g[j] = gj * factor;
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
            origin: self.origin + range.start,
            ..self.clone()
        }
    }
}

/// Adam's moment updates, as burn-optim writes them (`m·β₁ + g(1−β₁)`, `s·β₂ + g²(1−β₂)`; zero
/// moments give its first step's values exactly).
/// One update's working set: the values being updated, their gradient (after L2 decay), the
/// optimizer's state for them and where in the run the update is.
struct Slice<'a> {
    step: u64,
    lr: f32,
    g: Vec<f32>,
    values: &'a mut [f32],
    state: &'a mut [f32],
    first: bool,
}

impl Slice<'_> {
    /// SGD, with PyTorch's momentum (no dampening; the first step's buffer is the gradient).
    fn sgd(&mut self, momentum: f32, nesterov: bool) {
        let (first, lr) = (self.first, self.lr);
        if momentum > 0.0 {
            let buffers = self.state.iter_mut();
            for ((gi, v), p) in self.g.iter().zip(buffers).zip(self.values.iter_mut()) {
                *v = if first { *gi } else { *gi + *v * momentum };
                let d = if nesterov { *v * momentum + *gi } else { *v };
                *p -= d * lr;
            }
        } else {
            for (gi, p) in self.g.iter().zip(self.values.iter_mut()) {
                *p -= gi * lr;
            }
        }
    }

    /// Steps by the gradient, already scaled by the learning rate, through momentum (LARS).
    fn descend_with_momentum(&mut self, momentum: f32) {
        let first = self.first;
        if momentum > 0.0 {
            let buffers = self.state.iter_mut();
            for ((u, v), p) in self.g.iter().zip(buffers).zip(self.values.iter_mut()) {
                *v = if first { *u } else { *v * momentum + *u };
                *p -= *v;
            }
        } else {
            for (u, p) in self.g.iter().zip(self.values.iter_mut()) {
                *p -= *u;
            }
        }
    }
}

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
            tensors: Vec::new(),
            origin: 0,
            born: Vec::new(),
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

    /// A tensor that joined at update 3 (a fine-tuning switch) is stepped as a fresh Adam on
    /// it alone, the other as the Adam that has run since 0, in one slice and in shards.
    #[test]
    fn adam_counts_each_tensor_s_steps_from_when_it_joined() {
        for update in [Update::adam(), Update::adamw()] {
            let mut one = ShardOptimizer::sgd(0.01, 0.0);
            one.update = update;
            let grad = |t: u64, i: usize| ((t as usize * 3 + i) % 5) as f32 * 0.2 - 0.3;
            // Tensor 0 (2 values) alone for updates 0..3.
            let (mut a, mut sa) = (vec![1.0f32, -1.0], Vec::new());
            for t in 0..3 {
                one.step(t, &mut a, &[grad(t, 0), grad(t, 1)], &mut sa);
            }
            // Then both, tensor 1 joining at 3 with a zero state.
            let mut both = one.clone();
            both.tensors = vec![
                Extent {
                    range: 0..2,
                    matrix: true,
                },
                Extent {
                    range: 2..3,
                    matrix: false,
                },
            ];
            both.born = vec![0, 3];
            let mut p = vec![a[0], a[1], 0.5];
            let mut s = vec![sa[0], sa[1], 0.0, sa[2], sa[3], 0.0];
            let (mut b, mut sb) = (vec![0.5f32], Vec::new());
            // The second shard alone (values 2..3), as a ZeRO rank holds it.
            let shard = both.restrict(2..3);
            let (mut c, mut sc) = (vec![0.5f32], vec![0.0f32, 0.0]);
            for t in 3..6 {
                let g = [grad(t, 0), grad(t, 1), grad(t, 2)];
                both.step(t, &mut p, &g, &mut s);
                one.step(t, &mut a, &g[..2], &mut sa);
                one.step(t - 3, &mut b, &g[2..], &mut sb);
                shard.step(t, &mut c, &g[2..], &mut sc);
            }
            assert_eq!(&p[..2], &a[..], "{update:?}: the tensor trained since 0");
            assert_eq!(p[2], b[0], "{update:?}: the tensor that joined at 3");
            assert_eq!(c[0], b[0], "{update:?}: in a shard");
            // Without the joining count, its first steps' bias correction differs.
            both.born.clear();
            let mut q = vec![a[0], a[1], 0.5];
            let mut sq = vec![sa[0], sa[1], 0.0, sa[2], sa[3], 0.0];
            both.step(3, &mut q, &[0.1, 0.1, 0.1], &mut sq);
            let (mut r, mut sr) = (vec![0.5f32], Vec::new());
            one.step(0, &mut r, &[0.1], &mut sr);
            assert!(
                (q[2] - r[0]).abs() > 1e-4,
                "{update:?}: {} vs {}",
                q[2],
                r[0]
            );
        }
    }
}
