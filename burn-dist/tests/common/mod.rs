//! What the data-parallel equivalence tests share: the model, deterministic samples, running N
//! ranks as threads over the in-memory transport, and the weight comparison.
#![allow(dead_code)]

pub mod cnn;
pub mod ps;

use std::process::Child;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::prelude::*;
use std::net::UdpSocket;

use burn_dist::ddp::module_values;
use burn_dist::rendezvous::{RankInfo, RendezvousOptions, connect};
use burn_dist::routed::RoutedTransport;
use burn_dist::tls::Membership;
use burn_dist::transport::memory::MemoryTransport;
use burn_dist::{Communicator, Transport};

/// A small MLP without batch norm (with it, ranks normalise by their own statistics and the
/// results differ from one process's, as in PyTorch DDP).
#[derive(Module, Debug)]
pub struct Mlp {
    pub a: Linear,
    pub b: Linear,
    pub act: Relu,
}

impl Mlp {
    pub fn new(device: &Device) -> Self {
        Self {
            a: LinearConfig::new(6, 16).init(device),
            b: LinearConfig::new(16, 3).init(device),
            act: Relu::new(),
        }
    }

    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.b.forward(self.act.forward(self.a.forward(x)))
    }
}

/// Sample `i` of step `s`: deterministic inputs and targets.
pub fn sample(s: usize, i: usize) -> (Vec<f32>, Vec<f32>) {
    let x = (0..6)
        .map(|j| (((s * 131 + i * 17 + j * 7) % 23) as f32 - 11.0) / 7.0)
        .collect();
    let y = (0..3)
        .map(|j| (((s * 31 + i * 5 + j * 3) % 11) as f32 - 5.0) / 5.0)
        .collect();
    (x, y)
}

/// Samples `range` of step `s` as an input and a target batch.
pub fn batch(s: usize, range: std::ops::Range<usize>, device: &Device) -> (Tensor<2>, Tensor<2>) {
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

/// Runs `train(start, comm, rank)` on `world` threads; rank 0 starts from `initial`, the others
/// from fresh weights (the strategy's broadcast must fix that). Each rank's result, with a
/// deadline so a hung rank fails the test.
pub fn run_ranks<F>(world: usize, initial: &[Vec<f32>], train: F) -> Vec<(usize, Vec<Vec<f32>>)>
where
    F: Fn(Vec<Vec<f32>>, Communicator, usize) -> Vec<Vec<f32>> + Send + Sync + 'static,
{
    let train = Arc::new(train);
    let device = Device::flex();
    let (tx, rx) = std::sync::mpsc::channel();
    for t in MemoryTransport::mesh(world) {
        let start = if t.rank() == 0 {
            initial.to_vec()
        } else {
            module_values(&Mlp::new(&device))
        };
        let (tx, train) = (tx.clone(), train.clone());
        std::thread::spawn(move || {
            let r = t.rank();
            let comm = Communicator::new(Arc::new(t))
                .with_chunk_elems(7)
                .with_timeout(Duration::from_secs(30));
            let _ = tx.send((r, train(start, comm, r)));
        });
    }
    drop(tx);
    (0..world)
        .map(|_| {
            rx.recv_timeout(Duration::from_secs(120))
                .expect("a rank hung or panicked")
        })
        .collect()
}

/// Every weight within 1e-5 of the reference.
pub fn assert_close(weights: &[Vec<f32>], reference: &[Vec<f32>], what: &str) {
    for (a, b) in weights.iter().zip(reference) {
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 1e-5, "{what}: {x} vs {y}");
        }
    }
}

// QUIC jobs on 127.0.0.1 with threads as ranks.

pub const SECRET: &str = "9c1e6bd2f04a7358e1c0b9d7a2f46e8b";
/// The job id that salts [`SECRET`]'s key.
pub const JOB: &str = "burn-dist-tests";

pub fn free_port() -> u16 {
    UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .map(|a| a.port())
        .expect("a free UDP port")
}

pub fn info(rank: usize, world: usize, port: u16) -> RankInfo {
    RankInfo {
        rank,
        world,
        local_rank: Some(rank),
        coordinator: format!("127.0.0.1:{port}"),
        source: "test",
    }
}

/// QUIC only: ranks of one host do not move to shared memory, so every byte takes the network
/// path these tests are about.
pub fn options(timeout: Duration) -> RendezvousOptions {
    RendezvousOptions {
        timeout,
        shm: burn_dist::shm::ShmOptions {
            enabled: false,
            ..Default::default()
        },
        ..Default::default()
    }
}

/// QUIC only, with three connections per pair of ranks.
pub fn options_lanes(timeout: Duration) -> RendezvousOptions {
    RendezvousOptions {
        quic: Some(burn_dist::transport::quic::QuicOptions {
            lanes: 3,
            ..burn_dist::transport::quic::QuicOptions::loopback()
        }),
        ..options(timeout)
    }
}

/// The default: ranks of one host talk through shared memory.
pub fn options_shm(timeout: Duration) -> RendezvousOptions {
    RendezvousOptions {
        timeout,
        ..Default::default()
    }
}

/// Forms a job of `world` ranks as threads, QUIC only; returns them in rank order.
pub fn job(world: usize) -> Vec<RoutedTransport> {
    job_with(world, options)
}

/// [`job`] with the rendezvous options `options` gives for a timeout.
pub fn job_with(world: usize, options: fn(Duration) -> RendezvousOptions) -> Vec<RoutedTransport> {
    let port = free_port();
    let handles: Vec<_> = (0..world)
        .map(|r| {
            std::thread::spawn(move || {
                connect(
                    &info(r, world, port),
                    &Membership::secret(SECRET, JOB).unwrap(),
                    &options(Duration::from_secs(30)),
                )
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rendezvous thread").expect("rendezvous"))
        .collect()
}

/// Waits for `child` up to `limit`, killing it past that; returns (exit ok, stdout+stderr).
pub fn finish(mut child: Child, limit: Duration) -> (bool, String) {
    let until = Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            _ if Instant::now() > until => {
                let _ = child.kill();
                break;
            }
            _ => std::thread::sleep(Duration::from_millis(50)),
        }
    }
    let out = child.wait_with_output().expect("child output");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}
