//! The QUIC transport on 127.0.0.1: the conformance suite, job authentication, garbage on the
//! port, a rank that never arrives, collectives across processes, and a killed process.
//!
//! Processes: the test binary re-runs itself with `BURN_DIST_CHILD` set, and the `child` test
//! then plays one rank. Every wait has a deadline.

mod common;

use std::net::UdpSocket;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn_dist::rendezvous::{RankInfo, connect};
use burn_dist::routed::RoutedTransport;
use burn_dist::tls::Membership;
use burn_dist::{Communicator, Compression, DistError, ReduceOp, Transport};
use common::{
    JOB, SECRET, finish, free_port, info, job, job_with, options, options_lanes, options_shm,
};

/// Runs `f` on each rank in a thread and returns the results in rank order, with a deadline.
fn each<T: Send + 'static>(
    ranks: Vec<Arc<RoutedTransport>>,
    f: impl Fn(Communicator) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let n = ranks.len();
    let (tx, rx) = std::sync::mpsc::channel();
    for t in ranks {
        let (f, tx) = (f.clone(), tx.clone());
        std::thread::spawn(move || {
            let rank = t.rank();
            let c = Communicator::new(t).with_timeout(Duration::from_secs(30));
            let _ = tx.send((rank, f(c)));
        });
    }
    let mut out: Vec<(usize, T)> = Vec::new();
    for _ in 0..n {
        out.push(
            rx.recv_timeout(Duration::from_secs(90))
                .expect("a rank hung or panicked"),
        );
    }
    out.sort_by_key(|(r, _)| *r);
    out.into_iter().map(|(_, v)| v).collect()
}

#[test]
fn quic_passes_the_conformance_suite() {
    let ranks: Vec<Arc<dyn Transport>> = job(3)
        .into_iter()
        .map(|t| Arc::new(t) as Arc<dyn Transport>)
        .collect();
    burn_dist::transport::conformance::run(ranks);
}

#[test]
fn quic_with_three_connections_per_pair_passes_the_conformance_suite_and_sums() {
    let ranks = job_with(3, options_lanes);
    for t in &ranks {
        let others = (0..3).filter(|&p| p != t.rank());
        assert!(others.map(|p| t.connections(p)).all(|n| n == 3));
    }
    let dyn_ranks: Vec<Arc<dyn Transport>> = ranks
        .into_iter()
        .map(|t| Arc::new(t) as Arc<dyn Transport>)
        .collect();
    burn_dist::transport::conformance::run(dyn_ranks);
    // Chunks of 1,000 values: a 5,000-value allreduce spreads its messages over every lane.
    let sums = each(
        job_with(3, options_lanes)
            .into_iter()
            .map(Arc::new)
            .collect(),
        |c| {
            let c = c.with_chunk_elems(1000);
            let mut v: Vec<f32> = (0..5000).map(|i| (i % 7 + c.rank()) as f32).collect();
            c.allreduce(&mut v, ReduceOp::Sum).unwrap();
            v
        },
    );
    let want: Vec<f32> = (0..5000).map(|i| (3 * (i % 7) + 3) as f32).collect();
    for v in sums {
        assert_eq!(v, want);
    }
}

#[test]
fn quic_with_shared_memory_between_threads_passes_the_conformance_suite() {
    let ranks = job_with(3, options_shm);
    for t in &ranks {
        let topology = t.topology().expect("a topology after the rendezvous");
        assert_eq!(topology.leaders, vec![0, 0, 0], "one host, one group");
        assert!(topology.local.is_some());
    }
    let ranks: Vec<Arc<dyn Transport>> = ranks
        .into_iter()
        .map(|t| Arc::new(t) as Arc<dyn Transport>)
        .collect();
    burn_dist::transport::conformance::run(ranks);
}

#[test]
fn compression_applies_when_ranks_reduce_in_shared_memory() {
    // Values bf16 cannot hold: every contribution and the sum are rounded to bf16, as the
    // ring rounds what it sends, while the exact variant beside keeps full f32 precision.
    let run = |c: Compression| {
        each(
            job_with(3, options_shm).into_iter().map(Arc::new).collect(),
            move |comm| {
                assert!(
                    comm.transport()
                        .topology()
                        .is_some_and(|t| t.shares_memory())
                );
                let mut v: Vec<f32> = (0..64)
                    .map(|i| 1.0 + (i + comm.rank()) as f32 / 1000.0)
                    .collect();
                comm.allreduce_with(&mut v, ReduceOp::Sum, c).unwrap();
                v
            },
        )
    };
    let exact = run(Compression::None);
    let bf16 = run(Compression::Bf16);
    for r in 1..3 {
        assert_eq!(bf16[r], bf16[0], "every rank holds the same bits");
    }
    let round = |x: f32| half::bf16::from_f32(x).to_f32();
    for i in 0..64 {
        let want: f32 = (0..3).map(|r| round(1.0 + (i + r) as f32 / 1000.0)).sum();
        assert_eq!(bf16[0][i], round(want), "value {i}");
        let sum: f32 = (0..3).map(|r| 1.0 + (i + r) as f32 / 1000.0).sum();
        assert!((exact[0][i] - sum).abs() < 1e-6, "exact {i}");
    }
    assert_ne!(bf16[0], exact[0], "bf16 must change these values");
}

#[test]
fn a_process_with_the_wrong_secret_cannot_join_and_the_job_goes_on() {
    let port = free_port();
    let world = 2;
    let rank0 = std::thread::spawn(move || {
        connect(
            &info(0, world, port),
            &Membership::secret(SECRET, JOB).unwrap(),
            &options(Duration::from_secs(30)),
        )
    });
    std::thread::sleep(Duration::from_millis(300));
    // An intruder with another secret claims rank 1: its handshake is refused.
    let intruder = connect(
        &info(1, world, port),
        &Membership::secret("e4b7a91c3d6f08e25b19c7a4d3f6e0b1", JOB).unwrap(),
        &options(Duration::from_secs(5)),
    );
    match intruder {
        Err(DistError::Tls(m)) => assert!(m.contains("refused"), "{m}"),
        Err(e) => panic!("expected a TLS refusal, got {e}"),
        Ok(_) => panic!("a process with the wrong secret joined the job"),
    }
    // The real rank 1 still joins, and the job works.
    let rank1 = connect(
        &info(1, world, port),
        &Membership::secret(SECRET, JOB).unwrap(),
        &options(Duration::from_secs(30)),
    )
    .expect("the real rank 1 joins");
    let rank0 = rank0.join().unwrap().expect("rank 0 formed the job");
    let sums = each(vec![Arc::new(rank0), Arc::new(rank1)], |c| {
        let mut v = vec![c.rank() as f32 + 1.0; 1000];
        c.allreduce(&mut v, ReduceOp::Sum).map(|_| v[999])
    });
    assert_eq!(sums.len(), 2);
    for s in sums {
        assert_eq!(s.unwrap(), 3.0);
    }
}

#[test]
fn random_bytes_on_the_port_do_not_disturb_a_running_job() {
    let ranks = job(2);
    let target = ranks[0].local_addr().unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let noise = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let s = UdpSocket::bind("127.0.0.1:0").unwrap();
            let mut x = 0x9e37_79b9_7f4a_7c15u64;
            let mut sent = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let len = (x % 1400) as usize + 1;
                let bytes: Vec<u8> = (0..len)
                    .map(|i| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        (x >> (i % 8)) as u8
                    })
                    .collect();
                let _ = s.send_to(&bytes, target);
                sent += 1;
            }
            sent
        })
    };
    let results = each(ranks.into_iter().map(Arc::new).collect(), |c| {
        let mut ok = 0;
        for round in 0..20 {
            let mut v: Vec<f32> = (0..50_000)
                .map(|i| (i + c.rank()) as f32 + round as f32)
                .collect();
            c.allreduce(&mut v, ReduceOp::Sum)
                .expect("allreduce under noise");
            if (0..50_000).all(|i| v[i] == (2 * i + 1 + 2 * round) as f32) {
                ok += 1;
            }
        }
        ok
    });
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let sent = noise.join().unwrap();
    assert!(sent > 0);
    assert_eq!(results, vec![20, 20]);
}

/// `n` genuine QUIC Initial packets, each opening a different connection (its own
/// destination connection id), from a client that is no member of the job: captured on a
/// socket that never answers.
fn stranger_initials(n: usize) -> Vec<Vec<u8>> {
    let sink = UdpSocket::bind("127.0.0.1:0").unwrap();
    sink.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let to = sink.local_addr().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let _guard = rt.enter();
    let stranger = burn_dist::tls::Identity::new(
        &Membership::secret("7d2c5e8f1a4b6c9e0d3f2a5b8c1e4d7f", JOB).unwrap(),
        1,
    )
    .unwrap();
    let tls = burn_dist::tls::client_config(&stranger).unwrap();
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap();
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    endpoint.set_default_client_config(quinn::ClientConfig::new(Arc::new(crypto)));
    let connecting: Vec<_> = (0..n)
        .map(|_| endpoint.connect(to, burn_dist::tls::SERVER_NAME).unwrap())
        .collect();
    let mut seen = std::collections::BTreeMap::new();
    let mut buf = [0u8; 2048];
    while seen.len() < n {
        // The endpoint's driver sends the Initials while this runtime runs.
        rt.block_on(tokio::time::sleep(Duration::from_millis(20)));
        while let Ok((len, _)) = {
            sink.set_nonblocking(true).unwrap();
            sink.recv_from(&mut buf)
        } {
            // Long header: flags, version (4), DCID length, DCID.
            let dcid_len = buf[5] as usize;
            seen.entry(buf[6..6 + dcid_len].to_vec())
                .or_insert_with(|| buf[..len].to_vec());
        }
    }
    drop(connecting);
    seen.into_values().take(n).collect()
}

#[test]
fn fifty_stalled_handshakes_from_a_stranger_do_not_keep_the_job_from_forming() {
    // A stranger opens a handshake every 200 ms for 10 s and never answers one. Taken one at a
    // time, each would hold rank 0 until its idle timeout (5 s), so a rank arriving among them
    // would wait behind them for longer than the rendezvous's 10 s; run side by side, each
    // with its own deadline, they hold up nothing.
    let initials = stranger_initials(50);
    assert_eq!(initials.len(), 50);
    let port = free_port();
    let world = 3;
    let timeout = Duration::from_secs(10);
    let member = move |r: usize| {
        std::thread::spawn(move || {
            connect(
                &info(r, world, port),
                &Membership::secret(SECRET, JOB).unwrap(),
                &options(timeout),
            )
        })
    };
    let rank0 = member(0);
    std::thread::sleep(Duration::from_millis(300));
    let target: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let flood = std::thread::spawn(move || {
        let mut open = Vec::new();
        for p in initials {
            let s = UdpSocket::bind("127.0.0.1:0").unwrap();
            s.send_to(&p, target).unwrap();
            open.push(s);
            std::thread::sleep(Duration::from_millis(200));
        }
        open.len()
    });
    let rank1 = member(1);
    // Rank 2 arrives in the middle of the flood.
    std::thread::sleep(Duration::from_secs(1));
    let rank2 = member(2);
    let mut ranks = Vec::new();
    for (r, t) in [rank0, rank1, rank2].into_iter().enumerate() {
        ranks.push(Arc::new(t.join().unwrap().unwrap_or_else(|e| {
            panic!("rank {r} formed the job despite the flood: {e}")
        })));
    }
    let sums = each(ranks, |c| {
        let mut v = vec![1.0f32; 100];
        c.allreduce(&mut v, ReduceOp::Sum).map(|_| v[99])
    });
    for s in sums {
        assert_eq!(s.unwrap(), 3.0);
    }
    assert_eq!(
        flood.join().unwrap(),
        50,
        "every stalled handshake was sent"
    );
}

#[test]
fn a_rank_that_never_arrives_is_named_within_the_timeout() {
    let port = free_port();
    let started = Instant::now();
    let rank1 = std::thread::spawn(move || {
        connect(
            &info(1, 3, port),
            &Membership::secret(SECRET, JOB).unwrap(),
            &options(Duration::from_secs(3)),
        )
    });
    let e = connect(
        &info(0, 3, port),
        &Membership::secret(SECRET, JOB).unwrap(),
        &options(Duration::from_secs(3)),
    )
    .err()
    .expect("rank 2 never came");
    match &e {
        DistError::MissingRanks { missing, .. } => assert_eq!(missing, &vec![2]),
        other => panic!("expected MissingRanks, got {other}"),
    }
    assert!(e.to_string().contains("[2]"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(20));
    assert!(rank1.join().unwrap().is_err());
}

// ---- processes ------------------------------------------------------------------------------

/// Rank `rank` of a process job; `shm`: ranks talk through shared memory (else QUIC only).
fn spawn_rank(rank: usize, world: usize, port: u16, mode: &str, shm: bool) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("BURN_DIST_CHILD", mode)
        .env("BURN_DIST_SHM", if shm { "1" } else { "0" })
        .env("HEARTH_RANK", rank.to_string())
        .env("HEARTH_WORLD_SIZE", world.to_string())
        .env("HEARTH_COORDINATOR", format!("127.0.0.1:{port}"))
        .env("HEARTH_JOB_SECRET", SECRET)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning a rank")
}

/// One rank of a process test (ignored: its parent runs it with BURN_DIST_CHILD set).
#[test]
#[ignore = "one rank of a multi-process test: its parent test starts it"]
fn child() {
    let mode = std::env::var("BURN_DIST_CHILD").expect("started by its parent test");
    let info = RankInfo::from_env().expect("rank from the environment");
    let shm = std::env::var("BURN_DIST_SHM").as_deref() == Ok("1");
    let opts = if shm { options_shm } else { options };
    let t = connect(
        &info,
        &Membership::from_env().expect("secret"),
        &opts(Duration::from_secs(30)),
    )
    .expect("rendezvous");
    let shares = t.topology().is_some_and(|t| t.shares_memory());
    println!("rank {}: shares memory: {shares}", info.rank);
    let (rank, world) = (info.rank, info.world);
    let comm = Communicator::new(Arc::new(t)).with_timeout(Duration::from_secs(60));
    match mode.as_str() {
        "collectives" => {
            for &len in &[0usize, 1, 7, 1000, 300_001] {
                let mine: Vec<f32> = (0..len)
                    .map(|i| ((i * 31 + rank * 17) % 101) as f32)
                    .collect();
                let mut v = mine.clone();
                comm.allreduce(&mut v, ReduceOp::Sum).expect("allreduce");
                for (i, x) in v.iter().enumerate() {
                    let want: f32 = (0..world).map(|r| ((i * 31 + r * 17) % 101) as f32).sum();
                    assert_eq!(*x, want, "len {len} [{i}]");
                }
                let mut b = mine.clone();
                comm.broadcast(&mut b, world - 1).expect("broadcast");
                let root: Vec<f32> = (0..len)
                    .map(|i| ((i * 31 + (world - 1) * 17) % 101) as f32)
                    .collect();
                assert_eq!(b, root);
                let g = comm.all_gather(&mine).expect("all_gather");
                assert_eq!(g.len(), len * world);
            }
            comm.barrier().expect("barrier");
            println!("rank {rank}: collectives OK");
        }
        "loop" => {
            // Collectives until something fails; the parent kills the last rank meanwhile.
            let started = Instant::now();
            let mut v = vec![1.0f32; 100_000];
            loop {
                if let Err(e) = comm.allreduce(&mut v, ReduceOp::Mean) {
                    println!("rank {rank} failed after {:?}: {e}", started.elapsed());
                    std::process::exit(3);
                }
                if started.elapsed() > Duration::from_secs(60) {
                    println!("rank {rank}: no failure noticed");
                    std::process::exit(4);
                }
            }
        }
        other => panic!("unknown child mode {other}"),
    }
}

#[test]
fn collectives_across_2_to_4_processes_match_direct_results() {
    for shm in [false, true] {
        for world in 2..=4 {
            let port = free_port();
            let children: Vec<Child> = (0..world)
                .map(|r| spawn_rank(r, world, port, "collectives", shm))
                .collect();
            for (r, c) in children.into_iter().enumerate() {
                let (ok, out) = finish(c, Duration::from_secs(120));
                assert!(ok, "world {world} rank {r} (shm {shm}) failed:\n{out}");
                assert!(out.contains("collectives OK"), "{out}");
                assert!(out.contains(&format!("shares memory: {shm}")), "{out}");
            }
        }
    }
}

/// Segment files in /dev/shm that processes `pids` created.
fn segments_of(pids: &[u32]) -> Vec<String> {
    std::fs::read_dir(burn_dist::shm::segment::SHM_DIR)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| pids.iter().any(|p| n.starts_with(&format!("hearth-{p}-"))))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn killing_a_process_mid_collective_fails_the_others_naming_it_within_10s() {
    killing_a_process_mid_collective(false);
}

#[test]
fn killing_a_process_mid_shared_memory_allreduce_fails_the_others_naming_it_within_10s() {
    killing_a_process_mid_collective(true);
}

fn killing_a_process_mid_collective(shm: bool) {
    let world = 3;
    let port = free_port();
    let mut children: Vec<Child> = (0..world)
        .map(|r| spawn_rank(r, world, port, "loop", shm))
        .collect();
    let pids: Vec<u32> = children.iter().map(Child::id).collect();
    // Let the job form and run collectives for a moment.
    std::thread::sleep(Duration::from_secs(3));
    let victim = children.pop().unwrap();
    let killed_at = Instant::now();
    let mut victim = victim;
    victim.kill().expect("kill rank 2");
    let _ = victim.wait();
    for (r, c) in children.into_iter().enumerate() {
        let (ok, out) = finish(c, Duration::from_secs(30));
        assert!(!ok, "rank {r} should fail:\n{out}");
        assert!(out.contains("failed after"), "rank {r}:\n{out}");
        assert!(out.contains(&format!("shares memory: {shm}")), "{out}");
        assert!(
            out.contains("rank 2 failed"),
            "rank {r} should name rank 2:\n{out}"
        );
    }
    assert!(
        killed_at.elapsed() < Duration::from_secs(10),
        "survivors took {:?}",
        killed_at.elapsed()
    );
    let left = segments_of(&pids);
    assert!(left.is_empty(), "segments left behind: {left:?}");
}

/// Whether `needle` occurs in `hay` (a name in a certificate's DER).
fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn with_a_secret_members_know_each_other_by_certificates_rank_zero_issued() {
    let ranks = common::job(3);
    for (r, t) in ranks.iter().enumerate() {
        for p in (0..3).filter(|&p| p != r) {
            let cert = t
                .quic()
                .peer_certificate(p)
                .unwrap_or_else(|| panic!("rank {r} has no certificate of rank {p}"));
            assert_eq!(burn_dist::tls::certificate_rank(&cert), Some(p));
            // Links with rank 0 were made at its door, with certificates from the secret; the
            // members' links with each other only with the ones rank 0's authority issued.
            let (issuer, other): (&[u8], &[u8]) = if r == 0 || p == 0 {
                (b"Hearth job CA", b"Hearth rank authority")
            } else {
                (b"Hearth rank authority", b"Hearth job CA")
            };
            assert!(
                contains(cert.as_ref(), issuer) && !contains(cert.as_ref(), other),
                "rank {r} knows rank {p} by a certificate not from {}",
                String::from_utf8_lossy(issuer)
            );
        }
    }
}
