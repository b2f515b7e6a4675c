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
