//! One conformance suite for every [`Transport`]: call `run` with a connected set of ranks,
//! one per thread. Each check fails loudly instead of hanging (every receive has a deadline).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Transport;
use crate::DistError;
use crate::wire::Kind;

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

/// Runs the suite on `ranks` (all ranks of one world, each used from its own thread).
pub fn run(ranks: Vec<Arc<dyn Transport>>) {
    let world = ranks.len();
    assert!(world >= 2, "the conformance suite needs at least 2 ranks");
    let handles: Vec<_> = ranks
        .into_iter()
        .map(|t| std::thread::spawn(move || check_rank(t.as_ref())))
        .collect();
    for h in handles {
        match h.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("conformance: {e}"),
            Err(_) => panic!("conformance: a rank panicked"),
        }
    }
}

fn check_rank(t: &dyn Transport) -> Result<(), String> {
    let (me, world) = (t.rank(), t.world());
    let err = |e: DistError| format!("rank {me}: {e}");
    // 1. Every pair exchanges a message; tags are sent in reverse so matching, not order, counts.
    for peer in (0..world).filter(|&p| p != me) {
        for tag in (0..3u64).rev() {
            let payload = format!("{me}->{peer}#{tag}").into_bytes();
            t.send(peer, Kind::User, tag, payload).map_err(err)?;
        }
    }
    for peer in (0..world).filter(|&p| p != me) {
        for tag in 0..3u64 {
            let got = t.recv(peer, Kind::User, tag, deadline()).map_err(err)?;
            let want = format!("{peer}->{me}#{tag}").into_bytes();
            if got != want {
                return Err(format!(
                    "rank {me}: from {peer} tag {tag} got {:?}",
                    String::from_utf8_lossy(&got)
                ));
            }
        }
    }
    // 2. Kinds are separate spaces; empty and large payloads arrive intact.
    let next = (me + 1) % world;
    let prev = (me + world - 1) % world;
    let big: Vec<u8> = (0..(3 << 20) + 5).map(|i| (i * 7 + me) as u8).collect();
    t.send(next, Kind::Collective, 9, big).map_err(err)?;
    t.send(next, Kind::Metric, 9, Vec::new()).map_err(err)?;
    let empty = t.recv(prev, Kind::Metric, 9, deadline()).map_err(err)?;
    if !empty.is_empty() {
        return Err(format!(
            "rank {me}: empty payload arrived with {} bytes",
            empty.len()
        ));
    }
    let got = t.recv(prev, Kind::Collective, 9, deadline()).map_err(err)?;
    let want: Vec<u8> = (0..(3 << 20) + 5).map(|i| (i * 7 + prev) as u8).collect();
    if got != want {
        return Err(format!("rank {me}: large payload from {prev} corrupted"));
    }
    // 3. A receive nobody answers times out at its deadline, naming the rank.
    let started = Instant::now();
    match t.recv(
        prev,
        Kind::User,
        999,
        Instant::now() + Duration::from_millis(200),
    ) {
        Err(DistError::Timeout { rank, .. }) if rank == prev => {}
        other => {
            return Err(format!(
                "rank {me}: expected a timeout naming {prev}, got {other:?}"
            ));
        }
    }
    if started.elapsed() > Duration::from_secs(5) {
        return Err(format!(
            "rank {me}: a 200 ms deadline took {:?}",
            started.elapsed()
        ));
    }
    // 4. Sending to oneself or outside the world is an error, not a hang.
    if t.send(me, Kind::User, 0, vec![]).is_ok() || t.send(world, Kind::User, 0, vec![]).is_ok() {
        return Err(format!(
            "rank {me}: sending to itself or rank {world} succeeded"
        ));
    }
    // 5. recv_any: rank 0 hears every other rank once, whatever the order, each with its
    //    sender; an empty set of ranks is an error.
    if me == 0 {
        let mut left: Vec<usize> = (1..world).collect();
        while !left.is_empty() {
            let (from, got) = t.recv_any(&left, Kind::User, 77, deadline()).map_err(err)?;
            if got != format!("any {from}").into_bytes() || !left.contains(&from) {
                return Err(format!(
                    "rank 0: recv_any gave {:?} from {from}",
                    String::from_utf8_lossy(&got)
                ));
            }
            left.retain(|&r| r != from);
        }
        if t.recv_any(&[], Kind::User, 77, deadline()).is_ok() {
            return Err("rank 0: recv_any from no rank succeeded".into());
        }
    } else {
        t.send(0, Kind::User, 77, format!("any {me}").into_bytes())
            .map_err(err)?;
    }
    // Stay until every rank is done receiving (a last round of messages).
    for peer in (0..world).filter(|&p| p != me) {
        t.send(peer, Kind::Control, u64::MAX, vec![1])
            .map_err(err)?;
    }
    for peer in (0..world).filter(|&p| p != me) {
        t.recv(peer, Kind::Control, u64::MAX, deadline())
            .map_err(err)?;
    }
    Ok(())
}
