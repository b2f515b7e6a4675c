//! `DdpStrategy` itself, through burn-train's Learner: 2 ranks with batch b each (threads over
//! the in-memory transport) end an epoch with the same weights (1e-5) as burn-train's own
//! single-device loop with batch 2b, without and with gradient accumulation. A model without
//! batch norm: with it, each rank normalises by its own half-batch statistics and the results
//! differ (as in PyTorch DDP without SyncBatchNorm).

use std::sync::Arc;
use std::time::Duration;

use burn::data::dataloader::{DataLoader, DataLoaderIterator, Progress};
use burn::data::dataset::DatasetError;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::SgdConfig;
use burn::optim::momentum::MomentumConfig;
use burn::prelude::*;
use burn::tensor::TensorData;
use burn::train::{
    InferenceStep, Learner, RegressionOutput, SupervisedTraining, TrainOutput, TrainStep,
    TrainingStrategy,
};
use burn_dist::ddp::{DdpStrategy, module_values, with_module_values};
use burn_dist::transport::memory::MemoryTransport;
use burn_dist::{Communicator, Transport};

#[derive(Module, Debug)]
struct Mlp {
    a: Linear,
    b: Linear,
    act: Relu,
}

impl Mlp {
    fn new(device: &Device) -> Self {
        Self {
            a: LinearConfig::new(6, 16).init(device),
            b: LinearConfig::new(16, 3).init(device),
            act: Relu::new(),
        }
    }

    fn regression(&self, batch: Batch) -> RegressionOutput {
        let out = self.b.forward(self.act.forward(self.a.forward(batch.x)));
        let loss = (out.clone() - batch.y.clone()).powi_scalar(2).mean();
        RegressionOutput::new(loss, out, batch.y)
    }
}

#[derive(Clone, Debug)]
struct Batch {
    x: Tensor<2>,
    y: Tensor<2>,
}

impl TrainStep for Mlp {
    type Input = Batch;
    type Output = RegressionOutput;
    fn step(&self, batch: Batch) -> TrainOutput<RegressionOutput> {
        let out = self.regression(batch);
        TrainOutput::new(self, out.loss.backward(), out)
    }
}

impl InferenceStep for Mlp {
    type Input = Batch;
    type Output = RegressionOutput;
    fn step(&self, batch: Batch) -> RegressionOutput {
        self.regression(batch)
    }
}

const STEPS: usize = 6;
const B: usize = 4;

/// Sample `i` of step `s`.
fn sample(s: usize, i: usize) -> (Vec<f32>, Vec<f32>) {
    let x = (0..6)
        .map(|j| (((s * 131 + i * 17 + j * 7) % 23) as f32 - 11.0) / 7.0)
        .collect();
    let y = (0..3)
        .map(|j| (((s * 31 + i * 5 + j * 3) % 11) as f32 - 5.0) / 5.0)
        .collect();
    (x, y)
}

/// `STEPS` batches; batch `s` holds samples `range` of step `s`.
#[derive(Clone)]
struct Steps {
    range: std::ops::Range<usize>,
    device: Device,
}

struct StepsIter {
    steps: Steps,
    s: usize,
}

impl Iterator for StepsIter {
    type Item = Result<Batch, DatasetError>;
    fn next(&mut self) -> Option<Self::Item> {
        if self.s >= STEPS {
            return None;
        }
        let (mut xs, mut ys) = (Vec::new(), Vec::new());
        for i in self.steps.range.clone() {
            let (x, y) = sample(self.s, i);
            xs.extend(x);
            ys.extend(y);
        }
        self.s += 1;
        let n = self.steps.range.len();
        Some(Ok(Batch {
            x: Tensor::from_data(TensorData::new(xs, [n, 6]), &self.steps.device),
            y: Tensor::from_data(TensorData::new(ys, [n, 3]), &self.steps.device),
        }))
    }
}

impl DataLoaderIterator<Batch> for StepsIter {
    fn progress(&self) -> Progress {
        Progress::new(
            self.s * self.steps.range.len(),
            STEPS * self.steps.range.len(),
            None,
        )
    }
}

impl DataLoader<Batch> for Steps {
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<Batch> + 'a> {
        Box::new(StepsIter {
            steps: self.clone(),
            s: 0,
        })
    }
    fn num_items(&self) -> usize {
        STEPS * self.range.len()
    }
    fn to_device(&self, device: &Device) -> Arc<dyn DataLoader<Batch>> {
        Arc::new(Self {
            range: self.range.clone(),
            device: device.clone(),
        })
    }
    fn slice(&self, _start: usize, _end: usize) -> Arc<dyn DataLoader<Batch>> {
        Arc::new(self.clone())
    }
}

/// One epoch through burn-train, on `range` of every step, from `initial`; DDP when `comm` is
/// given. Returns the trained weights.
fn fit(
    initial: Vec<Vec<f32>>,
    range: std::ops::Range<usize>,
    accumulation: Option<usize>,
    comm: Option<Arc<Communicator>>,
    dir: &std::path::Path,
) -> Vec<Vec<f32>> {
    let device = Device::flex().autodiff();
    let model = with_module_values(Mlp::new(&device), initial).unwrap();
    let loader = |device: &Device| {
        Arc::new(Steps {
            range: range.clone(),
            device: device.clone(),
        })
    };
    let mut training = SupervisedTraining::new(dir, loader(&device), loader(&Device::flex()))
        .num_epochs(1)
        .with_application_logger(None);
    if let Some(k) = accumulation {
        training = training.grads_accumulation(k);
    }
    if let Some(comm) = comm {
        let strategy = DdpStrategy::new(comm).with_bucket_bytes(64);
        training = training.with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)));
    }
    let optim = SgdConfig::new()
        .with_momentum(Some(
            MomentumConfig::new().with_momentum(0.9).with_dampening(0.0),
        ))
        .init();
    let result = training.launch(Learner::new(model, optim, 0.05));
    assert!(
        result.error.is_none(),
        "{:?}",
        result.error.map(|e| e.to_string())
    );
    module_values(&result.model)
}

fn ddp_matches_one_process(accumulation: Option<usize>) {
    let world = 2;
    let device = Device::flex();
    let initial = module_values(&Mlp::new(&device));
    let dir = tempfile::tempdir().unwrap();
    let reference = fit(
        initial.clone(),
        0..world * B,
        accumulation,
        None,
        &dir.path().join("one"),
    );
    let (tx, rx) = std::sync::mpsc::channel();
    for t in MemoryTransport::mesh(world) {
        // Ranks start from different weights: the strategy's broadcast must fix that.
        let start = if t.rank() == 0 {
            initial.clone()
        } else {
            module_values(&Mlp::new(&device))
        };
        let tx = tx.clone();
        let out_dir = dir.path().join(format!("rank{}", t.rank()));
        std::thread::spawn(move || {
            let r = t.rank();
            let comm = Arc::new(
                Communicator::new(Arc::new(t))
                    .with_chunk_elems(7)
                    .with_timeout(Duration::from_secs(30)),
            );
            let out = fit(
                start,
                r * B..(r + 1) * B,
                accumulation,
                Some(comm),
                &out_dir,
            );
            let _ = tx.send((r, out));
        });
    }
    drop(tx);
    for _ in 0..world {
        let (r, weights) = rx
            .recv_timeout(Duration::from_secs(120))
            .expect("a rank hung or panicked");
        for (a, b) in weights.iter().zip(&reference) {
            for (x, y) in a.iter().zip(b) {
                assert!(
                    (x - y).abs() <= 1e-5,
                    "rank {r}, accumulation {accumulation:?}: {x} vs {y} (1 process, batch {})",
                    world * B
                );
            }
        }
    }
    // The run really moved the weights (the comparison is not between two untrained models).
    let moved = reference
        .iter()
        .flatten()
        .zip(initial.iter().flatten())
        .any(|(a, b)| (a - b).abs() > 1e-3);
    assert!(moved);
}

#[test]
fn ddp_strategy_through_burn_train_matches_one_process_with_the_whole_batch() {
    ddp_matches_one_process(None);
}

#[test]
fn ddp_strategy_with_gradient_accumulation_matches_one_process() {
    // 6 batches in 3 optimizer steps of 2 micro-batches each.
    ddp_matches_one_process(Some(2));
    // A last group shorter than K (6 = 4 + 2): both loops step at the end of the epoch.
    ddp_matches_one_process(Some(4));
}
