//! A small ResNet (batch norm included) split into 2 and 3 pipeline stages by parameter count
//! trains exactly like the unsplit network under gradient accumulation over the same
//! micro-batches (1e-5), with GPipe and 1F1B; ranks are threads over the in-memory transport.

use std::sync::Arc;
use std::time::Duration;

use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{GradientsAccumulator, GradientsParams, SgdConfig};
use burn::prelude::*;
use burn::tensor::TensorData;
use hearth::dist::Transport;
use hearth::dist::ddp::{module_values, with_module_values};
use hearth::dist::pipeline::{Activation, Pipeline, Schedule};
use hearth::dist::transport::memory::MemoryTransport;
use hearth::models::resnet::{BlockKind, ResNet, ResNetConfig};
use hearth::models::stages::Unit;
use hearth::pipeline::{StageModel, balance};

const STEPS: usize = 2;
const MICRO: usize = 3;
const MB: usize = 2;

fn config() -> ResNetConfig {
    ResNetConfig::new(BlockKind::Basic, [1, 1, 1, 1], 4)
        .with_stem_width(8)
        .with_stage_widths([8, 8, 16, 16])
}

fn micro(s: usize, m: usize, device: &Device) -> (Tensor<4>, Tensor<1, Int>) {
    let x: Vec<f32> = (0..MB * 3 * 32 * 32)
        .map(|i| (((s * 97 + m * 31 + i * 7) % 23) as f32 - 11.0) / 11.0)
        .collect();
    let y: Vec<i64> = (0..MB).map(|i| ((s + m + i) % 4) as i64).collect();
    (
        Tensor::from_data(TensorData::new(x, [MB, 3, 32, 32]), device),
        Tensor::from_data(TensorData::new(y, [MB]), device),
    )
}

fn loss(logits: Tensor<2>, y: Tensor<1, Int>) -> Tensor<1> {
    let device = logits.device();
    CrossEntropyLossConfig::new()
        .init(&device)
        .forward(logits, y)
}

fn sgd() -> burn::optim::ModuleOptimizer {
    SgdConfig::new()
        .with_momentum(Some(
            MomentumConfig::new().with_momentum(0.9).with_dampening(0.0),
        ))
        .init()
}

/// The unsplit network after `STEPS` steps of accumulation over `MICRO` micro-batches, cut into
/// the stages' ranges; each stage's values.
fn reference(model: ResNet, ranges: &[std::ops::Range<usize>]) -> Vec<Vec<Vec<f32>>> {
    let device = Device::flex().autodiff();
    let mut model = model;
    let mut opt = sgd();
    for s in 0..STEPS {
        let mut acc = GradientsAccumulator::<ResNet>::new();
        for m in 0..MICRO {
            let (x, y) = micro(s, m, &device);
            let grads = loss(model.forward(x), y).backward();
            acc.accumulate(&model, GradientsParams::from_grads(grads, &model));
        }
        model = opt.step(0.05, model, acc.grads());
    }
    let mut units = model.into_units();
    let mut out = Vec::new();
    for r in ranges.iter().rev() {
        let stage = StageModel {
            units: units.split_off(r.start),
        };
        out.push(module_values(&stage));
    }
    out.reverse();
    out
}

fn pipelined(stages: Vec<StageModel>, schedule: Schedule) -> Vec<Vec<Vec<f32>>> {
    let p = stages.len();
    let (tx, rx) = std::sync::mpsc::channel();
    for (t, stage) in MemoryTransport::mesh(p).into_iter().zip(stages) {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let r = t.rank();
            let device = Device::flex().autodiff();
            let transport: Arc<dyn Transport> = Arc::new(t);
            let mut pipe = Pipeline::new(transport, (0..p).collect(), schedule)
                .unwrap()
                .with_timeout(Duration::from_secs(60));
            let mut stage = stage;
            let mut opt = sgd();
            for s in 0..STEPS {
                let out = pipe
                    .step(
                        &stage,
                        &mut |m| Activation::Rank4(micro(s, m, &device).0),
                        &mut |out, m| Ok(loss(out.rank2("logits")?, micro(s, m, &device).1)),
                        MICRO,
                        &device,
                    )
                    .unwrap();
                stage = opt.step(0.05, stage, out.grads);
            }
            let _ = tx.send((r, module_values(&stage)));
        });
    }
    drop(tx);
    let mut out = vec![Vec::new(); p];
    for _ in 0..p {
        let (r, v) = rx
            .recv_timeout(Duration::from_secs(180))
            .expect("a stage hung or panicked");
        out[r] = v;
    }
    out
}

/// An independent copy of the network with `values` (batch norm's running statistics are shared
/// between clones of a module, so clones would see each other's training).
fn copy(values: &[Vec<f32>]) -> ResNet {
    let device = Device::flex().autodiff();
    with_module_values(config().init(&device).unwrap(), values.to_vec()).unwrap()
}

#[test]
fn a_resnet_split_by_parameters_trains_like_the_whole_network() {
    let device = Device::flex().autodiff();
    let initial = module_values(&config().init(&device).unwrap());
    let model = copy(&initial);
    let weights: Vec<usize> = model
        .clone()
        .into_units()
        .iter()
        .map(Unit::learnable_params)
        .collect();
    assert_eq!(weights.len(), config().units());
    for parts in [2, 3] {
        let ranges = balance(&weights, parts).unwrap();
        let expected = reference(copy(&initial), &ranges);
        // Training moved every stage (the comparison below is not between untouched copies).
        let mut untouched = copy(&initial).into_units();
        for (r, trained) in ranges.iter().zip(&expected).rev() {
            let before = module_values(&StageModel {
                units: untouched.split_off(r.start),
            });
            assert_ne!(&before, trained, "stage {r:?} did not train");
        }
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            let mut units = copy(&initial).into_units();
            let mut stages = Vec::new();
            for r in ranges.iter().rev() {
                stages.push(StageModel {
                    units: units.split_off(r.start),
                });
            }
            stages.reverse();
            let got = pipelined(stages, schedule);
            for (s, (a, b)) in got.iter().zip(&expected).enumerate() {
                assert_eq!(a.len(), b.len());
                for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
                    assert!(
                        (x - y).abs() <= 1e-5,
                        "{parts} stages {ranges:?}, {schedule:?}, stage {s}: {x} vs {y}"
                    );
                }
            }
        }
    }
}
