//! Data-parallel equivalence: k SGD steps on N ranks with batch b each end with the same weights
//! (1e-5) as one rank with batch N*b. A model without batch norm; ranks are threads over the
//! in-memory transport.

use std::sync::Arc;
use std::time::Duration;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{GradientsParams, SgdConfig};
use burn::prelude::*;
use burn::tensor::TensorData;
use burn_dist::ddp::{allreduce_grads, broadcast_module, module_values, with_module_values};
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
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.b.forward(self.act.forward(self.a.forward(x)))
    }
}

const STEPS: usize = 5;
const B: usize = 4;

/// Sample `i` of step `s`: deterministic inputs and targets.
fn sample(s: usize, i: usize) -> (Vec<f32>, Vec<f32>) {
    let x = (0..6)
        .map(|j| (((s * 131 + i * 17 + j * 7) % 23) as f32 - 11.0) / 7.0)
        .collect();
    let y = (0..3)
        .map(|j| (((s * 31 + i * 5 + j * 3) % 11) as f32 - 5.0) / 5.0)
        .collect();
    (x, y)
}

fn batch(s: usize, range: std::ops::Range<usize>, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let n = range.len();
    let (mut xs, mut ys) = (Vec::new(), Vec::new());
    for i in range {
        let (x, y) = sample(s, i);
        xs.extend(x);
        ys.extend(y);
    }
    (
        Tensor::from_data(TensorData::new(xs, [n, 6]), device),
        Tensor::from_data(TensorData::new(ys, [n, 3]), device),
    )
}

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
        let (tx, rx) = std::sync::mpsc::channel();
        for t in MemoryTransport::mesh(world) {
            // Ranks start from different weights: the broadcast must fix that.
            let start = if t.rank() == 0 {
                initial.clone()
            } else {
                module_values(&Mlp::new(&device))
            };
            let tx = tx.clone();
            std::thread::spawn(move || {
                let r = t.rank();
                let comm = Communicator::new(Arc::new(t))
                    .with_chunk_elems(7)
                    .with_timeout(Duration::from_secs(20));
                let out = train(start, Some(&comm), |_| r * B..(r + 1) * B);
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
                        "world {world} rank {r}: {x} vs {y} (1 rank, batch {})",
                        world * B
                    );
                }
            }
        }
    }
}
