//! Buffers every rank maps (`shm::shared`): made, found, summed and broadcast in place, their
//! failures, and `Communicator::reduce_buffer` over every kind of transport.

use super::*;

/// `world` local groups over one new segment (unlinked), barriers rather than a chain, and
/// the segment's name (its buffers' files carry its tag).
fn local_groups(world: usize) -> (String, Vec<LocalGroup>) {
    let o = small();
    let seg = Arc::new(Segment::create(world, o.ring_bytes, o.slot_bytes).unwrap());
    seg.set_chain(false);
    let name = seg.name();
    let groups = (0..world)
        .map(|r| {
            let s = if r == 0 {
                seg.clone()
            } else {
                Arc::new(Segment::attach(&name, seg.nonce(), world).unwrap())
            };
            s.register(r);
            LocalGroup::new(s, r, (0..world).map(|m| 10 + m).collect(), o.stale)
        })
        .collect();
    seg.unlink().unwrap();
    (name, groups)
}

/// Files in /dev/shm carrying segment `name`'s tag.
fn files_of(name: &str) -> Vec<String> {
    let tag = name.rsplit('-').next().unwrap().to_string();
    std::fs::read_dir(segment::SHM_DIR)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(&tag))
        .collect()
}

#[test]
fn shared_buffers_are_summed_in_place_in_rank_order_and_leave_no_file() {
    // Barriers, not a chain: from 3 ranks on the slots' order differs ((x2 + x0) + x1 for rank
    // 2's segment), so bit-for-bit rank order shows that the sum ran in place.
    for world in 2..=5 {
        let (name, groups) = local_groups(world);
        let len = 5000;
        let got = on_threads(groups, move |g| {
            let me = g.local_rank();
            let mut b = g.share(len, soon()).unwrap();
            assert!(b.iter().all(|&v| v == 0.0), "a new buffer is zeros");
            let fill = |b: &mut [f32]| {
                for (i, v) in b.iter_mut().enumerate() {
                    *v = ragged(me, i);
                }
            };
            fill(&mut b);
            g.reduce(&mut b, true, soon()).unwrap();
            let whole = b.to_vec();
            // A range at the same place on every rank: the rest of the buffer is untouched.
            fill(&mut b);
            g.reduce(&mut b[7..2007], true, soon()).unwrap();
            let range = b.to_vec();
            // Into the leader only.
            fill(&mut b);
            g.reduce(&mut b, false, soon()).unwrap();
            let leader = b.to_vec();
            // A broadcast of a range from the last rank, in place.
            fill(&mut b);
            g.broadcast(&mut b[100..4100], world - 1, soon()).unwrap();
            (whole, range, leader, b.to_vec())
        });
        let sum = |i: usize| (1..world).fold(ragged(0, i), |acc, r| acc + ragged(r, i));
        let bits = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        let want: Vec<f32> = (0..len).map(sum).collect();
        for (r, (whole, range, leader, cast)) in got.iter().enumerate() {
            assert!(
                bits(whole, &want),
                "world {world} rank {r}: not the rank-order sum"
            );
            let own: Vec<f32> = (0..len).map(|i| ragged(r, i)).collect();
            assert!(
                bits(&range[7..2007], &want[7..2007]),
                "world {world} rank {r} range"
            );
            assert!(bits(&range[..7], &own[..7]) && bits(&range[2007..], &own[2007..]));
            if r == 0 {
                assert!(bits(leader, &want), "world {world}: the leader's sum");
            }
            let root: Vec<f32> = (0..len).map(|i| ragged(world - 1, i)).collect();
            assert!(
                bits(&cast[100..4100], &root[100..4100]),
                "world {world} rank {r} bcast"
            );
            assert!(bits(&cast[..100], &own[..100]) && bits(&cast[4100..], &own[4100..]));
        }
        assert!(files_of(&name).is_empty(), "{:?}", files_of(&name));
    }
}

#[test]
fn ranges_at_different_places_or_own_vectors_take_the_slots_and_sum_the_same() {
    let (_, groups) = local_groups(3);
    let got = on_threads(groups, |g| {
        let me = g.local_rank();
        let mut b = g.share(3000, soon()).unwrap();
        let mut own: Vec<f32> = (0..1000).map(|i| value(me, i)).collect();
        for (i, v) in b.iter_mut().enumerate() {
            *v = value(me, i % 1000);
        }
        // Rank 0 at 0, rank 1 at 10, rank 2 its own vector: no common place.
        let mut out = Vec::new();
        match me {
            0 => g.reduce(&mut b[0..1000], true, soon()).unwrap(),
            1 => g.reduce(&mut b[1000..2000], true, soon()).unwrap(),
            _ => g.reduce(&mut own, true, soon()).unwrap(),
        }
        out.push(match me {
            0 => b[0..1000].to_vec(),
            1 => b[1000..2000].to_vec(),
            _ => own.clone(),
        });
        // Then an older buffer on one rank and the latest on the others.
        let mut older = std::mem::replace(&mut b, g.share(1000, soon()).unwrap());
        for (i, v) in b.iter_mut().enumerate() {
            *v = value(me, i);
        }
        for (i, v) in older[..1000].iter_mut().enumerate() {
            *v = value(me, i);
        }
        if me == 2 {
            g.reduce(&mut older[..1000], true, soon()).unwrap();
            out.push(older[..1000].to_vec());
        } else {
            g.reduce(&mut b, true, soon()).unwrap();
            out.push(b.to_vec());
        }
        out
    });
    for (r, results) in got.iter().enumerate() {
        for (c, v) in results.iter().enumerate() {
            assert_eq!(v, &expected(3, 1000), "rank {r} call {c}");
        }
    }
}

#[test]
fn a_rank_that_cannot_make_its_buffer_fails_sharing_on_every_rank_and_the_group_goes_on() {
    let (name, groups) = local_groups(2);
    let me = segment::ProcessId::current();
    // A file already where rank 1's buffer goes: its creation fails (never an existing file).
    let blocker = shared::path_for(&name, me.pid, me.start_time, 1, 1);
    std::fs::write(&blocker, b"in the way").unwrap();
    let got = on_threads(groups, |g| {
        let first = g.share(100, soon()).map(|_| ()).unwrap_err();
        // The next attempt works, and its buffer sums.
        let mut b = g.share(100, soon()).unwrap();
        b.fill(g.local_rank() as f32 + 1.0);
        g.reduce(&mut b, true, soon()).unwrap();
        (first, b.to_vec())
    });
    std::fs::remove_file(&blocker).unwrap();
    let (e0, e1) = (&got[0].0, &got[1].0);
    assert!(
        matches!(e0, crate::DistError::PeerFailed { rank: 11, .. }),
        "{e0}"
    );
    assert!(
        e0.to_string()
            .contains("could not create its shared buffer"),
        "{e0}"
    );
    assert!(matches!(e1, crate::DistError::Io { .. }), "{e1}");
    assert!(e1.to_string().contains("creating"), "{e1}");
    for (_, sum) in &got {
        assert_eq!(sum, &vec![3.0; 100]);
    }
    assert!(files_of(&name).is_empty(), "{:?}", files_of(&name));
}

#[test]
fn a_rank_that_never_reduces_its_shared_buffer_times_out_the_other_naming_it() {
    let (_, groups) = local_groups(2);
    let got = on_threads(groups, |g| {
        let mut b = g.share(10_000, soon()).unwrap();
        if g.local_rank() == 1 {
            return None;
        }
        let started = Instant::now();
        let e = g
            .reduce(&mut b, true, Instant::now() + Duration::from_millis(500))
            .unwrap_err();
        Some((e, started.elapsed()))
    });
    let (e, took) = got[0].as_ref().unwrap();
    assert!(
        matches!(e, crate::DistError::Timeout { rank: 11, .. }),
        "{e}"
    );
    assert!(*took < Duration::from_secs(5), "{took:?}");
}

#[test]
fn reduce_buffers_are_shared_where_ranks_share_memory_and_sum_everywhere() {
    // One host of three; hosts of 2, 1 and 3 (the lone rank gets a vector); no shared memory.
    let one_host = ShmTransport::group(3, &small()).unwrap();
    let got = each(one_host, |comm| {
        let mut b = comm.reduce_buffer(4099).unwrap();
        for (i, v) in b.iter_mut().enumerate() {
            *v = value(comm.rank(), i);
        }
        comm.allreduce(&mut b, ReduceOp::Sum).unwrap();
        (b.is_shared(), b.to_vec())
    });
    for (shared, v) in got {
        assert!(shared);
        assert_eq!(v, expected(3, 4099));
    }
    let hosts = vec![0, 1, 0, 2, 2, 2];
    let got = each(hosted(&hosts), |comm| {
        let mut b = comm.reduce_buffer(4099).unwrap();
        for (i, v) in b.iter_mut().enumerate() {
            *v = value(comm.rank(), i);
        }
        comm.allreduce(&mut b, ReduceOp::Sum).unwrap();
        (b.is_shared(), b.to_vec())
    });
    for (r, (shared, v)) in got.iter().enumerate() {
        assert_eq!(*shared, r != 1, "rank {r}");
        assert_eq!(v, &expected(6, 4099), "rank {r}");
    }
    let got = each(MemoryTransport::mesh(2), |comm| {
        let mut b = comm.reduce_buffer(10).unwrap();
        b.fill(1.0);
        comm.allreduce(&mut b, ReduceOp::Sum).unwrap();
        (b.is_shared(), b.to_vec())
    });
    for (shared, v) in got {
        assert!(!shared);
        assert_eq!(v, vec![2.0; 10]);
    }
}
