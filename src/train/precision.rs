//! `--precision`: mixed-precision training with f32 master weights.
//!
//! With `bf16` or `fp16` a step runs the model's convolutions, linear layers and activations
//! in that type while the parameters, their gradients and the optimizer state stay f32, batch
//! norm normalises in f32 and the loss is computed in f32 ([`hearth_models::Classifier::forward_in`],
//! `hearth_kernels::precision`). Checkpoints and `model.bpk` therefore hold f32 weights, and a
//! run resumes exactly.
//!
//! `fp16` has a narrow range: small gradients underflow. The loss is multiplied by a
//! [`LossScaler`]'s scale before the backward pass and the gradients divided by it after
//! (dynamic loss scaling, PyTorch's `GradScaler` rule): a step whose gradients are not finite
//! is skipped and the scale halves; after [`LossScaler::GROWTH_INTERVAL`] clean steps in a row
//! the scale doubles. In a data-parallel run the verdict is taken on the averaged gradients, so
//! every rank skips the same steps. Skipped steps are counted in `metrics.csv`
//! (`skipped_steps`). `bf16` has f32's range and needs no scaling.
//!
//! Every mode scales the same way with the pieces here ([`LossScaler::loss_factor`] before the
//! backward pass, [`divide`] or [`unscale_flat`] before the exchange, [`LossScaler::decide`]
//! after it):
//! - one process and data parallel (`allreduce.rs`): the verdict on the averaged gradients,
//!   the same on every rank ([`Mixed`] does the same for the benches' timed steps);
//! - elastic: the scaler is part of the commit, so a re-formed world, a joiner and a resume go
//!   on with the scale every member agreed on;
//! - pipeline: the last stage scales the loss, each stage unscales its own gradients, and one
//!   flag summed over every rank makes one verdict for the job;
//! - parameter servers: workers never exchange gradients with each other, so each worker
//!   scales and decides for its own (a skipped step pushes nothing of its own:
//!   `PsWorker::skip`).

use std::sync::{Arc, Mutex};

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::prelude::*;

use crate::settings::Precision;

/// Dynamic loss scaling for fp16: the loss times [`LossScaler::scale`] before the backward pass,
/// the gradients divided by it after; a step whose gradients are not finite is skipped and the
/// scale halves, and after [`LossScaler::GROWTH_INTERVAL`] clean steps it doubles.
#[derive(Debug, Clone)]
pub struct LossScaler {
    scale: f32,
    growth_interval: u32,
    /// Finite steps since the scale last changed.
    clean: u32,
    skipped: u64,
    /// Verdicts taken (optimizer steps decided, skipped or not).
    decided: u64,
}

impl LossScaler {
    /// PyTorch's `GradScaler` defaults: 2^16, doubled after 2000 clean steps.
    pub const INITIAL_SCALE: f32 = 65536.0;
    pub const GROWTH_INTERVAL: u32 = 2000;
    /// The scale never falls below this (a run whose gradients overflow at scale 1 has a
    /// problem scaling cannot fix; its steps keep being skipped and counted).
    pub const MIN_SCALE: f32 = 1.0;
    /// Nor rises past this (f32's own range).
    pub const MAX_SCALE: f32 = 1.0e30;

    pub fn new(initial: f32, growth_interval: u32) -> Self {
        Self {
            scale: initial.clamp(Self::MIN_SCALE, Self::MAX_SCALE),
            growth_interval: growth_interval.max(1),
            clean: 0,
            skipped: 0,
            decided: 0,
        }
    }

    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Steps skipped so far.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// Optimizer steps decided so far (taken or skipped).
    pub fn decided(&self) -> u64 {
        self.decided
    }

    /// Records whether a step's gradients were finite; returns whether to take the step.
    pub fn update(&mut self, finite: bool) -> bool {
        self.decided += 1;
        if finite {
            self.clean += 1;
            if self.clean >= self.growth_interval {
                self.scale = (self.scale * 2.0).min(Self::MAX_SCALE);
                self.clean = 0;
            }
            true
        } else {
            self.scale = (self.scale * 0.5).max(Self::MIN_SCALE);
            self.clean = 0;
            self.skipped += 1;
            false
        }
    }
}

impl LossScaler {
    /// [`LossScaler::update`], saying on stderr which step was skipped and the new scale (a
    /// line every mode prints alike).
    pub fn decide(&mut self, finite: bool) -> bool {
        let take = self.update(finite);
        if !take {
            eprintln!(
                "fp16: optimizer step {}: gradients not finite, skipped; loss scale now {}",
                self.decided, self.scale
            );
        }
        take
    }

    /// What the loss of the next step is multiplied by: the scale, or infinity where the test
    /// hook `overflow_at` (`HEARTH_FP16_OVERFLOW_AT_STEP`, read in `train/faults.rs`) names that
    /// step.
    pub fn loss_factor(&self, overflow_at: Option<u64>) -> f32 {
        if overflow_at == Some(self.decided + 1) {
            f32::INFINITY
        } else {
            self.scale
        }
    }

    /// The state `checkpoint/loss-scale-EPOCH.json` holds, so a resumed fp16 run goes on with
    /// the scale it had.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "scale": self.scale,
            "growth_interval": self.growth_interval,
            "clean": self.clean,
            "skipped": self.skipped,
            "decided": self.decided,
        })
    }

    /// The state [`LossScaler::to_json`] wrote; `None` when a field is missing or malformed.
    pub fn from_json(v: &serde_json::Value) -> Option<Self> {
        let n = |k: &str| v.get(k)?.as_u64();
        let scale = v.get("scale")?.as_f64()? as f32;
        if !(scale.is_finite() && scale >= Self::MIN_SCALE) {
            return None;
        }
        Some(Self {
            scale: scale.min(Self::MAX_SCALE),
            growth_interval: u32::try_from(n("growth_interval")?).ok()?.max(1),
            clean: u32::try_from(n("clean")?).ok()?,
            skipped: n("skipped")?,
            decided: n("decided")?,
        })
    }

    /// The file of `epoch`'s state in `run_dir`.
    pub fn file(run_dir: &std::path::Path, epoch: usize) -> std::path::PathBuf {
        run_dir
            .join("checkpoint")
            .join(format!("loss-scale-{epoch}.json"))
    }
}

impl LossScaler {
    /// Writes the state into `file` (beside a checkpoint).
    pub fn save(&self, file: &std::path::Path) -> std::io::Result<()> {
        std::fs::write(file, self.to_json().to_string())
    }

    /// The state `file` holds, saved after `epoch` (a resume); an error names a missing or
    /// unreadable file.
    pub fn load(file: &std::path::Path, epoch: usize) -> crate::Result<Self> {
        let bad = |why: String| {
            crate::HearthError::Training(format!(
                "{}: {why}: the fp16 loss scale of epoch {epoch} cannot be restored",
                file.display()
            ))
        };
        let text = std::fs::read_to_string(file).map_err(|e| bad(e.to_string()))?;
        let value: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        LossScaler::from_json(&value).ok_or_else(|| bad("malformed".into()))
    }
}

impl SharedScaler {
    /// Writes the state after `epoch` beside that epoch's checkpoint.
    pub fn save(&self, run_dir: &std::path::Path, epoch: usize) -> std::io::Result<()> {
        self.with(|s| s.save(&LossScaler::file(run_dir, epoch)))
    }

    /// Restores the state saved after `epoch` (a resume); an error names a missing or
    /// unreadable file.
    pub fn restore(&self, run_dir: &std::path::Path, epoch: usize) -> crate::Result<()> {
        let state = LossScaler::load(&LossScaler::file(run_dir, epoch), epoch)?;
        self.with(|s| *s = state);
        Ok(())
    }
}

impl Default for LossScaler {
    fn default() -> Self {
        Self::new(Self::INITIAL_SCALE, Self::GROWTH_INTERVAL)
    }
}

/// A scaler shared by the step that scales the loss and whoever takes the verdict (the step
/// itself in one process, the data-parallel strategy after the exchange).
#[derive(Debug, Clone, Default)]
pub struct SharedScaler(pub Arc<Mutex<LossScaler>>);

impl SharedScaler {
    pub fn new(scaler: LossScaler) -> Self {
        Self(Arc::new(Mutex::new(scaler)))
    }

    fn with<R>(&self, f: impl FnOnce(&mut LossScaler) -> R) -> R {
        f(&mut self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }

    pub fn scale(&self) -> f32 {
        self.with(|s| s.scale())
    }

    pub fn skipped(&self) -> u64 {
        self.with(|s| s.skipped())
    }

    pub fn update(&self, finite: bool) -> bool {
        self.with(|s| s.decide(finite))
    }
}

impl burn_dist::ddp::StepGuard for SharedScaler {
    fn take_step(&self, finite: bool) -> bool {
        self.update(finite)
    }
}

/// How a trainee computes: its precision, and for fp16 the loss scaler and whether the step
/// itself decides to skip (one process) or leaves that to the data-parallel strategy, which
/// sees the averaged gradients; and whether it recomputes activations (`--recompute`).
#[derive(Debug, Clone, Default)]
pub struct Mixed {
    pub precision: Precision,
    /// `--recompute`: gradients unit by unit ([`crate::pipeline::recomputed_gradients`]).
    pub recompute: bool,
    pub scaler: Option<SharedScaler>,
    pub skip_in_step: bool,
    /// Test hook `HEARTH_FP16_OVERFLOW_AT_STEP=RANK:N`: this rank's gradients of the run's
    /// N-th step (from 1, counted by the scaler, so a resumed run goes on counting) are made
    /// infinite, as a real overflow makes them.
    overflow_at: Option<u64>,
}

impl Mixed {
    /// The settings of a run of `precision`, `distributed` or in one process, for `rank`.
    pub fn new(precision: Precision, distributed: bool, rank: usize) -> Self {
        let fp16 = precision == Precision::Fp16;
        Self {
            precision,
            recompute: false,
            scaler: fp16.then(SharedScaler::default),
            skip_in_step: !distributed,
            overflow_at: super::faults::Faults::rank(rank, precision).overflow_at(),
        }
    }

    /// The gradients of `loss` for `module`, scaled for fp16 (the loss times the scale, the
    /// gradients divided by it) and, when this step decides, emptied (the optimizer then
    /// changes nothing) if they are not finite.
    pub fn gradients<M: Module>(&self, module: &M, loss: Tensor<1>) -> GradientsParams {
        self.gradients_with(module, |factor| {
            let loss = if factor == 1.0 {
                loss
            } else {
                loss.mul_scalar(factor)
            };
            GradientsParams::from_grads(loss.backward(), module)
        })
    }

    /// [`Mixed::gradients`] where `backward(factor)` gives the gradients of the loss times
    /// `factor` (1 unless fp16 scales it).
    pub fn gradients_with<M: Module>(
        &self,
        module: &M,
        backward: impl FnOnce(f32) -> GradientsParams,
    ) -> GradientsParams {
        let Some(scaler) = &self.scaler else {
            return backward(1.0);
        };
        let (scale, factor) = scaler.with(|s| (s.scale(), s.loss_factor(self.overflow_at)));
        // What a unit-by-unit backward hands to an overlapped exchange leaves unscaled.
        burn_dist::overlap::unscale_by(scale);
        let mut grads = backward(factor);
        divide(module, &mut grads, scale);
        // In data parallel the strategy checks the averaged gradients instead (once, after
        // the exchange); a rank's infinities reach them.
        if self.skip_in_step && !scaler.update(burn_dist::ddp::grads_finite(module, &grads)) {
            return GradientsParams::new();
        }
        grads
    }
}

/// A flat gradient vector (the parameter-server modes') divided by `scale` in place; whether
/// every value is finite.
pub(super) fn unscale_flat(grad: &mut [f32], scale: f32) -> bool {
    let inv = 1.0 / scale;
    let mut finite = true;
    for g in grad.iter_mut() {
        *g *= inv;
        finite &= g.is_finite();
    }
    finite
}

/// Divides every gradient of `module` by `scale` in place (the loss was multiplied by it).
pub(super) fn divide<M: Module>(module: &M, grads: &mut GradientsParams, scale: f32) {
    struct Unscale<'a> {
        grads: &'a mut GradientsParams,
        inv: f32,
    }
    impl ModuleVisitor for Unscale<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.remove::<D>(param.id) {
                self.grads.register(param.id, g.mul_scalar(self.inv));
            }
        }
    }
    module.visit(&mut Unscale {
        grads,
        inv: 1.0 / scale,
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a step does with fp16 gradients: divide, then check (the check the data-parallel
    /// strategy makes on the averaged gradients).
    fn unscale<M: Module>(module: &M, grads: &mut GradientsParams, scale: f32) -> bool {
        divide(module, grads, scale);
        burn_dist::ddp::grads_finite(module, grads)
    }

    #[test]
    fn an_overflow_skips_and_halves_clean_steps_double_after_the_interval() {
        let mut s = LossScaler::new(1024.0, 3);
        assert!(s.update(true));
        assert!(s.update(true));
        assert_eq!(s.scale(), 1024.0);
        assert!(s.update(true), "the third clean step is taken");
        assert_eq!(s.scale(), 2048.0, "and doubles the scale");
        assert!(!s.update(false), "an overflow is skipped");
        assert_eq!(s.scale(), 1024.0);
        assert_eq!(s.skipped(), 1);
        // The clean count starts again after an overflow.
        assert!(s.update(true) && s.update(true));
        assert_eq!(s.scale(), 1024.0);
        assert!(s.update(true));
        assert_eq!(s.scale(), 2048.0);
        let mut low = LossScaler::new(1.0, 10);
        assert!(!low.update(false));
        assert_eq!(low.scale(), LossScaler::MIN_SCALE, "never below 1");
    }

    #[test]
    fn the_state_round_trips_and_a_malformed_one_is_refused() {
        let mut s = LossScaler::new(4096.0, 7);
        s.update(true);
        s.update(false);
        let back = LossScaler::from_json(&s.to_json()).unwrap();
        assert_eq!(back.to_json(), s.to_json());
        for bad in [
            serde_json::json!({"scale": "big"}),
            serde_json::json!({"scale": f64::NAN, "growth_interval": 1, "clean": 0, "skipped": 0, "decided": 0}),
            serde_json::json!({"scale": 0.5, "growth_interval": 1, "clean": 0, "skipped": 0, "decided": 0}),
            serde_json::json!({"scale": 8.0, "growth_interval": 1, "clean": 0, "skipped": 0}),
        ] {
            assert!(LossScaler::from_json(&bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn unscaling_divides_and_sees_a_non_finite_gradient() {
        let device = Device::flex().autodiff();
        let lin = burn::nn::LinearConfig::new(3, 2).init(&device);
        let x = Tensor::<2>::ones([4, 3], &device);
        let loss = lin.forward(x.clone()).sum().mul_scalar(8.0);
        let mut grads = GradientsParams::from_grads(loss.backward(), &lin);
        let before: Vec<f32> = grads
            .get::<2>(lin.weight.id)
            .unwrap()
            .into_data()
            .iter()
            .collect();
        assert!(unscale(&lin, &mut grads, 8.0));
        let after: Vec<f32> = grads
            .get::<2>(lin.weight.id)
            .unwrap()
            .into_data()
            .iter()
            .collect();
        for (b, a) in before.iter().zip(&after) {
            assert_eq!(b / 8.0, *a);
        }
        let loss = lin.forward(x).sum().mul_scalar(f32::INFINITY);
        let mut grads = GradientsParams::from_grads(loss.backward(), &lin);
        assert!(!unscale(&lin, &mut grads, 1.0));
    }
}
