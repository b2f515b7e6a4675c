//! Pipeline parallelism equals the unsplit model: a small CNN split into 2 and 3 stages (ranks
//! as threads over the in-memory transport), GPipe and 1F1B, 4 micro-batches per step; after 3
//! SGD-momentum steps every stage's weights equal the unsplit model's under gradient
//! accumulation over the same micro-batches (1e-5). Once more over a QUIC job (TLS, threads as
//! ranks). 2D: 2 stages x 2 replicas, each stage's replicas averaging its gradients with the
//! allreduce of their group, equal one process on the whole batch. (The segmented backward and
//! the overlapped exchange: `segments.rs`.)

mod common;

use std::sync::Arc;
use std::time::Duration;

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{LinearConfig, PaddingConfig2d};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{GradientsAccumulator, GradientsParams, SgdConfig};
use burn::prelude::*;
use burn::tensor::activation::relu;
use burn_dist::ddp::allreduce_grads;
use burn_dist::ddp::module_values;
use burn_dist::pipeline::{Activation, Pipeline, PipelineStage, Schedule};
use burn_dist::transport::group::{Grid, Group};
use burn_dist::transport::memory::MemoryTransport;
use burn_dist::{Communicator, DistError, Transport};
use common::cnn::{Head, MB, Part, micro, mse, parts};

const STEPS: usize = 3;
const MICRO: usize = 4;

/// Held by every test for its whole run: the backend's random stream is the process's (and
/// parameters initialise lazily, at their first forward), and the recomputation test reseeds
/// it and must see only its own draws.
static RANDOM: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn random_lock() -> std::sync::MutexGuard<'static, ()> {
    RANDOM.lock().unwrap_or_else(|e| e.into_inner())
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
    pipelined_with(stages, schedule, transports, false)
}

/// [`pipelined`], recomputing activations or not. Checks what each stage held: every
/// in-flight micro-batch's graph without recomputation, at most one graph with it.
fn pipelined_with(
    stages: Vec<Part>,
    schedule: Schedule,
    transports: Vec<Arc<dyn Transport>>,
    recompute: bool,
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
                .with_timeout(Duration::from_secs(30))
                .with_recompute(recompute);
            let mut part = part;
            let mut opt = sgd();
            let (mut peak, mut graphs) = (0, 0);
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
                graphs = graphs.max(out.peak_graphs);
                if r + 1 == p {
                    assert_eq!(out.losses.len(), MICRO);
                }
                part = opt.step(0.05, part, out.grads);
            }
            let _ = tx.send((r, module_values(&part), peak, graphs));
        });
    }
    drop(tx);
    let mut out = vec![Vec::new(); p];
    for _ in 0..p {
        let (r, values, peak, graphs) = rx
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
        let most_graphs = if recompute { 1 } else { bound };
        assert_eq!(
            graphs, most_graphs,
            "{schedule:?}, recompute {recompute}: stage {r} held {graphs} graphs"
        );
        out[r] = values;
    }
    out
}

#[test]
fn a_split_cnn_trains_exactly_like_the_unsplit_one_with_gpipe_and_1f1b() {
    let _random = random_lock();
    for convs in [1, 2] {
        let device = Device::flex().autodiff();
        let stages = parts(convs, &device);
        let expected = reference(stages.clone());
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            for recompute in [false, true] {
                let got = pipelined_with(stages.clone(), schedule, memory(convs + 1), recompute);
                for (s, (a, b)) in got.iter().zip(&expected).enumerate() {
                    for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
                        assert!(
                            (x - y).abs() <= 1e-5,
                            "{} stages, {schedule:?}, recompute {recompute}, stage {s}: {x} vs {y}",
                            convs + 1
                        );
                    }
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
    let _random = random_lock();
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
    let _random = random_lock();
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
    let _random = random_lock();
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

/// A convolution whose output is multiplied by a random 0/1 mask (dropout's draw), recording
/// each draw with its input's sum.
/// Each forward pass's dropout draws: (first pass, recomputation).
type Draws = Arc<std::sync::Mutex<Vec<(Vec<f32>, Vec<f32>)>>>;

#[derive(Module, Debug)]
struct Noisy {
    conv: Conv2d,
    #[module(skip)]
    draws: Draws,
}

impl PipelineStage for Noisy {
    fn forward(&self, x: Activation) -> burn_dist::Result<Activation> {
        let x = x.rank4("noisy")?;
        let key = x.clone().into_data().try_into_vec::<f32>().unwrap();
        let y = relu(self.conv.forward(x));
        let mask = y
            .random_like(burn::tensor::Distribution::Bernoulli(0.5))
            .detach();
        let drawn = mask.clone().into_data().try_into_vec::<f32>().unwrap();
        self.draws.lock().unwrap().push((key, drawn));
        Ok(Activation::Rank4(y * mask))
    }
}

#[test]
fn recomputation_draws_what_the_first_pass_drew_and_gives_the_same_training_on_any_schedule() {
    let _random = random_lock();
    let mut results = Vec::new();
    for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
        let device = Device::flex().autodiff();
        device.seed(7);
        let draws = Arc::new(std::sync::Mutex::new(Vec::new()));
        let noisy = Noisy {
            conv: Conv2dConfig::new([3, 4], [3, 3])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(&device),
            draws: draws.clone(),
        };
        let head = Head {
            fc: LinearConfig::new(4 * 4 * 4, 3).init(&device),
        };
        // Initialised here (parameters initialise lazily, drawing from the stream the other
        // stage's thread reseeds: one process per stage would not share it).
        let _ = (module_values(&noisy), module_values(&head));
        let mut transports = MemoryTransport::mesh(2).into_iter();
        let (t0, t1) = (transports.next().unwrap(), transports.next().unwrap());
        let other = std::thread::spawn(move || -> Vec<Vec<f32>> {
            let device = Device::flex().autodiff();
            let mut pipe = Pipeline::new(Arc::new(t1), vec![0, 1], schedule)
                .unwrap()
                .with_timeout(Duration::from_secs(30))
                .with_recompute(true);
            let mut head = Part::Head(head);
            let mut opt = sgd();
            for s in 0..STEPS {
                let out = pipe
                    .step(
                        &head,
                        &mut |_| unreachable!("stage 1 takes no input"),
                        &mut |out, m| Ok(mse(out.rank2("loss")?, micro(s, m, &device).1)),
                        MICRO,
                        &device,
                    )
                    .unwrap();
                head = opt.step(0.05, head, out.grads);
            }
            module_values(&head)
        });
        let mut pipe = Pipeline::new(Arc::new(t0), vec![0, 1], schedule)
            .unwrap()
            .with_timeout(Duration::from_secs(30))
            .with_recompute(true);
        pipe.seed(11);
        let mut noisy = noisy;
        let mut opt = sgd();
        for s in 0..STEPS {
            let out = pipe
                .step(
                    &noisy,
                    &mut |m| Activation::Rank4(micro(s, m, &device).0),
                    &mut |_, _| unreachable!("stage 0 computes no loss"),
                    MICRO,
                    &device,
                )
                .unwrap();
            assert!(out.peak_graphs <= 1);
            noisy = opt.step(0.05, noisy, out.grads);
        }
        let head = other.join().expect("stage 1 panicked");
        // Every micro-batch's forward ran twice (first pass, recomputation) on the same
        // input and drew the same mask both times; different micro-batches drew differently.
        let draws = draws.lock().unwrap().clone();
        assert_eq!(draws.len(), 2 * STEPS * MICRO);
        let mut firsts: Vec<(Vec<f32>, Vec<f32>)> = Vec::new();
        for (key, mask) in draws {
            match firsts.iter().position(|(k, _)| *k == key) {
                Some(i) => {
                    let (_, first) = firsts.remove(i);
                    assert_eq!(
                        first, mask,
                        "{schedule:?}: the recomputation drew another mask"
                    );
                }
                None => firsts.push((key, mask)),
            }
        }
        assert!(
            firsts.is_empty(),
            "{schedule:?}: a forward was not recomputed"
        );
        results.push((module_values(&noisy), head));
    }
    // The seeds go with the micro-batches, not with the order of the operations.
    assert_eq!(results[0], results[1]);
}

#[test]
fn recomputed_gradients_in_one_process_equal_one_backward_through_the_chain() {
    let _random = random_lock();
    let device = Device::flex().autodiff();
    for convs in [1, 2, 3] {
        let model = parts(convs, &device);
        let _ = model.iter().map(module_values).count();
        let (x, y) = micro(0, 0, &device);
        // Reference: one graph over the whole chain.
        let mut a = Activation::Rank4(x.clone());
        for part in &model {
            a = part.apply(a).unwrap();
        }
        let whole =
            GradientsParams::from_grads(mse(a.rank2("out").unwrap(), y.clone()).backward(), &model);
        let mut plain = SgdConfig::new().init();
        let expected = module_values(&plain.step(0.5, model.clone(), whole));
        // Recomputed: one segment's graph at a time.
        let mut seen = None;
        let grads = burn_dist::pipeline::recomputed_gradients(
            &model,
            Activation::Rank4(x),
            &mut |out| {
                let out = out.rank2("out")?;
                seen = Some(out.dims());
                Ok(mse(out, y.clone()))
            },
            &device,
        )
        .unwrap();
        assert_eq!(seen, Some([MB, 3]));
        assert_eq!(grads.len(), model.len());
        let mut got = Vec::new();
        for (part, g) in model.iter().zip(grads) {
            let mut plain = SgdConfig::new().init();
            got.extend(module_values(&plain.step(0.5, part.clone(), g)));
        }
        assert_eq!(got.len(), expected.len());
        assert_ne!(
            got,
            model.iter().flat_map(module_values).collect::<Vec<_>>()
        );
        for (a, b) in got.iter().flatten().zip(expected.iter().flatten()) {
            assert!((a - b).abs() <= 1e-6, "{convs} convolutions: {a} vs {b}");
        }
    }
}
