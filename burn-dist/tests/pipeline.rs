//! Pipeline parallelism equals the unsplit model: a small CNN split into 2 and 3 stages (ranks
//! as threads over the in-memory transport), GPipe and 1F1B, 4 micro-batches per step; after 3
//! SGD-momentum steps every stage's weights equal the unsplit model's under gradient
//! accumulation over the same micro-batches (1e-5). Once more over a QUIC job (TLS, threads as
//! ranks). 2D: 2 stages x 2 replicas, each stage's replicas averaging its gradients with the
//! allreduce of their group, equal one process on the whole batch. A segmented backward equals
//! one backward, and the exchange overlapped with it equals the exchange after it.

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

/// Held by every test for its whole run: the backend's random stream is the process's (and
/// parameters initialise lazily, at their first forward), and the recomputation test reseeds
/// it and must see only its own draws.
static RANDOM: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn random_lock() -> std::sync::MutexGuard<'static, ()> {
    RANDOM.lock().unwrap_or_else(|e| e.into_inner())
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
#[derive(Module, Debug)]
struct Noisy {
    conv: Conv2d,
    #[module(skip)]
    draws: Arc<std::sync::Mutex<Vec<(Vec<f32>, Vec<f32>)>>>,
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

/// Each parameter's gradient in `grads`, in `model`'s visiting order (empty where it has none).
fn grad_values<M: Module>(model: &M, grads: &GradientsParams) -> Vec<Vec<f32>> {
    struct Read<'a>(&'a GradientsParams, Vec<Vec<f32>>);
    impl burn::module::ModuleVisitor for Read<'_> {
        fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<D>>) {
            let v = self
                .0
                .get::<D>(p.id)
                .map(|g| g.into_data().convert::<f32>().try_to_vec::<f32>().unwrap())
                .unwrap_or_default();
            self.1.push(v);
        }
    }
    let mut r = Read(grads, Vec::new());
    model.visit(&mut r);
    r.1
}

fn assert_close(what: &str, a: &[Vec<f32>], b: &[Vec<f32>], tol: f32) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.len(), y.len(), "{what}: tensor {i}");
        for (u, v) in x.iter().zip(y) {
            assert!(
                (u - v).abs() <= tol * (1.0 + v.abs()),
                "{what}: tensor {i}: {u} against {v}"
            );
        }
    }
}

/// One backward through the whole chain: the reference for the segmented ones.
fn whole_backward(model: &[Part], x: Tensor<4>, y: Tensor<2>) -> GradientsParams {
    let mut a = Activation::Rank4(x);
    for part in model {
        a = part.apply(a).unwrap();
    }
    let grads = mse(a.rank2("out").unwrap(), y).backward();
    GradientsParams::from_grads(grads, &model.to_vec())
}

/// The segmented backward with `done` on each segment; the segments' gradients merged.
/// The loss is multiplied by `factor` (as fp16's loss scaling does).
fn segmented(
    model: &[Part],
    x: Tensor<4>,
    y: Tensor<2>,
    factor: f32,
    done: &mut burn_dist::pipeline::SegmentDone<'_, Part>,
) -> GradientsParams {
    let parts = burn_dist::pipeline::segmented_gradients(
        model,
        Activation::Rank4(x),
        &mut |out| Ok(mse(out.rank2("out")?, y.clone()).mul_scalar(factor)),
        done,
    )
    .unwrap();
    assert_eq!(parts.len(), model.len());
    let whole = model.to_vec();
    let mut acc = GradientsAccumulator::<Vec<Part>>::new();
    for g in parts {
        acc.accumulate(&whole, g);
    }
    acc.grads()
}

#[test]
fn a_segmented_backward_equals_one_backward_and_hands_out_the_last_segment_first() {
    let _random = random_lock();
    let device = Device::flex().autodiff();
    for convs in [1, 3] {
        let model = parts(convs, &device);
        let (x, y) = micro(0, 0, &device);
        let want = grad_values(
            &model.to_vec(),
            &whole_backward(&model, x.clone(), y.clone()),
        );
        let mut order = Vec::new();
        let got = segmented(&model, x, y, 1.0, &mut |k, _, g| {
            order.push(k);
            Ok(g)
        });
        assert_close(
            "segmented",
            &grad_values(&model.to_vec(), &got),
            &want,
            1e-6,
        );
        assert!(want.iter().all(|g| !g.is_empty()));
        assert_eq!(order, (0..=convs).rev().collect::<Vec<_>>());
    }
    // A frozen first segment: no gradient for it, the others' unchanged, and nothing is
    // differentiated through it.
    let mut model = parts(2, &device);
    model[0] = model[0].clone().no_grad();
    let (x, y) = micro(1, 0, &device);
    let want = grad_values(
        &model.to_vec(),
        &whole_backward(&model, x.clone(), y.clone()),
    );
    let got = grad_values(
        &model.to_vec(),
        &segmented(&model, x, y, 1.0, &mut |_, _, g| Ok(g)),
    );
    assert!(want[0].is_empty() && got[0].is_empty(), "{:?}", got[0]);
    assert_close("frozen first", &got, &want, 1e-6);
}

#[test]
fn an_overlapped_exchange_equals_the_exchange_after_the_backward() {
    let _random = random_lock();
    let device = Device::flex().autodiff();
    // Every rank the same weights in parameters of its own: ranks as threads must not share
    // parameter tensors, or Burn's autodiff joins their graphs (and its graph locks deadlock
    // between a forward and a backward on two threads).
    let weights: Vec<Vec<Vec<f32>>> = parts(3, &device).iter().map(module_values).collect();
    let world = 3;
    let (tx, rx) = std::sync::mpsc::channel();
    for (r, t) in MemoryTransport::mesh(world).into_iter().enumerate() {
        let model: Vec<Part> = parts(3, &device)
            .into_iter()
            .zip(weights.clone())
            .map(|(p, w)| burn_dist::ddp::with_module_values(p, w).unwrap())
            .collect();
        let (tx, device) = (tx.clone(), device.clone());
        std::thread::spawn(move || {
            let comm =
                Arc::new(Communicator::new(Arc::new(t)).with_timeout(Duration::from_secs(30)));
            let whole = model.to_vec();
            let mut out = Vec::new();
            // Buckets of one tensor, of a few, of everything; then a weighted sum with an
            // fp16-style unscaling of what is handed over.
            for (bucket, op, weight, unscale) in [
                (4usize, burn_dist::ReduceOp::Mean, 1.0f32, None),
                (600, burn_dist::ReduceOp::Mean, 1.0, None),
                (1 << 20, burn_dist::ReduceOp::Mean, 1.0, None),
                (
                    600,
                    burn_dist::ReduceOp::Sum,
                    0.25 * (r + 1) as f32,
                    Some(8.0f32),
                ),
            ] {
                let (x, y) = micro(2, r, &device);
                // The reference: one backward, then the exchange in module order.
                let mut want = whole_backward(&model, x.clone(), y.clone());
                let scale = (op == burn_dist::ReduceOp::Sum).then_some(weight);
                match scale {
                    None => allreduce_grads(&whole, &mut want, &comm, bucket).unwrap(),
                    Some(w) => burn_dist::ddp::allreduce_grads_scaled(
                        &whole,
                        &mut want,
                        &comm,
                        bucket,
                        w,
                        burn_dist::Compression::None,
                    )
                    .unwrap(),
                }
                let step = burn_dist::overlap::OverlappedStep::begin(
                    comm.clone(),
                    bucket,
                    op,
                    burn_dist::Compression::None,
                    weight,
                )
                .unwrap();
                assert!(burn_dist::overlap::handing_over());
                let factor = unscale.unwrap_or(1.0);
                if let Some(s) = unscale {
                    burn_dist::overlap::unscale_by(s);
                }
                let mut handed = 0;
                let mut got = segmented(&model, x, y, factor, &mut |_, seg, g| {
                    handed += 1;
                    Ok(burn_dist::overlap::hand_over(seg, g))
                });
                // Everything was handed over: nothing is left for after the backward.
                assert!(grad_values(&whole, &got).iter().all(Vec::is_empty));
                assert_eq!(handed, 4);
                let n = step.finish(&whole, &mut got).unwrap();
                assert!(!burn_dist::overlap::handing_over());
                assert_eq!(n, 8, "two tensors per segment");
                out.push((grad_values(&whole, &want), grad_values(&whole, &got)));
            }
            let _ = tx.send((r, out));
        });
    }
    drop(tx);
    let mut seen = 0;
    while let Ok((r, out)) = rx.recv_timeout(Duration::from_secs(120)) {
        for (i, (want, got)) in out.iter().enumerate() {
            // Case 3's loss is scaled by 8 and its handed-over gradients unscaled by 8.
            assert_close(&format!("rank {r}, case {i}"), got, want, 1e-5);
        }
        seen += 1;
    }
    assert_eq!(seen, world, "a rank failed or hung");
}
