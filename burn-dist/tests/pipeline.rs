//! Pipeline parallelism equals the unsplit model: a small CNN split into 2 and 3 stages (ranks
//! as threads over the in-memory transport), GPipe and 1F1B, 4 micro-batches per step; after 3
//! SGD-momentum steps every stage's weights equal the unsplit model's under gradient
//! accumulation over the same micro-batches (1e-5). Once more over a QUIC job (TLS, threads as
//! ranks). 2D: 2 stages x 2 replicas, each stage's replicas averaging its gradients with the
//! allreduce of their group, equal one process on the whole batch.

mod common;

use std::sync::Arc;
use std::time::Duration;

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{Linear, LinearConfig, PaddingConfig2d};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{GradientsAccumulator, GradientsParams, SgdConfig};
use burn::prelude::*;
use burn::tensor::TensorData;
use burn::tensor::activation::relu;
use burn_dist::ddp::allreduce_grads;
use burn_dist::ddp::module_values;
use burn_dist::pipeline::{Activation, Pipeline, PipelineStage, Schedule};
use burn_dist::transport::group::{Grid, Group};
use burn_dist::transport::memory::MemoryTransport;
use burn_dist::{Communicator, DistError, Transport};

const STEPS: usize = 3;
const MICRO: usize = 4;
const MB: usize = 2;

#[derive(Module, Debug)]
struct Conv {
    conv: Conv2d,
}

#[derive(Module, Debug)]
struct Head {
    fc: Linear,
}

/// A stage of the test network.
#[derive(Module, Debug)]
enum Part {
    Conv(Conv),
    Head(Head),
}

impl Part {
    fn apply(&self, x: Activation) -> burn_dist::Result<Activation> {
        Ok(match self {
            Part::Conv(c) => Activation::Rank4(relu(c.conv.forward(x.rank4("conv")?))),
            Part::Head(h) => {
                let x = x.rank4("head")?;
                let [n, c, hh, w] = x.dims();
                Activation::Rank2(h.fc.forward(x.reshape([n, c * hh * w])))
            }
        })
    }
}

impl PipelineStage for Part {
    fn forward(&self, x: Activation) -> burn_dist::Result<Activation> {
        self.apply(x)
    }
}

/// The network's stages: `convs` convolutions (3->4, then 4->4 channels) and the head.
fn parts(convs: usize, device: &Device) -> Vec<Part> {
    let mut v: Vec<Part> = (0..convs)
        .map(|i| {
            let cin = if i == 0 { 3 } else { 4 };
            Part::Conv(Conv {
                conv: Conv2dConfig::new([cin, 4], [3, 3])
                    .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                    .init(device),
            })
        })
        .collect();
    v.push(Part::Head(Head {
        fc: LinearConfig::new(4 * 4 * 4, 3).init(device),
    }));
    v
}

/// Micro-batch `m` of step `s`: inputs `[MB, 3, 4, 4]` and targets `[MB, 3]`.
fn micro(s: usize, m: usize, device: &Device) -> (Tensor<4>, Tensor<2>) {
    let x: Vec<f32> = (0..MB * 48)
        .map(|i| (((s * 97 + m * 31 + i * 7) % 19) as f32 - 9.0) / 9.0)
        .collect();
    let y: Vec<f32> = (0..MB * 3)
        .map(|i| (((s * 13 + m * 5 + i * 3) % 7) as f32 - 3.0) / 3.0)
        .collect();
    (
        Tensor::from_data(TensorData::new(x, [MB, 3, 4, 4]), device),
        Tensor::from_data(TensorData::new(y, [MB, 3]), device),
    )
}

fn mse(out: Tensor<2>, target: Tensor<2>) -> Tensor<1> {
    (out - target).powi_scalar(2).mean()
}

fn sgd() -> burn::optim::ModuleOptimizer {
    SgdConfig::new()
        .with_momentum(Some(
            MomentumConfig::new().with_momentum(0.9).with_dampening(0.0),
        ))
        .init()
}

/// The unsplit model, trained with gradient accumulation over the same micro-batches.
fn reference(stages: Vec<Part>) -> Vec<Vec<Vec<f32>>> {
    let device = Device::flex().autodiff();
    let mut model: Vec<Part> = stages;
    let mut opt = sgd();
    for s in 0..STEPS {
        let mut acc = GradientsAccumulator::<Vec<Part>>::new();
        for m in 0..MICRO {
            let (x, y) = micro(s, m, &device);
            let mut a = Activation::Rank4(x);
            for part in &model {
                a = part.apply(a).unwrap();
            }
            let grads = mse(a.rank2("out").unwrap(), y).backward();
            acc.accumulate(&model, GradientsParams::from_grads(grads, &model));
        }
        model = opt.step(0.05, model, acc.grads());
    }
    model.iter().map(module_values).collect()
}

fn memory(p: usize) -> Vec<Arc<dyn Transport>> {
    MemoryTransport::mesh(p)
        .into_iter()
        .map(|t| Arc::new(t) as Arc<dyn Transport>)
        .collect()
}

/// The same training split over `stages.len()` ranks (`transports`, in rank order); each rank's
/// final weights.
fn pipelined(
    stages: Vec<Part>,
    schedule: Schedule,
    transports: Vec<Arc<dyn Transport>>,
) -> Vec<Vec<Vec<f32>>> {
    let p = stages.len();
    let (tx, rx) = std::sync::mpsc::channel();
    for (transport, part) in transports.into_iter().zip(stages) {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let r = transport.rank();
            let device = Device::flex().autodiff();
            let mut pipe = Pipeline::new(transport, (0..p).collect(), schedule)
                .unwrap()
                .with_timeout(Duration::from_secs(30));
            let mut part = part;
            let mut opt = sgd();
            let mut peak = 0;
            for s in 0..STEPS {
                let out = pipe
                    .step(
                        &part,
                        &mut |m| Activation::Rank4(micro(s, m, &device).0),
                        &mut |out, m| Ok(mse(out.rank2("loss")?, micro(s, m, &device).1)),
                        MICRO,
                        &device,
                    )
                    .unwrap();
                peak = peak.max(out.peak_in_flight);
                if r + 1 == p {
                    assert_eq!(out.losses.len(), MICRO);
                }
                part = opt.step(0.05, part, out.grads);
            }
            let _ = tx.send((r, module_values(&part), peak));
        });
    }
    drop(tx);
    let mut out = vec![Vec::new(); p];
    for _ in 0..p {
        let (r, values, peak) = rx
            .recv_timeout(Duration::from_secs(120))
            .expect("a stage hung or panicked");
        let bound = if schedule == Schedule::GPipe {
            MICRO
        } else {
            p - r
        };
        assert_eq!(
            peak, bound,
            "{schedule:?}: stage {r} held {peak} micro-batches"
        );
        out[r] = values;
    }
    out
}

#[test]
fn a_split_cnn_trains_exactly_like_the_unsplit_one_with_gpipe_and_1f1b() {
    for convs in [1, 2] {
        let device = Device::flex().autodiff();
        let stages = parts(convs, &device);
        let expected = reference(stages.clone());
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            let got = pipelined(stages.clone(), schedule, memory(convs + 1));
            for (s, (a, b)) in got.iter().zip(&expected).enumerate() {
                for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
                    assert!(
                        (x - y).abs() <= 1e-5,
                        "{} stages, {schedule:?}, stage {s}: {x} vs {y}",
                        convs + 1
                    );
                }
            }
        }
        // The comparison is between trained weights, not two untouched copies.
        let start: Vec<Vec<Vec<f32>>> = stages.iter().map(module_values).collect();
        assert_ne!(start, expected);
    }
}

#[test]
fn a_pipeline_over_quic_between_authenticated_ranks_matches_too() {
    let device = Device::flex().autodiff();
    let stages = parts(2, &device);
    let expected = reference(stages.clone());
    let transports: Vec<Arc<dyn Transport>> = common::job(3)
        .into_iter()
        .map(|t| Arc::new(t) as Arc<dyn Transport>)
        .collect();
    let got = pipelined(stages, Schedule::OneFOneB, transports);
    for (s, (a, b)) in got.iter().zip(&expected).enumerate() {
        for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
            assert!((x - y).abs() <= 1e-5, "QUIC, stage {s}: {x} vs {y}");
        }
    }
}

#[test]
fn a_stage_given_the_wrong_rank_of_tensor_fails_naming_it() {
    let p = 2;
    let (tx, rx) = std::sync::mpsc::channel();
    for t in MemoryTransport::mesh(p) {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let r = t.rank();
            let device = Device::flex().autodiff();
            // Stage 0 sends a 2-d activation where stage 1 (a convolution) expects 4-d.
            let part = if r == 0 {
                Part::Head(Head {
                    fc: LinearConfig::new(48, 5).init(&device),
                })
            } else {
                parts(1, &device).remove(0)
            };
            let mut pipe = Pipeline::new(Arc::new(t), vec![0, 1], Schedule::GPipe)
                .unwrap()
                .with_timeout(Duration::from_secs(5));
            let out = pipe.step(
                &part,
                &mut |m| Activation::Rank4(micro(0, m, &device).0),
                &mut |out, _| Ok(out.rank2("loss")?.sum()),
                1,
                &device,
            );
            let _ = tx.send((r, out.err().map(|e: DistError| e.to_string())));
        });
    }
    drop(tx);
    for _ in 0..p {
        let (r, e) = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("a stage hung");
        if r == 1 {
            let e = e.expect("stage 1 must fail");
            assert!(e.contains("stage 1") && e.contains("4-d"), "{e}");
        }
    }
}

/// Micro-batches `0..n` of step `s` as one batch.
fn whole_batch(s: usize, n: usize, device: &Device) -> (Tensor<4>, Tensor<2>) {
    let (xs, ys): (Vec<_>, Vec<_>) = (0..n).map(|m| micro(s, m, device)).unzip();
    (Tensor::cat(xs, 0), Tensor::cat(ys, 0))
}

#[test]
fn two_stages_times_two_replicas_equal_one_process_on_the_whole_batch() {
    const D: usize = 2;
    let device = Device::flex().autodiff();
    let stages = parts(1, &device);
    let p = stages.len();
    let grid = Grid::new(p, p * D).unwrap();

    // One process, one forward over all D x MICRO micro-batches of each step.
    let mut model = stages.clone();
    let mut opt = sgd();
    for s in 0..STEPS {
        let (x, y) = whole_batch(s, D * MICRO, &device);
        let mut a = Activation::Rank4(x);
        for part in &model {
            a = part.apply(a).unwrap();
        }
        let grads = mse(a.rank2("out").unwrap(), y).backward();
        let grads = GradientsParams::from_grads(grads, &model);
        model = opt.step(0.05, model, grads);
    }
    let expected: Vec<Vec<Vec<f32>>> = model.iter().map(module_values).collect();

    // Replica d's pipeline takes micro-batches d*MICRO.. of the step; each micro-batch's loss is
    // scaled by 1/MICRO so the pipeline's sum is its batch mean, and the replicas' average is
    // the whole batch's mean.
    let (tx, rx) = std::sync::mpsc::channel();
    for transport in memory(p * D) {
        let tx = tx.clone();
        let part = stages[grid.place(transport.rank()).0].clone();
        std::thread::spawn(move || {
            let r = transport.rank();
            let (stage, replica) = grid.place(r);
            let device = Device::flex().autodiff();
            let replicas = Group::new(transport.clone(), grid.stage_replicas(stage), 1).unwrap();
            let comm = Communicator::new(Arc::new(replicas)).with_timeout(Duration::from_secs(30));
            let mut pipe = Pipeline::new(transport, grid.pipeline(replica), Schedule::OneFOneB)
                .unwrap()
                .with_timeout(Duration::from_secs(30));
            let (mut part, mut opt) = (part, sgd());
            for s in 0..STEPS {
                let m0 = replica * MICRO;
                let mut out = pipe
                    .step(
                        &part,
                        &mut |m| Activation::Rank4(micro(s, m0 + m, &device).0),
                        &mut |out, m| {
                            let loss = mse(out.rank2("loss")?, micro(s, m0 + m, &device).1);
                            Ok(loss.div_scalar(MICRO as f32))
                        },
                        MICRO,
                        &device,
                    )
                    .unwrap();
                allreduce_grads(&part, &mut out.grads, &comm, 1 << 20).unwrap();
                part = opt.step(0.05, part, out.grads);
            }
            let _ = tx.send((r, module_values(&part)));
        });
    }
    drop(tx);
    for _ in 0..p * D {
        let (r, got) = rx
            .recv_timeout(Duration::from_secs(120))
            .expect("a rank hung or panicked");
        let stage = grid.place(r).0;
        for (x, y) in got.iter().flatten().zip(expected[stage].iter().flatten()) {
            assert!(
                (x - y).abs() <= 1e-5,
                "rank {r} (stage {stage}): {x} vs {y}"
            );
        }
    }
    let start: Vec<Vec<Vec<f32>>> = stages.iter().map(module_values).collect();
    assert_ne!(start, expected);
}
