//! Every decoder of what arrives from a peer, fed seeded random and mutated inputs (the valid
//! encodings with bytes flipped, cut, extended, or a length field set to an extreme): each
//! input decodes to a value or an error, never a panic. Bounded (a fixed number of inputs per
//! format), so the suite runs it every time; `HEARTH_FUZZ_INPUTS` raises the number for a
//! longer run.

use burn_dist::elastic::join::Reply as JoinReply;
use burn_dist::elastic::reform::Announcement;
use burn_dist::fuzz::{Rng, inputs};
use burn_dist::ps::message::{Op, Reply, Request, RoundSet, ShardState};
use burn_dist::wire::{Header, Kind, decode_frame, encode_frame};

fn count() -> usize {
    std::env::var("HEARTH_FUZZ_INPUTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000)
}

/// Runs `decode` on every input from `seeds`; a panic names the format and the input.
fn fuzz(name: &str, seed: u64, seeds: Vec<Vec<u8>>, decode: impl Fn(&[u8]) -> bool) {
    // The seeds themselves decode.
    for s in &seeds {
        assert!(decode(s), "{name}: a valid encoding was refused: {s:?}");
    }
    let mut rng = Rng::new(seed);
    let mut refused = 0;
    for input in inputs(&seeds, count(), &mut rng) {
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| decode(&input)));
        match outcome {
            Ok(true) => {}
            Ok(false) => refused += 1,
            Err(_) => panic!("{name}: decoding panicked on {input:?}"),
        }
    }
    // The mutations reach the checks: most inputs are refused, not all accepted.
    assert!(
        refused > count() / 4,
        "{name}: only {refused} inputs refused"
    );
}

#[test]
fn frame_headers() {
    let frame = encode_frame(&Header::new(Kind::Collective, 3, 7, 5), &[1, 2, 3, 4, 5]);
    fuzz("frame", 1, vec![frame], |b| {
        Header::decode(b).is_ok() && decode_frame(b).is_ok()
    });
}

#[test]
fn parameter_server_requests_replies_and_states() {
    let push = Request {
        op: Op::PushDelta,
        clock: 3,
        version: 9,
        samples: 16,
        values: vec![1.0, -2.5],
        cut: Vec::new(),
    };
    let cut = Request {
        op: Op::Cut,
        clock: 0,
        version: 0,
        samples: 0,
        values: Vec::new(),
        cut: vec![(1, 7), (2, 9)],
    };
    fuzz("ps request", 2, vec![push.encode(), cut.encode()], |b| {
        Request::decode(b, 2).is_ok()
    });
    let state = ShardState {
        version: 4,
        values: vec![1.0, 2.0],
        optim_state: vec![0.5, 0.25, 0.0, 1.0],
    };
    let replies = vec![
        Reply::Values {
            version: 2,
            values: vec![3.0, 4.0],
        }
        .encode(),
        Reply::Refused("no".into()).encode(),
        Reply::Clocks(vec![(0, 1), (1, 2)]).encode(),
        Reply::State(state.clone()).encode(),
    ];
    fuzz("ps reply", 3, replies, |b| Reply::decode(b, 2).is_ok());
    fuzz("shard state", 4, vec![state.encode()], |b| {
        ShardState::decode(b, None).is_ok()
    });
    let sets = vec![
        RoundSet {
            round: 7,
            workers: vec![0, 2],
            last: false,
        }
        .encode(),
        RoundSet {
            round: 7,
            workers: Vec::new(),
            last: true,
        }
        .encode(),
    ];
    fuzz("sync round set", 9, sets, |b| {
        RoundSet::decode(b, 4).is_ok()
    });
}

#[test]
fn elastic_announcements_and_join_replies() {
    let a = Announcement {
        epoch: 3,
        coordinator: "127.0.0.1:4000".into(),
        members: vec![Some(0), None, Some(2)],
    };
    fuzz("announcement", 5, vec![a.encode()], |b| {
        Announcement::decode(b).is_ok()
    });
    let replies = vec![
        JoinReply::Redirect("127.0.0.1:5000".into()).encode(),
        JoinReply::Admit {
            rank: 1,
            announcement: a,
        }
        .encode(),
        JoinReply::Refused("full".into()).encode(),
        JoinReply::Retry.encode(),
    ];
    fuzz("join reply", 6, replies, |b| JoinReply::decode(b).is_ok());
}
