//! Parameter servers on the in-memory transport: sync equals allreduce data parallel (1e-5),
//! every asynchronous mode learns, the staleness bound holds a fast worker back, sync names
//! the worker it waited for, a dead worker does not stop asynchronous training, a dead server
//! is an error naming its shard, and garbage from a worker gets it refused. Every thread is
//! joined with a deadline.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use burn_dist::collective::{Communicator, ReduceOp};
use burn_dist::flat::layout::Layout;
use burn_dist::flat::optim::ShardOptimizer;
use burn_dist::ps::client::{Client, PsWorker};
use burn_dist::ps::message::{Op, REPLY, REQUEST, Reply, Request};
use burn_dist::ps::server::{ServerConfig, ServerReport, serve};
use burn_dist::ps::{Mode, rules};
use burn_dist::transport::Transport;
use burn_dist::transport::memory::MemoryTransport;
use burn_dist::wire::Kind;

const DIM: usize = 5;

/// Runs `f` on a thread and waits at most 60 s for it: a hang fails the test.
fn bounded<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> mpsc::Receiver<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx
}

fn get<T>(rx: mpsc::Receiver<T>, what: &str) -> T {
    rx.recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("{what} did not finish in 60 s"))
}

/// Worker `k`'s samples of y = 2·x_i·(i+1)/DIM − 0.5 with a deterministic spread, `4 + 2k` of them.
fn samples(k: usize) -> Vec<([f32; DIM], f32)> {
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
fn grad(params: &[f32], data: &[([f32; DIM], f32)]) -> Vec<f32> {
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

fn loss(params: &[f32], workers: usize) -> f32 {
    let all: Vec<_> = (0..workers).flat_map(samples).collect();
    all.iter()
        .map(|(x, y)| {
            let pred: f32 = x.iter().zip(params).map(|(a, w)| a * w).sum::<f32>() + params[DIM];
            (pred - y).powi(2)
        })
        .sum::<f32>()
        / all.len() as f32
}

fn layout(servers: usize) -> Layout {
    Layout::new(&[("w".to_string(), DIM), ("b".to_string(), 1)], servers).unwrap()
}

/// `servers` server ranks (0..) and `workers` worker ranks after them, each worker taking
/// `steps` steps on its own samples (`delay` before each push for the workers named), and
/// every server's report.
fn run(
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
type Turns = Arc<(std::sync::Mutex<usize>, std::sync::Condvar)>;

/// [`run`]; with `lockstep`, the workers take their steps in turn (worker 0's first step,
/// worker 1's, ..., worker 0's second), each step's exchange with the servers finished before
/// the next worker's starts: the servers see the same order of requests however the threads
/// are scheduled, so an asynchronous run gives the same result on an idle or a busy machine.
/// `skips`: (worker, step) pairs where the worker skips its step ([`PsWorker::skip`], as an
/// fp16 overflow makes it).
#[allow(clippy::too_many_arguments)]
fn run_scheduled(
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

fn joined(reports: &[ServerReport]) -> Vec<f32> {
    reports.iter().flat_map(|r| r.values.clone()).collect()
}

#[test]
fn sync_equals_allreduce_data_parallel() {
    let (workers, steps, lr, momentum) = (3, 15, 0.05, 0.9);
    let mut cfg = ServerConfig::new(Mode::Sync);
    cfg.optimizer = ShardOptimizer::sgd(lr, momentum);
    // Two servers: "w" is sliced across them.
    let reports = run(cfg, 2, workers, steps, lr, &[]);
    let ps = joined(&reports);
    assert!(reports.iter().all(|r| r.version == steps as u64));

    // Allreduce data parallel: gradients x samples summed, divided by all samples, then the
    // same SGD with momentum on every rank.
    let threads: Vec<_> = MemoryTransport::mesh(workers)
        .into_iter()
        .enumerate()
        .map(|(k, t)| {
            bounded(move || {
                let comm = Communicator::new(Arc::new(t));
                let data = samples(k);
                let mut n = vec![data.len() as f32];
                comm.allreduce(&mut n, ReduceOp::Sum).unwrap();
                let (mut p, mut v) = (vec![0f32; DIM + 1], vec![0f32; DIM + 1]);
                for _ in 0..steps {
                    let mut g: Vec<f32> = grad(&p, &data)
                        .iter()
                        .map(|x| x * data.len() as f32 / n[0])
                        .collect();
                    comm.allreduce(&mut g, ReduceOp::Sum).unwrap();
                    rules::sgd_momentum(&mut p, &g, &mut v, lr, momentum);
                }
                p
            })
        })
        .collect();
    let allreduce = get(threads.into_iter().next().unwrap(), "allreduce rank 0");
    let worst = ps
        .iter()
        .zip(&allreduce)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        worst <= 1e-5,
        "ps {ps:?} vs allreduce {allreduce:?}: {worst}"
    );
    assert!(loss(&ps, workers) < 0.5 * loss(&[0.0; DIM + 1], workers));
}

/// A worker's skipped step (fp16 overflow) in sync mode: its round is the mean of the others'
/// gradients alone, and a round every worker skipped moves nothing, momentum included, while
/// the rounds are still counted.
#[test]
fn in_sync_mode_a_skipped_step_weighs_nothing_and_a_round_all_skipped_moves_nothing() {
    let (workers, steps, lr, momentum) = (2, 6, 0.05, 0.9);
    let skips = [(0, 1), (0, 3), (1, 3), (1, 4)];
    let mut cfg = ServerConfig::new(Mode::Sync);
    cfg.optimizer = ShardOptimizer::sgd(lr, momentum);
    let reports = run_scheduled(cfg, 2, workers, steps, lr, &[], false, &skips);
    assert!(reports.iter().all(|r| r.version == steps as u64));
    let ps = joined(&reports);
    // The same rounds by hand.
    let (mut p, mut v) = (vec![0f32; DIM + 1], vec![0f32; DIM + 1]);
    for step in 0..steps {
        let pushed: Vec<(u64, Vec<f32>)> = (0..workers)
            .filter(|k| !skips.contains(&(*k, step)))
            .map(|k| (samples(k).len() as u64, grad(&p, &samples(k))))
            .collect();
        if !pushed.is_empty() {
            rules::sgd_momentum(&mut p, &rules::weighted_mean(&pushed), &mut v, lr, momentum);
        }
    }
    let worst = ps
        .iter()
        .zip(&p)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(worst <= 1e-6, "ps {ps:?} vs by hand {p:?}: {worst}");
    // And the skips mattered: without them the values differ.
    let mut cfg = ServerConfig::new(Mode::Sync);
    cfg.optimizer = ShardOptimizer::sgd(lr, momentum);
    let plain = joined(&run(cfg, 2, workers, steps, lr, &[]));
    assert!(plain.iter().zip(&ps).any(|(a, b)| (a - b).abs() > 1e-4));
}

#[test]
fn every_asynchronous_mode_learns() {
    // In lockstep: the outcome is a function of the code, not of the machine's load (the
    // threshold had little margin for EASGD when the threads raced: 0.088 to 0.14 of 0.138).
    let start = loss(&[0.0; DIM + 1], 3);
    for mode in [Mode::Downpour, Mode::Adag, Mode::DynSgd, Mode::Easgd] {
        let mut cfg = ServerConfig::new(mode);
        cfg.window = 3;
        let reports = run_scheduled(cfg, 2, 3, 240, 0.1, &[], true, &[]);
        let end = loss(&joined(&reports), 3);
        eprintln!("{mode}: loss {start} -> {end}");
        assert!(end < 0.1 * start, "{mode}: loss {start} -> {end}");
        assert!(reports.iter().all(|r| r.dropped.is_empty()), "{mode}");
    }
}

#[test]
fn the_staleness_bound_holds_a_fast_worker_back() {
    let slow = [(1, Duration::from_millis(15))];
    let mut cfg = ServerConfig::new(Mode::Downpour);
    cfg.max_staleness = Some(2);
    let bounded_run = run(cfg.clone(), 1, 2, 20, 0.05, &slow);
    assert!(
        bounded_run[0].max_lead <= 2,
        "lead {}",
        bounded_run[0].max_lead
    );
    // Without the bound the fast worker runs ahead: the bound above did something.
    cfg.max_staleness = None;
    let free = run(cfg, 1, 2, 20, 0.05, &slow);
    assert!(free[0].max_lead > 2, "lead {}", free[0].max_lead);
}

#[test]
fn sync_names_the_worker_it_waited_for() {
    let cfg = ServerConfig::new(Mode::Sync);
    let reports = run(cfg, 1, 3, 10, 0.05, &[(2, Duration::from_millis(10))]);
    let waited = &reports[0].waited_for;
    let (most, _) = waited.iter().max_by_key(|(_, v)| v.0).unwrap();
    assert_eq!(*most, 3, "rank 3 (worker 2) is the slow one: {waited:?}");
}

#[test]
fn a_dead_worker_does_not_stop_asynchronous_training() {
    let layout = layout(1);
    let mut ranks = MemoryTransport::mesh(4).into_iter();
    let server = ranks.next().unwrap();
    let mut cfg = ServerConfig::new(Mode::Adag);
    cfg.window = 2;
    let s = bounded(move || {
        serve(&server, &cfg, vec![0.0; DIM + 1], &[1, 2, 3], &mut |l| {
            eprintln!("{l}")
        })
    });
    let workers: Vec<_> = ranks
        .enumerate()
        .map(|(k, t)| {
            let layout = layout.clone();
            bounded(move || {
                let t = Arc::new(t);
                let client = Client::new(t.clone() as Arc<dyn Transport>, layout, vec![0]).unwrap();
                let (mut w, mut params) = PsWorker::start(client, Mode::Adag, 2, 0.1, 0.0).unwrap();
                let data = samples(k);
                for step in 0..600 {
                    if k == 2 && step == 7 {
                        t.kill("worker 2 killed by the test");
                        return;
                    }
                    let g = grad(&params, &data);
                    w.step(&mut params, &g, 1).unwrap();
                }
                w.finish().unwrap();
            })
        })
        .collect();
    for w in workers {
        get(w, "a worker");
    }
    let report = get(s, "the server").unwrap();
    assert_eq!(report.dropped.len(), 1, "{:?}", report.dropped);
    assert_eq!(report.dropped[0].0, 3);
    assert!(report.dropped[0].1.contains("killed by the test"));
    assert!(loss(&report.values, 3) < 0.2 * loss(&[0.0; DIM + 1], 3));
}

#[test]
fn a_dead_server_is_an_error_naming_its_shard() {
    let layout = layout(2);
    let mut ranks = MemoryTransport::mesh(3).into_iter();
    let (s0, s1, worker) = (
        ranks.next().unwrap(),
        ranks.next().unwrap(),
        ranks.next().unwrap(),
    );
    let mut cfg = ServerConfig::new(Mode::Downpour);
    cfg.idle_timeout = Duration::from_secs(20);
    let init = vec![0.0; layout.range(0).len()];
    let server = bounded(move || serve(&s0, &cfg, init, &[2], &mut |_| {}));
    s1.kill("server 1 killed by the test");
    let w = bounded(move || {
        let mut client = Client::new(Arc::new(worker), layout, vec![0, 1]).unwrap();
        client.timeout = Duration::from_secs(10);
        let err = client.pull().unwrap_err().to_string();
        let _ = client.done();
        err
    });
    let err = get(w, "the worker");
    assert!(
        err.contains("parameter server rank 1, shard 1 of 2") && err.contains("w[3..5], b"),
        "{err}"
    );
    assert!(err.contains("killed by the test"), "{err}");
    get(server, "server 0").unwrap();
}

/// Issue 55: a sync worker lost after its gradient reached one shard and before the other
/// is left out of the round on both, so the shards hold the same update. Worker 1 pushes
/// 10s to shard 0 only; worker 0 pushes 1s to both; worker 1 dies once shard 0 has had the
/// time to close the round (a real transport notices a death seconds later). Without the
/// servers' agreement shard 0 applied the mean of both (-5.5) and shard 1 only worker 0's
/// (-1).
#[test]
fn a_sync_round_is_all_or_nothing_across_shards_when_a_worker_dies_mid_push() {
    let mut ranks = MemoryTransport::mesh(4).into_iter();
    let (w0, w1) = (ranks.next().unwrap(), ranks.next().unwrap());
    let servers: Vec<_> = ranks
        .enumerate()
        .map(|(s, t)| {
            let mut cfg = ServerConfig::new(Mode::Sync);
            cfg.optimizer = ShardOptimizer::sgd(1.0, 0.0);
            cfg.peers = vec![2, 3];
            cfg.idle_timeout = Duration::from_secs(20);
            bounded(move || {
                serve(&t, &cfg, vec![0.0; 2], &[0, 1], &mut |l| {
                    eprintln!("server {s}: {l}")
                })
            })
        })
        .collect();
    let push = |v: f32| {
        Request {
            op: Op::PushGrad,
            clock: 1,
            version: 0,
            samples: 1,
            values: vec![v; 2],
            cut: Vec::new(),
        }
        .encode()
    };
    // Worker 0 outlives worker 1 (as a worker's client accepts another worker's loss).
    w0.accept_losses();
    w1.send(2, Kind::Ps, REQUEST, push(10.0)).unwrap();
    w0.send(2, Kind::Ps, REQUEST, push(1.0)).unwrap();
    w0.send(3, Kind::Ps, REQUEST, push(1.0)).unwrap();
    // Shard 0 holds both gradients; without an agreement it answers at once.
    let soon = Instant::now() + Duration::from_millis(500);
    let early = w0.recv(2, Kind::Ps, REPLY, soon).ok();
    w1.kill("killed between its pushes to shard 0 and shard 1");
    let later = Instant::now() + Duration::from_secs(20);
    let mut values = Vec::new();
    for (shard, early) in [(2, early), (3, None)] {
        let bytes = early.unwrap_or_else(|| w0.recv(shard, Kind::Ps, REPLY, later).unwrap());
        match Reply::decode(&bytes, 2).unwrap() {
            Reply::Values { values: v, .. } => values.extend(v),
            other => panic!("shard rank {shard} answered {other:?}"),
        }
    }
    let done = Request {
        op: Op::Done,
        clock: 1,
        version: 1,
        samples: 0,
        values: Vec::new(),
        cut: Vec::new(),
    };
    for shard in [2, 3] {
        w0.send(shard, Kind::Ps, REQUEST, done.encode()).unwrap();
    }
    assert_eq!(values, vec![-1.0; 4], "worker 0's values after the round");
    let reports: Vec<ServerReport> = servers
        .into_iter()
        .map(|s| get(s, "a server").unwrap())
        .collect();
    assert_eq!(joined(&reports), vec![-1.0; 4]);
    for r in &reports {
        assert_eq!(r.version, 1);
        assert_eq!(r.dropped.len(), 1, "{:?}", r.dropped);
        assert_eq!(r.dropped[0].0, 1);
    }
}

#[test]
fn garbage_from_a_worker_gets_it_refused_and_the_others_go_on() {
    let mut ranks = MemoryTransport::mesh(3).into_iter();
    let (server, good, bad) = (
        ranks.next().unwrap(),
        ranks.next().unwrap(),
        ranks.next().unwrap(),
    );
    let cfg = ServerConfig::new(Mode::Downpour);
    let s = bounded(move || serve(&server, &cfg, vec![0.0; DIM + 1], &[1, 2], &mut |_| {}));
    let b = bounded(move || {
        bad.send(0, Kind::Ps, burn_dist::ps::message::REQUEST, vec![7; 13])
            .unwrap();
        let answer = bad
            .recv(
                0,
                Kind::Ps,
                burn_dist::ps::message::REPLY,
                std::time::Instant::now() + Duration::from_secs(10),
            )
            .unwrap();
        burn_dist::ps::message::Reply::decode(&answer, DIM + 1).unwrap()
    });
    let g = bounded(move || {
        let client = Client::new(Arc::new(good), layout(1), vec![0]).unwrap();
        let (mut w, mut p) = PsWorker::start(client, Mode::Downpour, 1, 0.1, 0.0).unwrap();
        for _ in 0..5 {
            let gr = grad(&p, &samples(0));
            w.step(&mut p, &gr, 1).unwrap();
        }
        w.finish().unwrap();
    });
    match get(b, "the bad worker") {
        burn_dist::ps::message::Reply::Refused(why) => assert!(why.contains("malformed"), "{why}"),
        other => panic!("garbage was answered with {other:?}"),
    }
    get(g, "the good worker");
    let report = get(s, "the server").unwrap();
    assert_eq!(report.dropped.len(), 1);
    assert_eq!(report.version, 5);
}

/// Three workers push all-ones deltas (DOWNPOUR) to two servers as fast as they can while the
/// lead takes checkpoints: a consistent checkpoint holds the same pushes in every shard, so
/// every value of every shard is equal, and their sum over shards counts each push once.
#[test]
fn checkpoints_are_consistent_across_shards_while_workers_push() {
    // Ranks 0 and 1 serve; 2 (the lead), 3 and 4 push.
    let workers = vec![2, 3, 4];
    let layout = Layout::new(&[("a".to_string(), 7), ("b".to_string(), 6)], 2).unwrap();
    let mut ts: Vec<Arc<dyn Transport>> = MemoryTransport::mesh(5)
        .into_iter()
        .map(|t| Arc::new(t) as Arc<dyn Transport>)
        .collect();
    let mut handles = Vec::new();
    for t in ts.drain(..2) {
        let workers = workers.clone();
        handles.push(bounded(move || {
            let cfg = ServerConfig::new(Mode::Downpour);
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            burn_dist::ps::server::run_server(&*t, &cfg, 2, &workers, deadline, &mut |_| {})
                .map(|r| r.values.len())
        }));
    }
    let mut ws = ts.into_iter();
    let lead_t = ws.next().unwrap();
    let others: Vec<_> = ws
        .map(|t| {
            let layout = layout.clone();
            bounded(move || {
                let mut c = Client::new(t, layout, vec![0, 1]).unwrap();
                c.pull().unwrap();
                for _ in 0..300 {
                    c.push_delta(&[1.0; 13]).unwrap();
                }
                c.done().unwrap();
            })
        })
        .collect();
    let lead = {
        let layout = layout.clone();
        bounded(move || {
            let mut c = Client::new(lead_t, layout.clone(), vec![0, 1]).unwrap();
            let zero = |s: usize| burn_dist::ps::message::ShardState {
                version: 0,
                values: vec![0.0; layout.range(s).len()],
                optim_state: Vec::new(),
            };
            c.init_servers(vec![zero(0), zero(1)]).unwrap();
            let mut seen = Vec::new();
            for _ in 0..40 {
                c.push_delta(&[1.0; 13]).unwrap();
                let states = c.checkpoint().unwrap();
                let all: Vec<f32> = states.iter().flat_map(|s| s.values.clone()).collect();
                seen.push(all);
            }
            c.done().unwrap();
            let last = c.final_states().unwrap();
            (seen, last)
        })
    };
    for o in others {
        get(o, "a pushing worker");
    }
    let (seen, last) = get(lead, "the lead");
    for (i, all) in seen.iter().enumerate() {
        assert!(
            all.iter().all(|v| *v == all[0]),
            "checkpoint {i} mixes pushes: {all:?}"
        );
    }
    assert!(
        seen.windows(2).all(|w| w[1][0] > w[0][0]),
        "checkpoints move on"
    );
    let total: Vec<f32> = last.iter().flat_map(|s| s.values.clone()).collect();
    assert!(total.iter().all(|v| *v == 640.0), "{total:?}");
    let lens: Vec<usize> = handles
        .into_iter()
        .map(|h| get(h, "a server").unwrap())
        .collect();
    assert_eq!(lens, vec![6, 7]);
}
