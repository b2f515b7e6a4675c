//! Your own Burn module on your own data, trained by Hearth's distributed modes: a small
//! multi-layer perceptron (not an image model) that tells three interleaved spirals of 2-D
//! points apart. Two traits are all it takes: [`Net`] (the module's input and logits) and
//! [`Examples`] (how a list of example indices becomes a batch). Hearth shuffles, shards,
//! steps, exchanges, validates, stops early, checkpoints, resumes and exports.
//!
//!   cargo build --release --example custom_model
//!   # one process:
//!   target/release/examples/custom_model dp runs/mlp-one
//!   # data parallel on 2 ranks (gradient allreduce):
//!   cargo run --release -- launch -n 2 -- target/release/examples/custom_model dp runs/mlp-dp
//!   # on parameter servers (2 workers and 1 dedicated server, synchronous):
//!   cargo run --release -- launch -n 3 -- target/release/examples/custom_model ps runs/mlp-ps
//!   # elastic (workers may come and go; the global batch stays 32):
//!   cargo run --release -- launch --elastic -n 2 --min 1 --max 3 -- \
//!       target/release/examples/custom_model elastic runs/mlp-elastic
//!
//! `--precision bf16|fp16` trains it in mixed precision (the module's `Net::logits_in` computes
//! in the type asked for; fp16's loss scaling is Hearth's). `--zero 1|2` shards the optimizer's
//! state over the data-parallel ranks; its checkpoint resumes on any number of them.
//!
//! Each writes the run directory as `hearth train` does (`metrics.csv`, `metrics.png`,
//! checkpoints, `model.bpk` with the module's weights); `--resume` continues a stopped run.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::prelude::*;
use burn::tensor::FloatDType;
use hearth::dist::rendezvous::RankInfo;
use hearth::kernels::linear;
use hearth::train::{
    Custom, ElasticOptions, ExampleError, Examples, Net, PsMode, PsOptions, PsServers, Targets,
    TrainConfig, TrainingMode, train_custom,
};

/// The user's network: 2 inputs, two hidden layers, one logit per class.
#[derive(Module, Debug)]
pub struct Mlp {
    a: Linear,
    b: Linear,
    out: Linear,
    act: Relu,
}

impl Mlp {
    pub fn new(classes: usize, device: &Device) -> Self {
        Self {
            a: LinearConfig::new(2, 32).init(device),
            b: LinearConfig::new(32, 32).init(device),
            out: LinearConfig::new(32, classes).init(device),
            act: Relu::new(),
        }
    }
}

impl Net for Mlp {
    type Input = Tensor<2>;
    /// `logits_in` computes in the type it is asked for (`--precision bf16|fp16`).
    const MIXED_PRECISION: bool = true;
    fn logits(&self, x: Tensor<2>) -> Tensor<2> {
        self.logits_in(x, FloatDType::F32)
    }
    /// Mixed precision: the input cast to `dtype`, each layer computed in it by Hearth's
    /// precision-aware `linear` (the f32 weights cast on the way in, so they and their
    /// gradients stay f32), the logits back in f32 for the loss.
    fn logits_in(&self, x: Tensor<2>, dtype: FloatDType) -> Tensor<2> {
        let x = self.act.forward(linear(&self.a, x.cast(dtype)));
        let x = self.act.forward(linear(&self.b, x));
        linear(&self.out, x).cast(FloatDType::F32)
    }
}

/// The user's data: points of `classes` spirals with a little noise, made from a seed.
pub struct Spirals {
    points: Vec<[f32; 2]>,
    labels: Vec<i64>,
}

impl Spirals {
    pub fn new(classes: usize, per_class: usize, seed: u64) -> Self {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut noise = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f32 / (1u64 << 53) as f32 - 0.5
        };
        let (mut points, mut labels) = (Vec::new(), Vec::new());
        for c in 0..classes {
            for i in 0..per_class {
                let r = i as f32 / per_class as f32;
                let t = c as f32 * std::f32::consts::TAU / classes as f32 + 4.0 * r;
                points.push([r * t.cos() + 0.05 * noise(), r * t.sin() + 0.05 * noise()]);
                labels.push(c as i64);
            }
        }
        Self { points, labels }
    }
}

impl Examples for Spirals {
    type Input = Tensor<2>;
    fn len(&self) -> usize {
        self.points.len()
    }
    fn batch(
        &self,
        indices: &[usize],
        device: &Device,
    ) -> std::result::Result<(Tensor<2>, Targets), ExampleError> {
        let mut xy = Vec::with_capacity(indices.len() * 2);
        let mut ys = Vec::with_capacity(indices.len());
        for &i in indices {
            let p = self.points.get(i).ok_or(format!("no example {i}"))?;
            xy.extend_from_slice(p);
            ys.push(self.labels[i]);
        }
        let n = indices.len();
        Ok((
            Tensor::from_data(TensorData::new(xy, [n, 2]), device),
            Targets::Classes(Tensor::from_data(TensorData::new(ys, [n]), device)),
        ))
    }
}

fn main() -> Result<()> {
    // As the `hearth` binary does: Burn's default device pinned to the run's backend, the CPU
    // (where a resume loads optimizer state), freed memory kept for the next step, this thread
    // one of the kernels' threads. SAFETY: first thing in main, before any thread starts.
    unsafe { hearth::process::start("flex") }?;
    let mut args = std::env::args().skip(1);
    let usage = "usage: custom_model dp|ps|elastic RUN_DIR [--resume] [--epochs N] [--lr RATE] \
                 [--precision fp32|bf16|fp16] [--optimizer sgd|adam|adamw|lars] [--zero 1|2] \
                 (under `hearth launch`)";
    let mode = args.next().context(usage)?;
    let run: PathBuf = args.next().context(usage)?.into();
    let mut cfg = TrainConfig::new(run);
    cfg.epochs = 8;
    cfg.batch_size = 32;
    cfg.optim.lr = 0.1;
    cfg.optim.weight_decay = 0.0;
    cfg.optim.warmup_epochs = 0;
    // `hearth launch --elastic` passes its --min/--max on as these two.
    let (mut min_workers, mut max_workers) = (1, 3);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--resume" => cfg.checkpoint.resume = true,
            "--overwrite" => cfg.checkpoint.overwrite = true,
            "--epochs" => cfg.epochs = args.next().context("--epochs N")?.parse()?,
            "--lr" => cfg.optim.lr = args.next().context("--lr RATE")?.parse()?,
            "--stop-after-epoch" => {
                cfg.checkpoint.stop_after_epoch =
                    Some(args.next().context("--stop-after-epoch N")?.parse()?)
            }
            "--patience" => {
                cfg.checkpoint.patience = Some(args.next().context("--patience N")?.parse()?)
            }
            "--precision" => {
                let p = args.next().context("--precision fp32|bf16|fp16")?;
                cfg.compute.precision = p
                    .parse()
                    .map_err(|e| anyhow::anyhow!("--precision {p}: {e}"))?;
            }
            "--optimizer" => {
                let o = args.next().context("--optimizer sgd|adam|adamw|lars")?;
                cfg.optim.optimizer = o
                    .parse()
                    .map_err(|e| anyhow::anyhow!("--optimizer {o}: {e}"))?;
            }
            // Data parallel's sharded optimizer: each rank keeps 1/N of the optimizer state.
            "--zero" => cfg.exchange.zero = args.next().context("--zero 1|2")?.parse()?,
            "--min-workers" => min_workers = args.next().context("--min-workers N")?.parse()?,
            "--max-workers" => max_workers = args.next().context("--max-workers N")?.parse()?,
            other => bail!("unknown option {other}; {usage}"),
        }
    }
    cfg.dist = RankInfo::detect()?;
    match mode.as_str() {
        // Data parallel over the ranks `hearth launch -n N` starts; one process without it.
        "dp" => {}
        "ps" => {
            cfg.mode = TrainingMode::ParameterServers(PsOptions {
                servers: PsServers::Dedicated(1),
                mode: PsMode::Sync,
                ..Default::default()
            })
        }
        "elastic" => {
            cfg.mode = TrainingMode::Elastic(
                ElasticOptions {
                    min_workers,
                    max_workers,
                    ..Default::default()
                }
                .with_env()?,
            )
        }
        other => bail!("unknown mode {other}; {usage}"),
    }
    let classes: Vec<String> = ["red", "green", "blue"].map(String::from).to_vec();
    let custom = Custom::new(
        |device: &Device| Mlp::new(3, device),
        Spirals::new(3, 200, 1),
        Spirals::new(3, 60, 2),
        classes,
    );
    let report = train_custom(&cfg, &custom, &Device::flex(), &mut |l| eprintln!("{l}"))?;
    if report.rank == 0 && report.model_path.exists() {
        println!(
            "{mode}: best epoch {} of {}: validation accuracy {:.2}%, model at {}",
            report.best_epoch,
            report.epochs_run,
            report.best_val_accuracy.unwrap_or(f64::NAN),
            report.model_path.display()
        );
    }
    Ok(())
}
