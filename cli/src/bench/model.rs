//! `hearth bench model`: warm-up steps, then timed steps of inference or training, in images/s.

use std::time::Instant;

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{SgdConfig, momentum::MomentumConfig};
use burn::prelude::*;
use burn::tensor::Distribution;
use hearth_models::Architecture;

use hearth::{HearthError, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchMode {
    /// Forward pass only, model in evaluation mode.
    #[value(alias = "inference")]
    Infer,
    /// Forward, cross-entropy, backward and an SGD-with-momentum update.
    #[value(alias = "training")]
    Train,
}

impl BenchMode {
    /// The name the command line and the benches' output use.
    pub fn name(self) -> &'static str {
        match self {
            BenchMode::Infer => "infer",
            BenchMode::Train => "train",
        }
    }
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
    pub precision: hearth::train::Precision,
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

/// The CPU's fp32 peak in GFLOP/s, for the "share of peak" figures: `HEARTH_PEAK_GFLOPS` if
/// set, else [`measured_fma_gflops`] (once per process), else a nominal figure where that
/// cannot run: cores x `/proc/cpuinfo`'s "cpu MHz" x 16 FLOPs per cycle. `None` where none of
/// them is known.
///
/// A nominal figure from the clock was wrong both ways: "cpu MHz" is the base clock under a
/// hypervisor (a Zen 5 ran VGG-16 at "98%" of it), and AVX-512 units are 256 bits wide on
/// some CPUs.
pub fn cpu_peak_gflops() -> Option<f64> {
    if let Some(v) = std::env::var("HEARTH_PEAK_GFLOPS")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|v| *v > 0.0)
    {
        return Some(v);
    }
    static MEASURED: std::sync::OnceLock<Option<f64>> = std::sync::OnceLock::new();
    if let Some(v) = *MEASURED.get_or_init(measured_fma_gflops) {
        return Some(v);
    }
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let mhz: f64 = cpuinfo
        .lines()
        .find(|l| l.starts_with("cpu MHz"))
        .and_then(|l| l.split(':').nth(1))
        .and_then(|v| v.trim().parse().ok())?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    Some(cores * mhz / 1e3 * 16.0)
}

/// The fp32 multiply-add rate every core reaches at once, in GFLOP/s: each thread runs twelve
/// independent chains of fused multiply-adds in the widest vectors this build's GEMMs use
/// (AVX-512 with the `avx512` feature on a CPU that has it, else AVX2 + FMA) for about 0.1 s,
/// the best of three runs. `None` on other CPUs.
pub fn measured_fma_gflops() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        let kernel = fma::widest()?;
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        // Calibrate the count to about 0.1 s on one thread, then run it on every thread.
        let mut iters = 1usize << 16;
        loop {
            let t = std::time::Instant::now();
            std::hint::black_box(kernel.run(iters));
            let s = t.elapsed().as_secs_f64();
            if s > 0.02 || iters > 1 << 34 {
                iters = ((iters as f64) * 0.1 / s.max(1e-9)).max(1.0) as usize;
                break;
            }
            iters *= 4;
        }
        let best = (0..3)
            .map(|_| {
                let t = std::time::Instant::now();
                std::thread::scope(|sc| {
                    for _ in 0..threads {
                        sc.spawn(|| std::hint::black_box(kernel.run(iters)));
                    }
                });
                t.elapsed().as_secs_f64()
            })
            .fold(f64::MAX, f64::min);
        let flops = threads as f64 * iters as f64 * kernel.flops_per_iter();
        Some(flops / best / 1e9)
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

#[cfg(target_arch = "x86_64")]
mod fma {
    use std::arch::x86_64::*;

    /// Independent accumulators: enough to cover two FMA units' latency (4-5 cycles each).
    const CHAINS: usize = 12;

    #[derive(Clone, Copy)]
    pub enum Kernel {
        #[cfg(feature = "avx512")]
        Avx512,
        Avx2,
    }

    /// The widest FMA this build's GEMMs use on this CPU.
    pub fn widest() -> Option<Kernel> {
        #[cfg(feature = "avx512")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Some(Kernel::Avx512);
        }
        (std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma"))
            .then_some(Kernel::Avx2)
    }

    impl Kernel {
        pub fn flops_per_iter(self) -> f64 {
            let lanes = match self {
                #[cfg(feature = "avx512")]
                Kernel::Avx512 => 16.0,
                Kernel::Avx2 => 8.0,
            };
            CHAINS as f64 * lanes * 2.0
        }

        pub fn run(self, iters: usize) -> f32 {
            // SAFETY: `widest` returned this kernel only where the CPU has its features.
            unsafe {
                match self {
                    #[cfg(feature = "avx512")]
                    Kernel::Avx512 => avx512(iters),
                    Kernel::Avx2 => avx2(iters),
                }
            }
        }
    }

    #[cfg(feature = "avx512")]
    #[target_feature(enable = "avx512f")]
    fn avx512(iters: usize) -> f32 {
        let (a, b) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
        let mut acc = [_mm512_set1_ps(1.0); CHAINS];
        for _ in 0..iters {
            for v in acc.iter_mut() {
                *v = _mm512_fmadd_ps(*v, a, b);
            }
        }
        let sum = acc
            .iter()
            .fold(_mm512_setzero_ps(), |s, &v| _mm512_add_ps(s, v));
        _mm512_reduce_add_ps(sum)
    }

    #[target_feature(enable = "avx2,fma")]
    fn avx2(iters: usize) -> f32 {
        let (a, b) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
        let mut acc = [_mm256_set1_ps(1.0); CHAINS];
        for _ in 0..iters {
            for v in acc.iter_mut() {
                *v = _mm256_fmadd_ps(*v, a, b);
            }
        }
        let sum = acc
            .iter()
            .fold(_mm256_setzero_ps(), |s, &v| _mm256_add_ps(s, v));
        let mut out = [0f32; 8];
        // SAFETY: `out` holds 8 floats; the unaligned store has no alignment need.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), sum) };
        out.iter().sum()
    }
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
                "a bench needs a batch size and a step count of at least 1".into(),
            ));
        }
        if self.size < hearth_models::MIN_INPUT_SIZE {
            return Err(HearthError::InvalidArgument(format!(
                "the input size {} is below the minimum of {}",
                self.size,
                hearth_models::MIN_INPUT_SIZE
            )));
        }
        let max = hearth::datasets::MAX_IMAGE_SIZE as usize;
        if self.size > max {
            return Err(HearthError::InvalidArgument(format!(
                "the input size {} is above the maximum of {max}",
                self.size
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
        hearth::device::check_precision(device, self.precision)?;
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
                let mixed = hearth::train::Mixed::new(self.precision, false, 0);
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
