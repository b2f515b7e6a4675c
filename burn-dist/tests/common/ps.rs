//! What the parameter-server tests share (`tests/ps.rs`, `tests/ps_faults.rs`): a linear
//! model's deterministic samples and gradient, and a job of servers and workers as threads over
//! the in-memory transport, every thread joined with a deadline.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use burn_dist::flat::layout::Layout;
use burn_dist::ps::client::{Client, PsWorker};
use burn_dist::ps::server::{ServerConfig, ServerReport, serve};
use burn_dist::transport::Transport;
use burn_dist::transport::memory::MemoryTransport;

pub const DIM: usize = 5;

/// Runs `f` on a thread and waits at most 60 s for it: a hang fails the test.
pub fn bounded<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> mpsc::Receiver<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx
}

pub fn get<T>(rx: mpsc::Receiver<T>, what: &str) -> T {
    rx.recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("{what} did not finish in 60 s"))
}

/// Worker `k`'s samples of y = 2·x_i·(i+1)/DIM − 0.5 with a deterministic spread, `4 + 2k` of them.
pub fn samples(k: usize) -> Vec<([f32; DIM], f32)> {
    (0..4 + 2 * k)
        .map(|j| {
            let x: [f32; DIM] =
                std::array::from_fn(|i| (((j * 7 + i * 3 + k * 5) % 11) as f32 - 5.0) / 5.0);
            let y = x
                .iter()
                .enumerate()
                .map(|(i, v)| 2.0 * v * (i + 1) as f32 / DIM as f32)
                .sum::<f32>()
                - 0.5;
            (x, y)
        })
        .collect()
}

/// Parameters: w (DIM values) then b; the mean-squared-error gradient over `data`.
pub fn grad(params: &[f32], data: &[([f32; DIM], f32)]) -> Vec<f32> {
    let mut g = vec![0f32; DIM + 1];
    for (x, y) in data {
        let pred: f32 = x.iter().zip(params).map(|(a, w)| a * w).sum::<f32>() + params[DIM];
        let e = pred - y;
        for i in 0..DIM {
            g[i] += e * x[i] / data.len() as f32;
        }
        g[DIM] += e / data.len() as f32;
    }
    g
}

pub fn loss(params: &[f32], workers: usize) -> f32 {
    let all: Vec<_> = (0..workers).flat_map(samples).collect();
    all.iter()
        .map(|(x, y)| {
            let pred: f32 = x.iter().zip(params).map(|(a, w)| a * w).sum::<f32>() + params[DIM];
            (pred - y).powi(2)
        })
        .sum::<f32>()
        / all.len() as f32
}

pub fn layout(servers: usize) -> Layout {
    Layout::new(&[("w".to_string(), DIM), ("b".to_string(), 1)], servers).unwrap()
}

/// `servers` server ranks (0..) and `workers` worker ranks after them, each worker taking
/// `steps` steps on its own samples (`delay` before each push for the workers named), and
/// every server's report.
pub fn run(
    cfg: ServerConfig,
    servers: usize,
    workers: usize,
    steps: usize,
    lr: f32,
    delay: &[(usize, Duration)],
) -> Vec<ServerReport> {
    run_scheduled(cfg, servers, workers, steps, lr, delay, false, &[])
}

/// Whose turn it is among workers taking steps in a fixed order.
pub type Turns = Arc<(std::sync::Mutex<usize>, std::sync::Condvar)>;

/// [`run`]; with `lockstep`, the workers take their steps in turn (worker 0's first step,
/// worker 1's, ..., worker 0's second), each step's exchange with the servers finished before
/// the next worker's starts: the servers see the same order of requests however the threads
/// are scheduled, so an asynchronous run gives the same result on an idle or a busy machine.
/// `skips`: (worker, step) pairs where the worker skips its step ([`PsWorker::skip`], as an
/// fp16 overflow makes it).
#[allow(clippy::too_many_arguments)]
pub fn run_scheduled(
    cfg: ServerConfig,
    servers: usize,
    workers: usize,
    steps: usize,
    lr: f32,
    delay: &[(usize, Duration)],
    lockstep: bool,
    skips: &[(usize, usize)],
) -> Vec<ServerReport> {
    let skips = skips.to_vec();
    let turns: Option<Turns> = lockstep.then(Default::default);
    // The servers are ranks 0..servers: sync rounds agreed across them, as a job does.
    let mut cfg = cfg;
    cfg.peers = (0..servers).collect();
    let layout = layout(servers);
    let mut ranks: Vec<Arc<dyn Transport>> = MemoryTransport::mesh(servers + workers)
        .into_iter()
        .map(|t| Arc::new(t) as Arc<dyn Transport>)
        .collect();
    let worker_ranks: Vec<usize> = (servers..servers + workers).collect();
    let server_threads: Vec<_> = ranks
        .drain(..servers)
        .enumerate()
        .map(|(s, t)| {
            let (cfg, ws, init) = (
                cfg.clone(),
                worker_ranks.clone(),
                vec![0f32; layout.range(s).len()],
            );
            bounded(move || serve(t.as_ref(), &cfg, init, &ws, &mut |l| eprintln!("{l}")))
        })
        .collect();
    let worker_threads: Vec<_> = ranks
        .into_iter()
        .enumerate()
        .map(|(k, t)| {
            let (layout, mode, window) = (layout.clone(), cfg.mode, cfg.window);
            let pause = delay.iter().find(|d| d.0 == k).map(|d| d.1);
            let turns = turns.clone();
            let skips = skips.clone();
            bounded(move || {
                let wait_turn = |i: usize| {
                    if let Some(t) = &turns {
                        let (lock, ready) = &**t;
                        let mut now = lock.lock().unwrap();
                        while *now != i {
                            now = ready.wait(now).unwrap();
                        }
                    }
                };
                let end_turn = || {
                    if let Some(t) = &turns {
                        let (lock, ready) = &**t;
                        *lock.lock().unwrap() += 1;
                        ready.notify_all();
                    }
                };
                // The start's pull in turn too: every worker starts from the initial values.
                wait_turn(k);
                let client = Client::new(t, layout, (0..servers).collect()).unwrap();
                let (mut w, mut params) = PsWorker::start(client, mode, window, lr, 0.5).unwrap();
                end_turn();
                let data = samples(k);
                for step in 0..steps {
                    wait_turn((step + 1) * workers + k);
                    if let Some(p) = pause {
                        std::thread::sleep(p);
                    }
                    if skips.contains(&(k, step)) {
                        w.skip(&mut params).unwrap();
                    } else {
                        let g = grad(&params, &data);
                        w.step(&mut params, &g, data.len() as u64).unwrap();
                    }
                    end_turn();
                }
                w.finish().unwrap();
            })
        })
        .collect();
    for w in worker_threads {
        get(w, "a worker");
    }
    server_threads
        .into_iter()
        .map(|s| get(s, "a server").unwrap())
        .collect()
}

pub fn joined(reports: &[ServerReport]) -> Vec<f32> {
    reports.iter().flat_map(|r| r.values.clone()).collect()
}
