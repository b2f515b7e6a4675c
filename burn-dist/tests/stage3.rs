//! ZeRO stage 3 on the segmented backward's small CNN (`common::cnn`): each unit gathered for
//! its passes equals stage 2, and a run from the root's values never initialises the other
//! ranks' models. Ranks as threads over the in-memory transport.

mod common;

use std::sync::Arc;
use std::time::Duration;

use burn::module::Module;
use burn::optim::GradientsAccumulator;
use burn::prelude::*;
use burn_dist::Communicator;
use burn_dist::ddp::module_values;
use burn_dist::pipeline::Activation;
use burn_dist::transport::memory::MemoryTransport;
use common::cnn::{Part, assert_close, micro, mse, parts, random_lock, whole_backward};

/// ZeRO stage 3 on a model of units: the parameters held as each rank's segments, each unit
/// gathered before its forward (and again before its recomputed backward), every gradient
/// reduced during the backward, on the step's thread or (overlapped) on a thread of its own
/// while the gathers go over a sibling communicator; against stage 2 (itself tested equal to
/// plain data parallel) from the same weights and batches.
#[test]
fn zero_stage_3_gathers_each_unit_for_its_passes_and_equals_stage_2() {
    let _random = random_lock();
    let device = Device::flex().autodiff();
    // Seeded: the check below that the steps moved every tensor depends on the draw (a bias
    // whose gradient changes sign between steps moves by less than Adam's 0.01 a step).
    device.seed(11);
    let weights: Vec<Vec<Vec<f32>>> = parts(3, &device).iter().map(module_values).collect();
    let fresh = || -> Vec<Part> {
        parts(3, &device)
            .into_iter()
            .zip(weights.clone())
            .map(|(p, w)| burn_dist::ddp::with_module_values(p, w).unwrap())
            .collect()
    };
    for world in [2, 3] {
        let (tx, rx) = std::sync::mpsc::channel();
        for (r, t) in MemoryTransport::mesh(world).into_iter().enumerate() {
            let models = [fresh(), fresh(), fresh(), fresh(), fresh()];
            let (tx, device) = (tx.clone(), device.clone());
            std::thread::spawn(move || {
                let comm =
                    Arc::new(Communicator::new(Arc::new(t)).with_timeout(Duration::from_secs(30)));
                let beside = Arc::new(comm.sibling(burn_dist::wire::Kind::Gather));
                let [reference, models @ ..] = models;
                let want = stage_2_steps(reference, &comm, &device);
                let got = [
                    (true, None),
                    (false, None),
                    (true, Some(&beside)),
                    (false, Some(&beside)),
                ]
                .into_iter()
                .zip(models)
                .map(|((recompute, beside), m)| stage_3_steps(m, recompute, beside, &comm, &device))
                .collect::<Vec<_>>();
                let _ = tx.send((r, want, got));
            });
        }
        drop(tx);
        let mut seen = 0;
        while let Ok((r, want, got)) = rx.recv_timeout(Duration::from_secs(120)) {
            // The steps moved every tensor (Adam at 0.01: by up to 0.01 a value per step; less
            // where a gradient changes sign between steps, as a conv's bias's can).
            let start: Vec<Vec<f32>> = weights.concat();
            for (i, (w, s)) in want.iter().zip(&start).enumerate() {
                let moved = w
                    .iter()
                    .zip(s)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f32::max);
                assert!(moved > 5e-3, "rank {r}: tensor {i} moved by {moved}");
            }
            assert_eq!(got.len(), 4);
            let cases = [
                "recomputed",
                "segmented",
                "recomputed, overlapped",
                "segmented, overlapped",
            ];
            for (case, g) in cases.iter().zip(&got) {
                assert_close(&format!("world {world}, rank {r}, {case}"), g, &want, 1e-5);
            }
            seen += 1;
        }
        assert_eq!(seen, world, "a rank failed or hung");
    }
}

/// The sharded tests' optimizer (Adam) and buckets: 600 bytes, so the convolutions' weights
/// (108 and 144 values) have buckets of their own and the rest go in pairs (in stage 3, cut
/// at the units).
fn zero_optimizer(
    stage: burn_dist::zero::Stage,
    model: &[Part],
    comm: &Communicator,
) -> burn_dist::zero::ZeroOptimizer {
    let mut opt = burn_dist::flat::optim::ShardOptimizer::sgd(0.01, 0.0);
    opt.update = burn_dist::flat::optim::Update::adam();
    let names = burn_dist::flat::module::trainable_names(&model.to_vec());
    burn_dist::zero::ZeroOptimizer::new(stage, &names, opt, comm, 600).unwrap()
}

/// Rank `comm.rank()`'s three steps of ZeRO stage 2 on its micro-batches: the model's values.
fn stage_2_steps(model: Vec<Part>, comm: &Communicator, device: &Device) -> Vec<Vec<f32>> {
    let mut z = zero_optimizer(burn_dist::zero::Stage::Two, &model, comm);
    let mut m = model;
    for s in 0..3 {
        let (x, y) = micro(s, comm.rank(), device);
        let g = whole_backward(&m, x, y);
        let (next, stepped) =
            burn_dist::zero::module::sharded_step_owned(&mut z, m, g, comm, 0.01, &mut |f| f)
                .unwrap();
        assert!(stepped);
        m = next;
    }
    module_values(&m)
}

/// The same three steps in stage 3, each unit gathered for its passes, with or without
/// recomputation, the gradients reduced inline or (with `beside`: overlapped) on a thread
/// while the units are gathered over `beside`: the model's values, gathered at the end.
fn stage_3_steps(
    model: Vec<Part>,
    recompute: bool,
    beside: Option<&Arc<Communicator>>,
    comm: &Arc<Communicator>,
    device: &Device,
) -> Vec<Vec<f32>> {
    use burn_dist::flat::module::trainable_names;
    use burn_dist::zero::module::{shard_params, sharded_step_reduced};
    let counts: Vec<usize> = model.iter().map(|p| trainable_names(p).len()).collect();
    let mut z = zero_optimizer(burn_dist::zero::Stage::Three, &model, comm)
        .cut_at_units(&counts)
        .unwrap();
    let total = z.total();
    let (mut skeleton, sharded) = shard_params(&mut z, model).unwrap();
    // A unit that is not the model's is refused by name.
    let other = parts(1, device);
    let e = sharded.gather(&z, comm, &other[0]).unwrap_err().to_string();
    assert!(e.contains("not one of the sharded model's"), "{e}");
    // 1/N of the values, give or take one per bucket (8 buckets).
    assert!(
        z.params_len() <= total / comm.world() + 8,
        "{}",
        z.params_len()
    );
    for s in 0..3 {
        assert!(
            module_values(&skeleton).iter().all(Vec::is_empty),
            "the module holds no values between steps"
        );
        let (x, y) = micro(s, comm.rank(), device);
        use burn_dist::overlap::OverlappedStep;
        // Reductions beside the gathers on the gathers' own communicator: refused.
        let e = OverlappedStep::begin_sharded_beside(comm.clone(), comm, &z, &skeleton, 1.0)
            .err()
            .expect("one communicator for both")
            .to_string();
        assert!(
            e.contains("both communicators are of kind Collective"),
            "{e}"
        );
        let step = match beside {
            Some(b) => OverlappedStep::begin_sharded_beside(comm.clone(), b, &z, &skeleton, 1.0),
            None => OverlappedStep::begin_sharded(comm.clone(), &z, &skeleton, 1.0),
        }
        .unwrap();
        let gather_comm: &Communicator = beside.map_or(comm, |b| b);
        let mut gathers = Vec::new();
        let grads = {
            let mut gather = |k: usize, unit: &Part| {
                gathers.push(k);
                sharded.gather(&z, gather_comm, unit)
            };
            let mut loss = |out: Activation| Ok(mse(out.rank2("out")?, y.clone()));
            let mut done = |_: usize, seg: &Part, g| Ok(burn_dist::overlap::hand_over(seg, g));
            let x = Activation::Rank4(x);
            if recompute {
                burn_dist::pipeline::recomputed_gradients_gathered(
                    &skeleton,
                    &mut gather,
                    x,
                    &mut loss,
                    device,
                    &mut done,
                )
            } else {
                burn_dist::pipeline::segmented_gradients_gathered(
                    &skeleton,
                    &mut gather,
                    x,
                    &mut loss,
                    &mut done,
                )
            }
            .unwrap()
        };
        // Recomputation: the first three units without a graph, the head with it, then the
        // three again from the last; else each unit once.
        let want: Vec<usize> = if recompute {
            vec![0, 1, 2, 3, 2, 1, 0]
        } else {
            vec![0, 1, 2, 3]
        };
        assert_eq!(gathers, want);
        let mut acc = GradientsAccumulator::<Vec<Part>>::new();
        for g in grads {
            acc.accumulate(&skeleton, g);
        }
        let mut rest = acc.grads();
        let (reduced, handed) = step.finish_sharded(&skeleton, &mut rest).unwrap();
        assert_eq!(handed, 8, "every tensor during the backward");
        let (m, stepped) =
            sharded_step_reduced(&mut z, skeleton, reduced, comm, 0.01, &mut |f| f).unwrap();
        assert!(stepped);
        skeleton = m;
    }
    module_values(&sharded.gather(&z, comm, &skeleton).unwrap())
}

/// Each float tensor of a module (parameters and buffers): `None` while Burn has not
/// initialised it, else its number of values.
type States = Vec<Option<usize>>;

/// [`States`] of `model`.
fn initialised<M: Module>(model: &M) -> States {
    struct States(Vec<Option<usize>>);
    impl burn::module::ModuleVisitor for States {
        fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<D>>) {
            let made = p.is_initialized();
            self.0.push(made.then(|| p.val().shape().num_elements()));
        }
    }
    let mut v = States(Vec::new());
    model.visit(&mut v);
    v.0
}

/// ZeRO stage 3 from the root's values (`shard_params_from`): a rank other than the root may
/// build its model without values (Burn's lazy parameters, as Hearth's do) and never makes
/// them (its skeleton holds empty tensors, nothing initialised), and the root's lazy model,
/// seeded, is drawn as its buckets are handed out, in the model's order: each unit every rank
/// gathers then holds the values an eager initialisation from the same seed makes.
#[test]
fn stage_3_from_the_roots_values_never_initialises_the_other_ranks_models() {
    let _random = random_lock();
    let device = Device::flex().autodiff();
    // The values a seeded model takes when read whole, in its visiting order.
    device.seed(5);
    let want: Vec<Vec<f32>> = parts(3, &device).iter().flat_map(module_values).collect();
    device.seed(5);
    let mut root_model = Some(parts(3, &device));
    let (tx, rx) = std::sync::mpsc::channel();
    for (r, t) in MemoryTransport::mesh(3).into_iter().enumerate() {
        // The root's model drawn as it is read (the test holds the random stream); the others'
        // never.
        let model = match r {
            0 => root_model.take().expect("one root"),
            _ => parts(3, &device),
        };
        assert!(initialised(&model).iter().all(Option::is_none));
        let tx = tx.clone();
        std::thread::spawn(move || {
            let comm =
                Arc::new(Communicator::new(Arc::new(t)).with_timeout(Duration::from_secs(30)));
            let run = || -> burn_dist::Result<(States, Vec<Vec<f32>>)> {
                use burn_dist::flat::module::trainable_names;
                let counts: Vec<usize> = model.iter().map(|p| trainable_names(p).len()).collect();
                let mut z = zero_optimizer(burn_dist::zero::Stage::Three, &model, &comm)
                    .cut_at_units(&counts)?;
                // A clone shares each lazy parameter's state: it sees any initialisation.
                let witness = model.clone();
                let (skeleton, sharded) =
                    burn_dist::zero::module::shard_params_from(&mut z, &comm, 0, model, None)?;
                let mut states = initialised(&skeleton);
                if comm.rank() != 0 {
                    states.extend(initialised(&witness));
                }
                let mut values = Vec::new();
                for unit in &skeleton {
                    values.extend(module_values(&sharded.gather(&z, &comm, unit)?));
                }
                Ok((states, values))
            };
            let _ = tx.send((r, run()));
        });
    }
    drop(tx);
    let mut seen = 0;
    while let Ok((r, got)) = rx.recv_timeout(Duration::from_secs(60)) {
        let (states, values) = got.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        // Three convolutions and the head, a weight and a bias each: all empty, none lazy;
        // beside them on the other ranks the model as built, still lazy.
        let mut lazy = vec![Some(0); 8];
        if r != 0 {
            lazy.extend([None; 8]);
        }
        assert_eq!(states, lazy, "rank {r}'s skeleton");
        assert_eq!(
            values, want,
            "rank {r}'s gathered units hold the seeded values"
        );
        seen += 1;
    }
    assert_eq!(seen, 3, "a rank failed or hung");
}
