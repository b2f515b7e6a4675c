//! Data-parallel equivalence: k SGD steps on N ranks with batch b each end with the same weights
//! (1e-5) as one rank with batch N*b. A model without batch norm; ranks are threads over the
//! in-memory transport.

mod common;

use burn::optim::momentum::MomentumConfig;
use burn::optim::{GradientsParams, SgdConfig};
use burn::prelude::*;
use burn_dist::Communicator;
use burn_dist::ddp::{allreduce_grads, broadcast_module, module_values, with_module_values};
use common::{Mlp, assert_close, batch, run_ranks};

const STEPS: usize = 5;
const B: usize = 4;

/// `STEPS` SGD-with-momentum steps of rank `rank` of `world` (batch `B` each; world 1 is the
/// reference with batch `B * per_rank_world`).
fn train(
    initial: Vec<Vec<f32>>,
    comm: Option<&Communicator>,
    range_of: impl Fn(usize) -> std::ops::Range<usize>,
) -> Vec<Vec<f32>> {
    let device = Device::flex().autodiff();
    let mut model = with_module_values(Mlp::new(&device), initial).unwrap();
    if let Some(c) = comm {
        model = broadcast_module(model, c).unwrap();
    }
    let mut optim = SgdConfig::new()
        .with_momentum(Some(
            MomentumConfig::new().with_momentum(0.9).with_dampening(0.0),
        ))
        .init();
    for s in 0..STEPS {
        let (x, y) = batch(s, range_of(s), &device);
        let loss = (model.forward(x) - y).powi_scalar(2).mean();
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        if let Some(c) = comm {
            // Tiny buckets, so several allreduces run per step.
            allreduce_grads(&model, &mut grads, c, 64).unwrap();
        }
        model = optim.step(0.05, model, grads);
    }
    module_values(&model)
}

#[test]
fn n_ranks_with_batch_b_match_one_rank_with_batch_n_b() {
    let device = Device::flex();
    let initial = module_values(&Mlp::new(&device));
    for world in [2usize, 4] {
        let reference = train(initial.clone(), None, |_| 0..world * B);
        let ranks = run_ranks(world, &initial, |start, comm, r| {
            train(start, Some(&comm), |_| r * B..(r + 1) * B)
        });
        for (r, weights) in ranks {
            let what = format!("world {world} rank {r} vs 1 rank with batch {}", world * B);
            assert_close(&weights, &reference, &what);
        }
    }
}
