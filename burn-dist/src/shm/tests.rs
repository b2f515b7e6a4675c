//! Shared memory with ranks as threads of this process: every rank maps the segment on its own,
//! as separate processes do. Expected sums are computed independently (integers in f64).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::collective::{Communicator, ReduceOp};
use crate::transport::memory::MemoryTransport;
use crate::transport::{HostGroup, Transport, conformance};

mod in_place;

fn small() -> ShmOptions {
    ShmOptions {
        // A one-page ring makes every multi-kilobyte frame wrap around; 8 KiB slots make every
        // buffer over 1,024 values go through in several pieces.
        ring_bytes: 4096,
        slot_bytes: 8192,
        stale: Duration::from_millis(500),
        ..ShmOptions::default()
    }
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

/// `f` on every item, one thread each (a rank per thread), results in the items' order.
fn on_threads<I: Send + 'static, T: Send + 'static>(
    items: Vec<I>,
    f: impl Fn(I) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let handles: Vec<_> = items
        .into_iter()
        .map(|i| {
            let f = f.clone();
            std::thread::spawn(move || f(i))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("a rank panicked"))
        .collect()
}

fn each<T: Send + 'static>(
    ranks: Vec<impl Transport + 'static>,
    f: impl Fn(Communicator) -> T + Send + Sync + 'static,
) -> Vec<T> {
    on_threads(ranks, move |t| {
        f(Communicator::new(Arc::new(t)).with_timeout(Duration::from_secs(20)))
    })
}

fn value(rank: usize, i: usize) -> f32 {
    ((i * 31 + rank * 17) % 101) as f32
}

fn expected(world: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (0..world).map(|r| f64::from(value(r, i))).sum::<f64>() as f32)
        .collect()
}

#[test]
fn shared_memory_passes_the_conformance_suite() {
    for world in [2, 3] {
        let ranks = ShmTransport::group(world, &small()).unwrap();
        conformance::run(
            ranks
                .into_iter()
                .map(|t| Arc::new(t) as Arc<dyn Transport>)
                .collect(),
        );
    }
}

#[test]
fn the_segment_file_is_gone_once_the_group_exists() {
    let ranks = ShmTransport::group(2, &small()).unwrap();
    let me = format!("{}{}-", segment::PREFIX, std::process::id());
    let left: Vec<String> = std::fs::read_dir(segment::SHM_DIR)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&me))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    drop(ranks);
}

#[test]
fn reduce_scatter_and_all_gather_in_the_segment_match_direct_results() {
    for world in 2..=4 {
        let ranks = ShmTransport::group(world, &small()).unwrap();
        let got = each(ranks, move |comm| {
            assert!(
                comm.whole_world_in_memory().is_some(),
                "one host: the segment's path"
            );
            let mut out = Vec::new();
            // Shorter than the ranks, odd, and many rounds (chunks of 1,024 / n values).
            for len in [1usize, 3, 7, 1000, 5000] {
                let v: Vec<f32> = (0..len).map(|i| value(comm.rank(), i)).collect();
                let mine = comm.reduce_scatter(v.clone(), ReduceOp::Sum).unwrap();
                let gathered = comm.all_gather(&v[..len.min(1500)]).unwrap();
                out.push((len, mine, gathered));
            }
            (comm.rank(), out)
        });
        for (rank, out) in got {
            for (len, mine, gathered) in out {
                let want = expected(world, len);
                let (a, b) = crate::split::segment(len, world, rank);
                assert_eq!(
                    mine,
                    &want[a..b],
                    "{world} ranks, {len} values, rank {rank}"
                );
                let m = len.min(1500);
                let want_gather: Vec<f32> = (0..world)
                    .flat_map(|r| (0..m).map(move |i| value(r, i)))
                    .collect();
                assert_eq!(gathered, want_gather, "{world} ranks, all-gather of {m}");
            }
        }
    }
}

#[test]
fn in_place_allreduce_matches_the_sum_for_2_to_4_ranks() {
    // Both paths, whatever this machine's cores would choose.
    for (world, chain) in (2..=4).flat_map(|w| [(w, false), (w, true)]) {
        let o = ShmOptions {
            chain: Some(chain),
            ..small()
        };
        let ranks = ShmTransport::group(world, &o).unwrap();
        let got = each(ranks, move |comm| {
            let mut out = Vec::new();
            // Empty, shorter than the ranks, odd, and several pieces (1,024 values each).
            for len in [0usize, 1, 3, 7, 1000, 1024, 5000] {
                let mut v: Vec<f32> = (0..len).map(|i| value(comm.rank(), i)).collect();
                comm.allreduce(&mut v, ReduceOp::Sum).unwrap();
                out.push(v);
            }
            let mut m = vec![comm.rank() as f32; 3001];
            comm.allreduce(&mut m, ReduceOp::Mean).unwrap();
            out.push(m);
            out
        });
        for (r, results) in got.iter().enumerate() {
            for (v, len) in results.iter().zip([0usize, 1, 3, 7, 1000, 1024, 5000]) {
                assert_eq!(
                    v,
                    &expected(world, len),
                    "world {world} chain {chain} rank {r} len {len}"
                );
            }
            let mean = (0..world).sum::<usize>() as f32 / world as f32;
            assert!(
                results[7].iter().all(|&x| x == mean),
                "world {world} chain {chain} rank {r} mean"
            );
        }
    }
}

/// Values whose sum depends on the order of the additions (no exact small integers).
fn ragged(rank: usize, i: usize) -> f32 {
    ((i as f32 + 0.1) * (rank as f32 + 1.3)).sin() * 10f32.powi((i % 7) as i32 - 3)
}

#[test]
fn the_chain_sums_in_rank_order_and_every_rank_ends_with_the_same_bits() {
    // From 3 ranks on, the barrier path's order differs ((x2 + x0) + x1 for rank 2's
    // segment), so this also shows that the chain was taken.
    for world in 2..=5 {
        let o = ShmOptions {
            chain: Some(true),
            ..small()
        };
        let ranks = ShmTransport::group(world, &o).unwrap();
        // Several calls in a row: the ring's places are reused across calls and pieces.
        let lens = [5000usize, 1, 3000, 2048];
        let got = each(ranks, move |comm| {
            lens.iter()
                .map(|&len| {
                    let mut v: Vec<f32> = (0..len).map(|i| ragged(comm.rank(), i)).collect();
                    comm.allreduce(&mut v, ReduceOp::Sum).unwrap();
                    v
                })
                .collect::<Vec<_>>()
        });
        for (c, &len) in lens.iter().enumerate() {
            let want: Vec<f32> = (0..len)
                .map(|i| (1..world).fold(ragged(0, i), |acc, r| acc + ragged(r, i)))
                .collect();
            for (r, results) in got.iter().enumerate() {
                let same = results[c]
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "world {world} rank {r} call {c}: not the rank-order sum"
                );
            }
        }
    }
}

/// A segment of `world` ranks, unlinked, every rank registered as this process, with rank 1
/// played by a real `sleep` process of this host (a member that never does anything): kill
/// the child to make it a dead member.
fn with_silent_rank_1(world: usize, chain: bool) -> (Arc<Segment>, std::process::Child) {
    use std::sync::atomic::Ordering::Release;
    let o = small();
    let seg = Arc::new(Segment::create(world, o.ring_bytes, o.slot_bytes).unwrap());
    seg.set_chain(chain);
    seg.unlink().unwrap();
    for r in 0..world {
        seg.register(r);
    }
    let child = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let pid = child.id();
    let (_, start) = segment::proc_stat(pid).unwrap();
    let e1 = seg.entry(1);
    e1.pid.store(pid, Release);
    e1.start_time.store(start, Release);
    (seg, child)
}

#[test]
fn a_rank_that_hangs_or_dies_during_the_chain_fails_the_other_naming_it() {
    // Rank 1 is a real process of this host that passes the length barrier (the test arrives
    // for it) and then never adds a piece: rank 0 fills the ring and waits for it.
    use std::sync::atomic::Ordering::Release;
    let o = small();
    let (seg, mut child) = with_silent_rank_1(2, true);
    let group = LocalGroup::new(seg.clone(), 0, vec![5, 9], o.stale);
    let len = 100_000; // about a hundred pieces of 1,024 values: far more than the ring holds
    let arrive = |round: u32| {
        seg.entry(1).lens[(round as usize - 1) % 2].store(len as u64, Release);
        seg.entry(1).arrived.store(round, Release);
    };
    // Alive but silent: the deadline, naming it.
    arrive(1);
    let started = Instant::now();
    let e = group
        .reduce(
            &mut vec![1.0; len],
            true,
            Instant::now() + Duration::from_millis(500),
        )
        .unwrap_err();
    assert!(
        matches!(e, crate::DistError::Timeout { rank: 9, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("allreduce"), "{e}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    // Dead: a failure naming it, long before the deadline.
    let _ = child.kill();
    let _ = child.wait();
    arrive(2);
    let started = Instant::now();
    let e = group.reduce(&mut vec![1.0; len], true, soon()).unwrap_err();
    assert!(
        matches!(e, crate::DistError::PeerFailed { rank: 9, .. }),
        "{e}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn a_rank_gone_after_giving_up_on_another_points_at_the_one_that_failed_first() {
    // Three ranks: 2 died, 1 gave up on it and exited. Rank 0, which finds rank 1 missing at
    // the barrier first, must name rank 2 (the chain checks liveness the same way).
    use std::sync::atomic::Ordering::{Acquire, Release};
    let o = small();
    let (seg, mut child) = with_silent_rank_1(3, false);
    let _ = child.kill();
    let _ = child.wait();
    let mut gone = std::process::Command::new("true").spawn().unwrap();
    seg.entry(2).pid.store(gone.id(), Release);
    let _ = gone.wait();
    seg.entry(1).gave_up_on.store(2 + 1, Release);
    let group = LocalGroup::new(seg.clone(), 0, vec![4, 6, 8], o.stale);
    let e = group.reduce(&mut [1.0; 10], true, soon()).unwrap_err();
    assert!(
        matches!(e, crate::DistError::PeerFailed { rank: 8, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("rank 6 gave up"), "{e}");
    // And rank 0 records the same cause for whoever finds it gone.
    assert_eq!(seg.entry(0).gave_up_on.load(Acquire), 2 + 1);
}

/// A job of `world` ranks over in-memory "network" links where ranks `hosts[r]` share a
/// segment per host: the hierarchical allreduce without sockets.
struct Hosted {
    net: MemoryTransport,
    topology: Topology,
}

impl crate::transport::Endpoint for Hosted {
    fn rank(&self) -> usize {
        Transport::rank(&self.net)
    }
    fn world(&self) -> usize {
        Transport::world(&self.net)
    }
    fn transmit(
        &self,
        to: usize,
        kind: crate::wire::Kind,
        tag: u64,
        payload: Vec<u8>,
    ) -> crate::Result<()> {
        self.net.send(to, kind, tag, payload)
    }
    fn inbox(&self) -> &crate::transport::Inbox {
        crate::transport::Endpoint::inbox(&self.net)
    }
    fn topology(&self) -> Option<&Topology> {
        Some(&self.topology)
    }
}

fn hosted(hosts: &[usize]) -> Vec<Hosted> {
    let world = hosts.len();
    let o = small();
    let mut groups: Vec<Option<Arc<dyn HostGroup>>> = vec![None; world];
    let mut leaders = vec![0; world];
    for h in 0..=*hosts.iter().max().unwrap() {
        let members: Vec<usize> = (0..world).filter(|&r| hosts[r] == h).collect();
        for &m in &members {
            leaders[m] = members[0];
        }
        if members.len() < 2 {
            continue;
        }
        let seg = Arc::new(Segment::create(members.len(), o.ring_bytes, o.slot_bytes).unwrap());
        // The first host's allreduce as a chain, the others' with barriers.
        seg.set_chain(h == 0);
        for (li, &m) in members.iter().enumerate() {
            let s = if li == 0 {
                seg.clone()
            } else {
                Arc::new(Segment::attach(&seg.name(), seg.nonce(), members.len()).unwrap())
            };
            s.register(li);
            groups[m] = Some(Arc::new(LocalGroup::new(s, li, members.clone(), o.stale)));
        }
        seg.unlink().unwrap();
    }
    MemoryTransport::mesh(world)
        .into_iter()
        .zip(groups)
        .map(|(net, local)| Hosted {
            net,
            topology: Topology::new(leaders.clone(), local),
        })
        .collect()
}

#[test]
fn hierarchical_allreduce_matches_the_sum_across_uneven_hosts() {
    // Two hosts of two; three hosts of 2, 1 and 3 ranks (a host without shared memory among
    // them). The first host's segment runs a chain, the others' barriers.
    for hosts in [vec![0, 0, 1, 1], vec![0, 1, 0, 2, 2, 2]] {
        let world = hosts.len();
        let got = each(hosted(&hosts), move |comm| {
            let mut out = Vec::new();
            for len in [0usize, 1, 5, 1024, 4099] {
                let mut v: Vec<f32> = (0..len).map(|i| value(comm.rank(), i)).collect();
                comm.allreduce(&mut v, ReduceOp::Sum).unwrap();
                out.push(v);
            }
            out
        });
        for (r, results) in got.iter().enumerate() {
            for (v, len) in results.iter().zip([0usize, 1, 5, 1024, 4099]) {
                assert_eq!(
                    v,
                    &expected(world, len),
                    "hosts {hosts:?} rank {r} len {len}"
                );
            }
        }
    }
}

#[test]
fn a_rank_that_stops_beating_fails_the_barrier_naming_it() {
    // Two ranks on a segment without readers (so no heartbeats): rank 1 never arrives.
    let o = small();
    let seg = Arc::new(Segment::create(2, o.ring_bytes, o.slot_bytes).unwrap());
    seg.unlink().unwrap();
    seg.register(0);
    // Rank 1 "lives" in another pid namespace as far as the watch can tell: heartbeat only.
    seg.register(1);
    seg.entry(1)
        .pid_ns
        .store(1, std::sync::atomic::Ordering::Relaxed);
    let group = LocalGroup::new(seg, 0, vec![5, 9], o.stale);
    let started = Instant::now();
    let e = group.reduce(&mut [1.0; 10], true, soon()).unwrap_err();
    assert!(
        matches!(e, crate::DistError::PeerFailed { rank: 9, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("heartbeat"), "{e}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn a_stopped_process_on_this_host_is_lost_once_its_heartbeat_is_stale() {
    // Rank 1 is a real process of this pid namespace that never beats: running, it is alive
    // until the collective's deadline; stopped (SIGSTOP), it is lost after `stale`.
    let o = small();
    let (seg, mut child) = with_silent_rank_1(2, false);
    let pid = child.id();
    let group = LocalGroup::new(seg, 0, vec![5, 9], o.stale);
    let e = group
        .reduce(&mut [1.0; 10], true, Instant::now() + 4 * o.stale)
        .unwrap_err();
    assert!(
        matches!(e, crate::DistError::Timeout { rank: 9, .. }),
        "{e}"
    );
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
    let started = Instant::now();
    let e = group.reduce(&mut [1.0; 10], true, soon()).unwrap_err();
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        matches!(e, crate::DistError::PeerFailed { rank: 9, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("stopped"), "{e}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn a_rank_that_leaves_delivers_its_last_messages_first() {
    let mut ranks = ShmTransport::group(2, &small()).unwrap();
    let one = ranks.pop().unwrap();
    let zero = ranks.pop().unwrap();
    for tag in 0..5u64 {
        one.send(0, crate::wire::Kind::User, tag, vec![tag as u8; 10_000])
            .unwrap();
    }
    one.close();
    for tag in 0..5u64 {
        assert_eq!(
            zero.recv(1, crate::wire::Kind::User, tag, soon()).unwrap(),
            vec![tag as u8; 10_000]
        );
    }
    let e = zero
        .recv(1, crate::wire::Kind::User, 9, soon())
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank 1") && e.contains("finished"), "{e}");
    assert!(
        zero.send(1, crate::wire::Kind::User, 0, vec![1; 100_000])
            .is_err()
    );
}

#[test]
fn attach_refuses_foreign_names_wrong_nonces_and_open_permissions() {
    let seg = Segment::create(2, 4096, 8192).unwrap();
    let nonce = seg.nonce();
    assert!(Segment::attach("../etc/passwd", nonce, 2).is_err());
    assert!(Segment::attach("not-ours", nonce, 2).is_err());
    let e = Segment::attach(&seg.name(), [nonce[0], nonce[1] ^ 1], 2)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("nonce"), "{e}");
    assert!(
        Segment::attach(&seg.name(), nonce, 3).is_err(),
        "a different world size"
    );
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(seg.path(), std::fs::Permissions::from_mode(0o644)).unwrap();
    let e = Segment::attach(&seg.name(), nonce, 2)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("owner-only"), "{e}");
}

#[test]
fn stale_segments_of_dead_processes_are_removed_and_live_ones_kept() {
    // A pid above the kernel's maximum never runs; this process's own name is live.
    let dead = std::path::Path::new(segment::SHM_DIR)
        .join(format!("{}4194305-1-deadbeef", segment::PREFIX));
    std::fs::write(&dead, b"x").unwrap();
    // A shared buffer's file left by a killed job is named the same way (its maker first).
    let dead_buffer = shared::path_for("hearth-1-2-cafe", 4194305, 1, 3, 1);
    std::fs::write(&dead_buffer, b"x").unwrap();
    let live = Segment::create(2, 4096, 8192).unwrap();
    // (Not its count: a job forming in a concurrent test may have removed them first.)
    remove_stale();
    assert!(!dead.exists() && !dead_buffer.exists());
    assert!(live.path().exists());
}

#[test]
fn buffers_of_different_lengths_are_an_error_on_every_rank_and_the_group_goes_on() {
    let ranks = ShmTransport::group(3, &small()).unwrap();
    let got = each(ranks, |comm| {
        // Rank 1 passes one value fewer (and rank 2 none at all in the second round).
        let short = [
            5000 - usize::from(comm.rank() == 1),
            if comm.rank() == 2 { 0 } else { 10 },
        ];
        let errors: Vec<String> = short
            .iter()
            .map(|&len| {
                let mut v = vec![1.0f32; len];
                comm.allreduce(&mut v, ReduceOp::Sum)
                    .unwrap_err()
                    .to_string()
            })
            .collect();
        // Equal lengths work again afterwards.
        let mut v = vec![1.0f32; 10];
        comm.allreduce(&mut v, ReduceOp::Sum).unwrap();
        (errors, v)
    });
    for (errors, v) in got {
        for e in &errors {
            assert!(e.contains("same length"), "{e}");
        }
        assert_eq!(v, vec![3.0; 10]);
    }
}

#[test]
fn pipes_carry_thousands_of_messages_from_concurrent_senders_intact() {
    // Two ranks, two sender threads each (two kinds), sizes from 0 to 70 KB through a one-page
    // ring: every message wraps, writers block, and each byte is checked on arrival.
    use crate::wire::Kind;
    let body = |from: usize, k: usize, i: u64| -> Vec<u8> {
        let len = ((i * 7919 + k as u64 * 13) % 70_000) as usize;
        (0..len)
            .map(|j| (j as u64 ^ i ^ (from as u64 * 31 + k as u64)) as u8)
            .collect()
    };
    let ranks: Vec<Arc<ShmTransport>> = ShmTransport::group(2, &small())
        .unwrap()
        .into_iter()
        .map(Arc::new)
        .collect();
    let mut handles = Vec::new();
    for me in 0..2 {
        for (k, kind) in [Kind::User, Kind::Metric].into_iter().enumerate() {
            let (t, to) = (ranks[me].clone(), 1 - me);
            handles.push(std::thread::spawn(move || {
                for i in 0..400u64 {
                    t.send(to, kind, i, body(me, k, i)).unwrap();
                }
            }));
            let (t, from) = (ranks[to].clone(), me);
            handles.push(std::thread::spawn(move || {
                for i in (0..400u64).rev() {
                    let got = t.recv(from, kind, i, soon()).unwrap();
                    assert!(got == body(from, k, i), "from {from} kind {k} message {i}");
                }
            }));
        }
    }
    for h in handles {
        h.join().expect("a sender or receiver failed");
    }
}

#[test]
fn the_slot_size_is_the_one_asked_for_else_chosen_by_ranks_per_core() {
    let asked = ShmOptions {
        slot_bytes: 8192,
        ..small()
    };
    assert_eq!(asked.slot_bytes_for(1000), 8192);
    let auto = ShmOptions {
        slot_bytes: 0,
        ..small()
    };
    assert_eq!(auto.slot_bytes_for(1), 1 << 20);
    // More ranks than any machine has cores: the smaller slot, which two ranks sharing a
    // core's cache keep there.
    assert_eq!(auto.slot_bytes_for(1 << 20), 256 << 10);
}

#[test]
fn the_chain_is_the_one_asked_for_else_chosen_by_ranks_per_core() {
    let auto = ShmOptions {
        chain: None,
        ..small()
    };
    assert!(!auto.chain_for(1));
    assert!(auto.chain_for(1 << 20));
    for asked in [false, true] {
        let o = ShmOptions {
            chain: Some(asked),
            ..small()
        };
        assert_eq!(o.chain_for(1), asked);
        assert_eq!(o.chain_for(1 << 20), asked);
    }
}
