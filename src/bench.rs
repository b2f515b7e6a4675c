//! `hearth bench model`: warm-up steps, then timed steps of inference or training, in images/s.

use std::time::Instant;

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{SgdConfig, momentum::MomentumConfig};
use burn::prelude::*;
use burn::tensor::Distribution;
use hearth_models::Architecture;

use crate::{HearthError, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchMode {
    /// Forward pass only, model in evaluation mode.
    #[value(alias = "inference")]
    Infer,
    /// Forward, cross-entropy, backward and an SGD-with-momentum update.
    #[value(alias = "training")]
    Train,
}

#[derive(Debug, Clone)]
pub struct ModelBench {
    pub arch: Architecture,
    pub mode: BenchMode,
    pub batch_size: usize,
    pub size: usize,
    pub warmup: usize,
    pub steps: usize,
    pub num_classes: usize,
    /// The type the steps compute in (f32 weights either way; fp16 training with loss
    /// scaling, as `hearth train --precision fp16` does).
    pub precision: crate::train::Precision,
}

#[derive(Debug, Clone)]
pub struct BenchReport {
    /// Seconds of each timed step.
    pub step_seconds: Vec<f64>,
    pub images_per_sec: f64,
}

impl BenchReport {
    /// Images/s at the median step and at the fastest step, for `batch` images a step.
    pub fn median_and_best(&self, batch: usize) -> (f64, f64) {
        let mut s = self.step_seconds.clone();
        s.sort_by(f64::total_cmp);
        let at = |t: f64| batch as f64 / t.max(1e-12);
        match (s.get(s.len() / 2), s.first()) {
            (Some(&m), Some(&b)) => (at(m), at(b)),
            _ => (0.0, 0.0),
        }
    }
}

/// The machine's nominal fp32 peak in GFLOP/s, for the "fraction of peak" figures:
/// `HEARTH_PEAK_GFLOPS` if set, else cores x clock (`/proc/cpuinfo`'s "cpu MHz") x FLOPs per
/// cycle and core: 64 with AVX-512 (two 16-lane FMA units), 32 with AVX2 and FMA, 16
/// otherwise. A nominal figure: turbo clocks and CPUs whose AVX-512 units are 256 bits wide
/// make the true peak differ, so set `HEARTH_PEAK_GFLOPS` where it is known. `None` where the
/// clock cannot be read.
pub fn cpu_peak_gflops() -> Option<f64> {
    if let Some(v) = std::env::var("HEARTH_PEAK_GFLOPS")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|v| *v > 0.0)
    {
        return Some(v);
    }
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let mhz: f64 = cpuinfo
        .lines()
        .find(|l| l.starts_with("cpu MHz"))
        .and_then(|l| l.split(':').nth(1))
        .and_then(|v| v.trim().parse().ok())?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    Some(cores * mhz / 1e3 * flops_per_cycle())
}

fn flops_per_cycle() -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return 64.0;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return 32.0;
        }
    }
    16.0
}

impl ModelBench {
    /// Floating-point operations per image: twice torchvision's multiply-adds for a 224x224
    /// forward pass, scaled by the input area, and three times that for a training step
    /// (forward, input gradient, weight gradient).
    pub fn gflop_per_image(&self) -> f64 {
        let area = (self.size as f64 / 224.0).powi(2);
        let passes = match self.mode {
            BenchMode::Infer => 1.0,
            BenchMode::Train => 3.0,
        };
        2.0 * self.arch.torchvision_gmacs() * area * passes
    }

    fn validate(&self) -> Result<()> {
        if self.batch_size == 0 || self.steps == 0 {
            return Err(HearthError::InvalidArgument(
                "--batch-size and --steps must be at least 1".into(),
            ));
        }
        if self.size < hearth_models::MIN_INPUT_SIZE {
            return Err(HearthError::InvalidArgument(format!(
                "--size {} is below the minimum of {}",
                self.size,
                hearth_models::MIN_INPUT_SIZE
            )));
        }
        Ok(())
    }

    /// Runs the bench; `on_step(i, total, seconds, warmup)` is called after every step.
    pub fn run(
        &self,
        device: &Device,
        mut on_step: impl FnMut(usize, usize, f64, bool),
    ) -> Result<BenchReport> {
        self.validate()?;
        crate::device::check_precision(device, self.precision)?;
        let shape = [self.batch_size, 3, self.size, self.size];
        let total = self.warmup + self.steps;
        let mut times = Vec::with_capacity(self.steps);
        match self.mode {
            BenchMode::Infer => {
                let model = self.arch.init(self.num_classes, device)?.valid();
                let x = Tensor::<4>::random(shape, Distribution::Normal(0.0, 1.0), device);
                for i in 0..total {
                    let t = Instant::now();
                    let logits = model.forward_in(x.clone(), self.precision.dtype());
                    let _ = logits.into_data();
                    let dt = t.elapsed().as_secs_f64();
                    let warm = i < self.warmup;
                    if !warm {
                        times.push(dt);
                    }
                    on_step(i + 1, total, dt, warm);
                }
            }
            BenchMode::Train => {
                let device = device.clone().autodiff();
                let mut model = self.arch.init(self.num_classes, &device)?;
                let mut optim = SgdConfig::new()
                    .with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
                    .init();
                let loss_fn = CrossEntropyLossConfig::new().init(&device);
                let x = Tensor::<4>::random(shape, Distribution::Normal(0.0, 1.0), &device);
                let labels: Vec<i64> = (0..self.batch_size)
                    .map(|i| (i % self.num_classes) as i64)
                    .collect();
                let y = Tensor::<1, Int>::from_ints(labels.as_slice(), &device);
                let mixed = crate::train::Mixed::new(self.precision, false, 0);
                for i in 0..total {
                    let t = Instant::now();
                    let logits = model.forward_in(x.clone(), self.precision.dtype());
                    let loss = loss_fn.forward(logits, y.clone());
                    let grads = mixed.gradients(&model, loss.clone());
                    model = optim.step(0.01, model, grads);
                    let _ = loss.into_scalar::<f32>();
                    device.sync().map_err(|e| HearthError::DeviceUnavailable {
                        name: format!("{device:?}"),
                        reason: format!("{e:?}"),
                    })?;
                    let dt = t.elapsed().as_secs_f64();
                    let warm = i < self.warmup;
                    if !warm {
                        times.push(dt);
                    }
                    on_step(i + 1, total, dt, warm);
                }
            }
        }
        let seconds: f64 = times.iter().sum();
        Ok(BenchReport {
            images_per_sec: (self.steps * self.batch_size) as f64 / seconds.max(1e-12),
            step_seconds: times,
        })
    }
}
