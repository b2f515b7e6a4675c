//! Elastic training's arithmetic: workers with uneven shares of a fixed global batch (as a slow
//! CPU worker and a fast GPU worker would get with throughput balancing) average their
//! gradients weighted by their sample counts, and so train exactly like one process on the
//! whole global batch (1e-5, no batch norm).

mod common;

use burn::optim::momentum::MomentumConfig;
use burn::optim::{GradientsParams, ModuleOptimizer, SgdConfig};
use burn::prelude::*;
use burn_dist::ddp::{
    allreduce_grads_weighted, broadcast_module, module_values, with_module_values,
};
use burn_dist::elastic::{offsets, shares};
use common::{Mlp, assert_close, batch, run_ranks};

const GLOBAL: usize = 12;
const STEPS: usize = 3;

fn mse(out: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
    (out - y).powi_scalar(2).mean()
}

fn sgd() -> ModuleOptimizer {
    SgdConfig::new()
        .with_momentum(Some(
            MomentumConfig::new().with_momentum(0.9).with_dampening(0.0),
        ))
        .init()
}

#[test]
fn uneven_shares_weighted_by_samples_equal_one_process_on_the_global_batch() {
    let device = Device::flex().autodiff();
    let initial = module_values(&Mlp::new(&device));

    // One process, the whole global batch every step.
    let mut model = with_module_values(Mlp::new(&device), initial.clone()).unwrap();
    let mut opt = sgd();
    for s in 0..STEPS {
        let (x, y) = batch(s, 0..GLOBAL, &device);
        let grads = GradientsParams::from_grads(mse(model.forward(x), y).backward(), &model);
        model = opt.step(0.05, model, grads);
    }
    let reference = module_values(&model);
    assert_ne!(reference, initial, "training moved the weights");

    // Three workers, one measured 5 times as fast as the others: 8, 2 and 2 samples a step.
    let weights = [5.0, 1.0, 1.0];
    let split = shares(GLOBAL, &weights).unwrap();
    assert_eq!(split, vec![8, 2, 2]);
    let starts = offsets(&split);
    let results = run_ranks(3, &initial, move |start, comm, rank| {
        let device = Device::flex().autodiff();
        let model = with_module_values(Mlp::new(&device), start).unwrap();
        let mut model = broadcast_module(model, &comm).unwrap();
        let mut opt = sgd();
        let mine = starts[rank]..starts[rank] + split[rank];
        for s in 0..STEPS {
            let (x, y) = batch(s, mine.clone(), &device);
            let loss = mse(model.forward(x), y);
            let mut grads = GradientsParams::from_grads(loss.backward(), &model);
            allreduce_grads_weighted(&model, &mut grads, &comm, 1 << 20, mine.len()).unwrap();
            model = opt.step(0.05, model, grads);
        }
        module_values(&model)
    });
    for (rank, weights) in results {
        assert_close(&weights, &reference, &format!("rank {rank}"));
    }
}

// ---- a run whose membership changes: a worker killed mid-step, then one joining ------------

use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::optim::OptimizerRecord;
use burn::store::ModuleRecord;
use burn::tensor::Bytes;
use burn_dist::elastic::broadcast_bytes;
use burn_dist::elastic::membership::{Decision, Limits, Membership, Worker};
use burn_dist::transport::memory::MemoryTransport;
use burn_dist::{Communicator, Transport};

/// What a worker commits after every step and what a new epoch starts from.
#[derive(Clone)]
struct Committed {
    step: usize,
    module: Vec<u8>,
    optim: Vec<u8>,
}

fn commit(step: usize, model: &Mlp, opt: &ModuleOptimizer) -> Committed {
    Committed {
        step,
        module: model.clone().into_record().into_bytes().unwrap().to_vec(),
        optim: opt.to_record().into_bytes().unwrap().to_vec(),
    }
}

/// The state as values that compare exactly: the weights after one more fixed step, which
/// depend on the weights and on the momentum (the records' bytes list tensors in no fixed
/// order).
fn fingerprint(c: &Committed) -> Vec<Vec<f32>> {
    let device = Device::flex().autodiff();
    let (model, mut opt) = restore(c, &device);
    let (x, y) = batch(99, 0..GLOBAL, &device);
    let grads = GradientsParams::from_grads(mse(model.forward(x), y).backward(), &model);
    module_values(&opt.step(0.05, model, grads))
}

fn restore(c: &Committed, device: &Device) -> (Mlp, ModuleOptimizer) {
    let module = ModuleRecord::from_bytes(Bytes::from_bytes_vec(c.module.clone())).unwrap();
    let optim = OptimizerRecord::from_bytes(Bytes::from_bytes_vec(c.optim.clone())).unwrap();
    (
        Mlp::new(device).load_record(module),
        sgd().load_record(optim),
    )
}

/// One epoch of membership: every member starts from rank 0's committed state (joiners have
/// none), runs steps until `end` with even shares of the global batch, committing after each.
/// `die` = (rank, step): that worker dies inside that step's allreduce. Each member's last
/// commit and the error that ended its epoch, if any.
fn run_epoch(
    members: usize,
    start: Committed,
    end: usize,
    die: Option<(usize, usize)>,
) -> Vec<(Committed, Option<String>)> {
    let split = shares(GLOBAL, &vec![1.0; members]).unwrap();
    let starts = offsets(&split);
    let (tx, rx) = std::sync::mpsc::channel();
    for t in MemoryTransport::mesh(members) {
        let (tx, start, split, starts) = (tx.clone(), start.clone(), split.clone(), starts.clone());
        std::thread::spawn(move || {
            let rank = t.rank();
            let t = Arc::new(t);
            let comm = Communicator::new(t.clone()).with_timeout(Duration::from_secs(20));
            let device = Device::flex().autodiff();
            // The new epoch starts from rank 0's committed state, joiners included.
            let state = |c: &Committed| -> Result<Committed, String> {
                let module =
                    broadcast_bytes(&comm, c.module.clone(), 1 << 30).map_err(|e| e.to_string())?;
                let optim =
                    broadcast_bytes(&comm, c.optim.clone(), 1 << 30).map_err(|e| e.to_string())?;
                Ok(Committed {
                    step: c.step,
                    module,
                    optim,
                })
            };
            let mut committed = match state(&start) {
                Ok(c) => c,
                Err(e) => {
                    let _ = tx.send((rank, start, Some(e)));
                    return;
                }
            };
            let (mut model, mut opt) = restore(&committed, &device);
            let mine = starts[rank]..starts[rank] + split[rank];
            for s in committed.step..end {
                let (x, y) = batch(s, mine.clone(), &device);
                let mut grads =
                    GradientsParams::from_grads(mse(model.forward(x), y).backward(), &model);
                if die == Some((rank, s)) {
                    t.kill("killed mid-allreduce");
                    return;
                }
                if let Err(e) =
                    allreduce_grads_weighted(&model, &mut grads, &comm, 1 << 20, mine.len())
                {
                    // The step is abandoned: nothing of it is applied; the caller rolls back to
                    // the last commit.
                    let _ = tx.send((rank, committed, Some(e.to_string())));
                    return;
                }
                model = opt.step(0.05, model, grads);
                committed = commit(s + 1, &model, &opt);
            }
            let _ = tx.send((rank, committed, None));
        });
    }
    drop(tx);
    let mut out: Vec<Option<(Committed, Option<String>)>> = vec![None; members];
    let alive = members - usize::from(die.is_some());
    for _ in 0..alive {
        let (rank, c, e) = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("a worker hung");
        out[rank] = Some((c, e));
    }
    out.into_iter().flatten().collect()
}

#[test]
fn a_worker_killed_mid_step_is_rolled_back_and_a_joiner_catches_up_exactly() {
    const END: usize = 6;
    let device = Device::flex().autodiff();
    let first = Mlp::new(&device);
    let initial = module_values(&first);
    let mut start = commit(0, &first, &sgd());

    // The same global batches on one process.
    let mut model = with_module_values(Mlp::new(&device), initial).unwrap();
    let mut opt = sgd();
    for s in 0..END {
        let (x, y) = batch(s, 0..GLOBAL, &device);
        let grads = GradientsParams::from_grads(mse(model.forward(x), y).backward(), &model);
        model = opt.step(0.05, model, grads);
    }
    let reference = module_values(&model);

    let worker = |id: &str| Worker {
        id: id.into(),
        host: id.into(),
    };
    let t = Instant::now();
    let mut membership = Membership::new(
        Limits {
            min: 2,
            max: 4,
            ..Limits::default()
        },
        vec![worker("w0"), worker("w1"), worker("w2")],
    );

    // Epoch 0: w2 dies inside step 2's allreduce; the survivors abandon the step they were in.
    // A collective is not atomic: a survivor still waiting for step 1's last message when the
    // loss is announced abandons step 1, while the other may have finished it. So each holds
    // its own last commit (step 1 or 2), and the next epoch starts from its rank 0's.
    let survivors = run_epoch(3, start.clone(), END, Some((2, 2)));
    assert_eq!(survivors.len(), 2);
    for (c, e) in &survivors {
        assert!(
            c.step == 1 || c.step == 2,
            "rolled back to a commit: {}",
            c.step
        );
        let e = e.as_deref().expect("the survivors' step failed");
        assert!(e.contains("rank 2"), "the error names the dead worker: {e}");
    }
    membership.lost("w2", t);
    let Decision::Change { epoch, .. } = membership.decide(t) else {
        panic!("expected a new epoch")
    };
    assert_eq!(epoch.members.len(), 2);

    // Epoch 1: two workers start from w0's commit (the new rank 0's), redo what was abandoned
    // and go on to step 4; then w3 asks to join.
    start = survivors[0].0.clone();
    let after = run_epoch(2, start, 4, None);
    assert!(after.iter().all(|(c, e)| c.step == 4 && e.is_none()));
    assert!(
        fingerprint(&after[0].0) == fingerprint(&after[1].0),
        "the survivors hold identical state again"
    );
    membership.hello(worker("w3"), t).unwrap();
    let Decision::Change { epoch, joined, .. } = membership.decide(t) else {
        panic!("expected a new epoch")
    };
    assert_eq!(joined.len(), 1);

    // Epoch 2: three workers, the joiner receiving the committed state from rank 0.
    let done = run_epoch(epoch.members.len(), after[0].0.clone(), END, None);
    assert_eq!(done.len(), 3);
    let first = fingerprint(&done[0].0);
    for (c, e) in &done {
        assert!(e.is_none(), "{e:?}");
        assert_eq!(c.step, END);
        assert!(
            fingerprint(c) == first,
            "every worker holds bit-identical state"
        );
    }
    let (model, _) = restore(&done[0].0, &device);
    assert_close(
        &module_values(&model),
        &reference,
        "elastic run vs one process",
    );
}

// ---- the world re-formed over QUIC: after a loss, then for a joiner -------------------------

#[test]
fn a_world_re_forms_over_quic_after_a_loss_and_again_for_a_joiner() {
    use burn_dist::ReduceOp;
    use burn_dist::elastic::reform::Announcement;
    use burn_dist::rendezvous::{RankInfo, connect_epoch};
    use burn_dist::tls;

    let at = |rank: usize, world: usize, coordinator: &str| RankInfo {
        rank,
        world,
        local_rank: None,
        coordinator: coordinator.to_string(),
        source: "test",
    };
    let join = move |rank: usize, a: &Announcement| {
        connect_epoch(
            &at(rank, a.members.len(), &a.coordinator),
            &tls::Membership::secret(common::SECRET, common::JOB).unwrap(),
            &common::options(Duration::from_secs(30)),
            a.epoch,
        )
        .expect("rendezvous of the new epoch")
    };
    let sum_of_ranks = |t: Arc<dyn Transport>| -> f32 {
        let comm = Communicator::new(t.clone()).with_timeout(Duration::from_secs(20));
        let mut v = [t.rank() as f32 + 1.0];
        comm.allreduce(&mut v, ReduceOp::Sum).expect("allreduce");
        v[0]
    };

    let (to_joiner, joiner_hears) = std::sync::mpsc::channel::<Announcement>();
    let joiner = std::thread::spawn(move || {
        let a = joiner_hears
            .recv_timeout(Duration::from_secs(60))
            .expect("the joiner heard of epoch 2");
        let rank = a
            .members
            .iter()
            .position(Option::is_none)
            .expect("a joiner's place");
        let t: Arc<dyn Transport> = Arc::new(join(rank, &a));
        (a.epoch, sum_of_ranks(t))
    });

    let (tx, rx) = std::sync::mpsc::channel();
    for t in common::job(3) {
        let (tx, to_joiner) = (tx.clone(), to_joiner.clone());
        std::thread::spawn(move || {
            let old = t.rank();
            let t: Arc<dyn Transport> = Arc::new(t);
            assert_eq!(sum_of_ranks(t.clone()), 6.0);
            if old == 2 {
                // Rank 2 goes away: its connections close.
                drop(t);
                let _ = tx.send((old, Vec::new()));
                return;
            }
            // The survivors' next collective fails; they go on without rank 2.
            let comm = Communicator::new(t.clone()).with_timeout(Duration::from_secs(5));
            let mut v = [1.0];
            let err = comm
                .allreduce(&mut v, ReduceOp::Sum)
                .unwrap_err()
                .to_string();
            if old == 0 {
                assert!(err.contains("rank 2"), "{err}");
            }
            t.accept_losses();
            let deadline = Instant::now() + Duration::from_secs(30);
            // Epoch 1, announced over the old world's surviving link by the lowest survivor.
            let a = if old == 0 {
                let a = Announcement {
                    epoch: 1,
                    coordinator: format!("127.0.0.1:{}", common::free_port()),
                    members: vec![Some(0), Some(1)],
                };
                a.announce(&*t).unwrap();
                a
            } else {
                Announcement::receive(&*t, 0, 1, deadline).unwrap()
            };
            let rank = a.rank_of(old).unwrap();
            let t1: Arc<dyn Transport> = Arc::new(join(rank, &a));
            drop(t);
            let mut sums = vec![sum_of_ranks(t1.clone())];
            // Epoch 2: a joiner, which hears of it outside the old world.
            let b = if rank == 0 {
                let b = Announcement {
                    epoch: 2,
                    coordinator: format!("127.0.0.1:{}", common::free_port()),
                    members: vec![Some(0), Some(1), None],
                };
                b.announce(&*t1).unwrap();
                to_joiner.send(b.clone()).unwrap();
                b
            } else {
                Announcement::receive(&*t1, 0, 2, deadline).unwrap()
            };
            let t2: Arc<dyn Transport> = Arc::new(join(b.rank_of(rank).unwrap(), &b));
            drop(t1);
            sums.push(sum_of_ranks(t2));
            let _ = tx.send((old, sums));
        });
    }
    drop(tx);
    for _ in 0..3 {
        let (old, sums) = rx
            .recv_timeout(Duration::from_secs(120))
            .expect("a worker hung");
        if old != 2 {
            assert_eq!(
                sums,
                vec![3.0, 6.0],
                "old rank {old}: epochs of 2 then 3 ranks"
            );
        }
    }
    let (epoch, sum) = joiner.join().expect("the joiner");
    assert_eq!((epoch, sum), (2, 6.0));
}
