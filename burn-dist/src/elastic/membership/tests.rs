#[test]
fn only_one_side_of_any_split_holds_a_quorum() {
    assert_eq!(quorum(3, &[], &[2]), Ok(()));
    assert_eq!(quorum(3, &[], &[0, 1]), Err(2), "the cut-off third");
    assert_eq!(quorum(1, &[], &[]), Ok(()));
    assert_eq!(quorum(1, &[], &[0]), Err(1));
    // A tie goes to the half holding rank 0.
    assert_eq!(quorum(2, &[], &[1]), Ok(()));
    assert_eq!(quorum(2, &[], &[0]), Err(2));
    assert_eq!(quorum(4, &[], &[2, 3]), Ok(()));
    assert_eq!(quorum(4, &[], &[0, 3]), Err(3));
    // Duplicates and ranks outside the world count once or not at all.
    assert_eq!(quorum(3, &[], &[2, 2, 7]), Ok(()));
    // Every split of worlds up to 8: never both sides.
    for world in 1..=8usize {
        for mask in 0u32..(1 << world) {
            let a: Vec<usize> = (0..world).filter(|r| mask & (1 << r) != 0).collect();
            let b: Vec<usize> = (0..world).filter(|r| mask & (1 << r) == 0).collect();
            // Side A lost B's members and the other way round.
            let both = quorum(world, &[], &b).is_ok() && quorum(world, &[], &a).is_ok();
            assert!(!both, "world {world}: {a:?} and {b:?} both hold a quorum");
        }
    }
}

#[test]
fn a_graceful_leaver_counts_toward_neither_side_of_a_split() {
    // Issue 55's case: in a world of 3, w2 leaves, then w0 and w1 split. Counting the
    // leaver as nobody's loss, each side saw one of three lost and both passed.
    assert_eq!(quorum(3, &[2], &[1]), Ok(()), "w0: the tie-breaker's half");
    assert_eq!(quorum(3, &[2], &[0]), Err(2), "w1");
    // Rank 0 left: the lowest that stayed breaks ties.
    assert_eq!(quorum(3, &[0], &[2]), Ok(()), "w1 holds the tie");
    assert_eq!(quorum(3, &[0], &[1]), Err(2), "w2");
    // Everyone left or was lost: nobody forms a world.
    assert_eq!(quorum(2, &[0, 1], &[]), Err(1));
    // Every world up to 7, every set of leavers, every split of those who stayed, and
    // each side having heard of all the leaves or of none (a leave it missed is a loss to
    // it): never both sides.
    for world in 1..=7usize {
        for leave_mask in 0u32..(1 << world) {
            let left: Vec<usize> = (0..world).filter(|r| leave_mask & (1 << r) != 0).collect();
            let stayed: Vec<usize> = (0..world).filter(|r| !left.contains(r)).collect();
            for mask in 0u32..(1 << stayed.len()) {
                let (mut a, mut b) = (Vec::new(), Vec::new());
                for (i, &r) in stayed.iter().enumerate() {
                    if mask & (1 << i) != 0 {
                        a.push(r)
                    } else {
                        b.push(r)
                    }
                }
                for (a_heard, b_heard) in [(true, true), (true, false), (false, true)] {
                    let view = |heard: bool, other: &[usize]| {
                        let mut lost = other.to_vec();
                        let left = if heard {
                            left.clone()
                        } else {
                            lost.extend(&left);
                            Vec::new()
                        };
                        quorum(world, &left, &lost).is_ok()
                    };
                    assert!(
                        !(view(a_heard, &b) && view(b_heard, &a)),
                        "world {world}, left {left:?}: {a:?} and {b:?} both hold a quorum"
                    );
                }
            }
        }
    }
}
use super::*;

fn w(id: &str, host: &str) -> Worker {
    Worker {
        id: id.into(),
        host: host.into(),
    }
}

fn ids(e: &Epoch) -> Vec<&str> {
    e.members.iter().map(|m| m.id.as_str()).collect()
}

fn limits(min: usize, max: usize) -> Limits {
    Limits {
        min,
        max,
        rejoin_timeout: Duration::from_secs(30),
        blacklist_after: 2,
        blacklist_window: Duration::from_secs(60),
        cooldown: Duration::from_secs(100),
    }
}

fn change(d: Decision) -> (Epoch, Vec<Worker>, Vec<Worker>) {
    match d {
        Decision::Change {
            epoch,
            joined,
            lost,
        } => (epoch, joined, lost),
        other => panic!("expected a change, got {other:?}"),
    }
}

#[test]
fn a_successor_coordinator_keeps_the_blacklist_and_failure_counts() {
    let t = Instant::now();
    let members = vec![w("a", "h1"), w("b", "h2"), w("c", "h3")];
    let mut first = Membership::new(limits(1, 4), members.clone());
    // h2 fails twice: blacklisted for 100 s. h3 once: one more and it is too.
    first.lost("b", t);
    change(first.decide(t));
    first.hello(w("b2", "h2"), t).unwrap();
    change(first.decide(t));
    first.lost("b2", t);
    change(first.decide(t));
    assert!(matches!(
        first.hello(w("b3", "h2"), t),
        Err(Refusal::Blacklisted { .. })
    ));
    first.lost("c", t);
    let health = first.health(t + Duration::from_secs(10));
    assert_eq!(health.blacklist, vec![("h2".to_string(), 90.0)]);
    assert_eq!(health.failures, vec![("h3".to_string(), vec![10.0])]);

    // The first coordinator dies; "a"'s successor was sent its health with the state.
    let later = t + Duration::from_secs(10);
    let mut next = Membership::new(limits(1, 4), members);
    next.restore_health(&health, later);
    assert!(
        matches!(
            next.hello(w("b3", "h2"), later),
            Err(Refusal::Blacklisted { .. })
        ),
        "the blacklist survives its coordinator"
    );
    next.lost("c", later);
    assert!(
        matches!(
            next.hello(w("c2", "h3"), later),
            Err(Refusal::Blacklisted { .. })
        ),
        "h3's earlier failure still counts"
    );
    // After the cooldown h2 is welcome again.
    let after = later + Duration::from_secs(91);
    assert_eq!(next.health(after).blacklist.len(), 1, "only h3 left");
    next.hello(w("b4", "h2"), after).unwrap();
}

#[test]
fn survivors_keep_their_order_and_joiners_come_after_them() {
    let t = Instant::now();
    let mut m = Membership::new(limits(1, 4), vec![w("a", "h1"), w("b", "h2"), w("c", "h3")]);
    assert_eq!(m.decide(t), Decision::Continue);
    // Rank 0 dies: the lowest survivor becomes rank 0 of the next epoch.
    m.lost("a", t);
    m.hello(w("d", "h4"), t).unwrap();
    let (epoch, joined, lost) = change(m.decide(t));
    assert_eq!(epoch.number, 1);
    assert_eq!(ids(&epoch), vec!["b", "c", "d"]);
    assert_eq!(joined, vec![w("d", "h4")]);
    assert_eq!(lost, vec![w("a", "h1")]);
    assert_eq!(m.decide(t), Decision::Continue);
}

#[test]
fn joins_stop_at_the_maximum_and_wait_for_room() {
    let t = Instant::now();
    let mut m = Membership::new(limits(1, 2), vec![w("a", "h1")]);
    m.hello(w("b", "h2"), t).unwrap();
    m.hello(w("c", "h3"), t).unwrap();
    let (epoch, _, _) = change(m.decide(t));
    assert_eq!(ids(&epoch), vec!["a", "b"]);
    assert_eq!(m.decide(t), Decision::Continue, "c waits: no room");
    m.leave("a");
    let (epoch, joined, _) = change(m.decide(t));
    assert_eq!(ids(&epoch), vec!["b", "c"]);
    assert_eq!(joined, vec![w("c", "h3")]);
    assert_eq!(
        m.hello(w("b", "h2"), t),
        Err(Refusal::Duplicate { id: "b".into() })
    );
}

#[test]
fn below_the_minimum_it_waits_for_joiners_then_gives_up() {
    let t = Instant::now();
    let s = Duration::from_secs;
    let mut m = Membership::new(limits(2, 4), vec![w("a", "h1"), w("b", "h2")]);
    m.lost("b", t);
    assert!(matches!(
        m.decide(t),
        Decision::Wait {
            have: 1,
            need: 2,
            ..
        }
    ));
    // A joiner within the timeout restores the job.
    m.hello(w("c", "h3"), t + s(10)).unwrap();
    let (epoch, _, _) = change(m.decide(t + s(10)));
    assert_eq!(ids(&epoch), vec!["a", "c"]);
    // Short again, and nobody comes.
    m.lost("c", t + s(20));
    assert!(matches!(m.decide(t + s(20)), Decision::Wait { .. }));
    let Decision::GiveUp { have, need, waited } = m.decide(t + s(51)) else {
        panic!("expected to give up")
    };
    assert_eq!((have, need), (1, 2));
    assert!(waited >= s(30));
}

#[test]
fn a_host_that_keeps_failing_is_refused_for_a_cooldown() {
    let t = Instant::now();
    let s = Duration::from_secs;
    let mut m = Membership::new(limits(1, 4), vec![w("a", "h1"), w("b1", "flaky")]);
    m.lost("b1", t);
    m.decide(t);
    m.hello(w("b2", "flaky"), t).unwrap();
    m.decide(t);
    m.lost("b2", t + s(5));
    m.decide(t + s(5));
    let refused = m.hello(w("b3", "flaky"), t + s(6));
    assert!(
        matches!(refused, Err(Refusal::Blacklisted { .. })),
        "{refused:?}"
    );
    // After the cooldown it may come back.
    m.hello(w("b4", "flaky"), t + s(106)).unwrap();
    let (epoch, _, _) = change(m.decide(t + s(106)));
    assert_eq!(ids(&epoch), vec!["a", "b4"]);
}

#[test]
fn fifty_random_joins_and_leaves_keep_a_consistent_membership() {
    let t = Instant::now();
    let mut m = Membership::new(limits(1, 4), vec![w("w0", "h0")]);
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next_id = 1;
    let mut changes = 0;
    for event in 0..50u64 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let now = t + Duration::from_secs(event);
        let members: Vec<String> = m.current().members.iter().map(|w| w.id.clone()).collect();
        if state.is_multiple_of(2) || members.len() == 1 {
            let _ = m.hello(w(&format!("w{next_id}"), &format!("h{next_id}")), now);
            next_id += 1;
        } else {
            let victim = &members[(state as usize / 2) % members.len()];
            if state.is_multiple_of(3) {
                m.leave(victim);
            } else {
                m.lost(victim, now);
            }
        }
        let before = m.current().number;
        match m.decide(now) {
            Decision::Change { epoch, .. } => {
                changes += 1;
                assert_eq!(epoch.number, before + 1);
                assert!(!epoch.members.is_empty() && epoch.members.len() <= 4);
                let mut seen: Vec<&str> = ids(&epoch);
                seen.sort();
                seen.dedup();
                assert_eq!(seen.len(), epoch.members.len(), "no worker twice");
            }
            Decision::Continue => assert_eq!(m.current().number, before),
            other => panic!("with min 1 there is always a member: {other:?}"),
        }
    }
    assert!(changes > 20, "the soak changed membership {changes} times");
}
