//! `hearth bench model`: warm-up steps, then timed steps of inference or training, in images/s.

use std::time::Instant;

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{GradientsParams, SgdConfig, momentum::MomentumConfig};
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
}

#[derive(Debug, Clone)]
pub struct BenchReport {
    /// Seconds of each timed step.
    pub step_seconds: Vec<f64>,
    pub images_per_sec: f64,
}

impl ModelBench {
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
        let shape = [self.batch_size, 3, self.size, self.size];
        let total = self.warmup + self.steps;
        let mut times = Vec::with_capacity(self.steps);
        match self.mode {
            BenchMode::Infer => {
                let model = self.arch.init(self.num_classes, device)?.valid();
                let x = Tensor::<4>::random(shape, Distribution::Normal(0.0, 1.0), device);
                for i in 0..total {
                    let t = Instant::now();
                    let logits = model.forward(x.clone());
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
                for i in 0..total {
                    let t = Instant::now();
                    let logits = model.forward(x.clone());
                    let loss = loss_fn.forward(logits, y.clone());
                    let grads = GradientsParams::from_grads(loss.backward(), &model);
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
