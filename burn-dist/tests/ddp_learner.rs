//! `DdpStrategy` itself, through burn-train's Learner: 2 ranks with batch b each (threads over
//! the in-memory transport) end an epoch with the same weights (1e-5) as burn-train's own
//! single-device loop with batch 2b, without and with gradient accumulation. A model without
//! batch norm: with it, each rank normalises by its own half-batch statistics and the results
//! differ (as in PyTorch DDP without SyncBatchNorm).

mod common;

use std::sync::Arc;

use burn::data::dataloader::{DataLoader, DataLoaderIterator, Progress};
use burn::data::dataset::DatasetError;
use burn::optim::SgdConfig;
use burn::optim::momentum::MomentumConfig;
use burn::prelude::*;
use burn::train::{
    InferenceStep, Learner, RegressionOutput, SupervisedTraining, TrainOutput, TrainStep,
    TrainingStrategy,
};
use burn_dist::Communicator;
use burn_dist::ddp::{DdpStrategy, module_values, with_module_values};
use common::{Mlp, assert_close, batch, run_ranks};

impl Mlp {
    fn regression(&self, batch: Batch) -> RegressionOutput {
        let out = self.forward(batch.x);
        let loss = (out.clone() - batch.y.clone()).powi_scalar(2).mean();
        RegressionOutput::new(loss, out, batch.y)
    }
}

#[derive(Clone, Debug)]
pub struct Batch {
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
        let (x, y) = batch(self.s, self.steps.range.clone(), &self.steps.device);
        self.s += 1;
        Some(Ok(Batch { x, y }))
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
    let dir_path = dir.path().to_path_buf();
    let reference = fit(
        initial.clone(),
        0..world * B,
        accumulation,
        None,
        &dir.path().join("one"),
    );
    let ranks = run_ranks(world, &initial, move |start, comm, r| {
        let out_dir = dir_path.join(format!("rank{r}"));
        fit(
            start,
            r * B..(r + 1) * B,
            accumulation,
            Some(Arc::new(comm)),
            &out_dir,
        )
    });
    for (r, weights) in ranks {
        let what = format!(
            "rank {r}, accumulation {accumulation:?} vs 1 process with batch {}",
            world * B
        );
        assert_close(&weights, &reference, &what);
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
