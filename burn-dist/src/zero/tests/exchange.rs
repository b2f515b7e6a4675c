//! The gradients reduced during the backward (`ShardedExchange`) against the reduction after it.

use super::*;

/// Rank `r`'s gradient of the 23 values, and the order it hands its tensors over in: the
/// ranks' rhythms differ (one at a time from the last, all at once in module order, a pair
/// then one, tensor 0 never handed over: counted as zero).
fn handed(r: usize) -> (Vec<f32>, Vec<Vec<usize>>) {
    let mut g = grad(r, 0, &start_values());
    let order = match r % 3 {
        0 => vec![vec![3], vec![2], vec![1], vec![0]],
        1 => vec![vec![0, 1, 2, 3]],
        _ => {
            g[..7].fill(0.0);
            vec![vec![3, 2], vec![1]]
        }
    };
    (g, order)
}

#[test]
fn gradients_handed_over_in_any_rhythm_reduce_as_after_the_backward() {
    let offsets = vec![0, 7, 9, 20, 23];
    for (world, stage, replica) in [
        (2, Stage::One, false),
        (2, Stage::Two, false),
        (3, Stage::Two, false),
        (3, Stage::One, true),
        (3, Stage::Two, true),
    ] {
        let handles: Vec<_> = MemoryTransport::mesh(world)
            .into_iter()
            .map(|t| {
                let offsets = offsets.clone();
                thread::spawn(move || {
                    let comm = Arc::new(rank_comm(t));
                    let o = optimizer(Update::adam());
                    // Buckets of 10 values: [a.weight, a.bias], [b.weight], [b.bias].
                    let mut z = ZeroOptimizer::new(stage, &tensors(), o, &comm, 40).unwrap();
                    if replica {
                        z = z.with_replica();
                    }
                    let (g, order) = handed(comm.rank());
                    let values = start_values();
                    let mut source = FlatSource {
                        grad: &g,
                        values: &values,
                        offsets: offsets.clone(),
                    };
                    let want = z.reduce_gradients(&comm, &mut source).unwrap();
                    let x = overlap::ShardedExchange::start(comm.clone(), z.reducer()).unwrap();
                    for batch in order {
                        let tensors = batch
                            .into_iter()
                            .map(|t| (t, g[offsets[t]..offsets[t + 1]].to_vec()))
                            .collect();
                        x.submit(tensors);
                    }
                    let got = x.finish().unwrap();
                    (want, got)
                })
            })
            .collect();
        for (r, h) in handles.into_iter().enumerate() {
            let (want, got) = h.join().unwrap();
            let case = format!("world {world}, {stage:?}, replica {replica}, rank {r}");
            assert_eq!(got.grads, want.grads, "{case}");
            assert_eq!(got.theirs, want.theirs, "{case}");
            assert_eq!(got.buckets(), 3, "{case}");
            assert!(got.finite, "{case}");
        }
    }
}

#[test]
fn a_bad_hand_over_fails_the_exchange_naming_the_tensor() {
    let cases: [(Vec<(usize, usize)>, &str); 3] = [
        (vec![(4, 3)], "tensor 4 handed over, of 4"),
        (
            vec![(1, 3)],
            "tensor 1's gradient has 3 values, its parameter 2",
        ),
        (
            vec![(3, 3), (3, 3)],
            "tensor 3's gradient was handed over twice",
        ),
    ];
    for (batch, want) in cases {
        let t = MemoryTransport::mesh(1).pop().unwrap();
        let comm = Arc::new(rank_comm(t));
        let z = ZeroOptimizer::new(Stage::Two, &tensors(), optimizer(Update::adam()), &comm, 40)
            .unwrap();
        let x = overlap::ShardedExchange::start(comm, z.reducer()).unwrap();
        x.submit(batch.into_iter().map(|(t, n)| (t, vec![1.0; n])).collect());
        let e = x.finish().unwrap_err().to_string();
        assert!(e.contains(want), "{e}");
    }
    // Handed over again after its bucket was reduced (a whole tensor, then a piece of a tensor
    // cut by rows): an error naming it, not a panic of the exchange.
    let t = MemoryTransport::mesh(1).pop().unwrap();
    let comm = Arc::new(rank_comm(t));
    let z = ZeroOptimizer::new(
        Stage::Three,
        &tensors(),
        optimizer(Update::adam()),
        &comm,
        16,
    )
    .unwrap()
    .cut_rows(&[(2, 1)])
    .unwrap();
    for (first, again, want) in [
        (
            Some(3),
            Some(3),
            "tensor 3's gradient was handed over twice",
        ),
        (
            None,
            None,
            "tensor 2 from value 4's gradient was handed over twice",
        ),
    ] {
        let x = overlap::ShardedExchange::start(comm.clone(), z.reducer()).unwrap();
        for t in [first, again] {
            match t {
                Some(t) => x.submit(vec![(t, vec![1.0; 3])]),
                None => x.submit_piece(2, 4, vec![1.0; 4]),
            }
        }
        let e = x.finish().unwrap_err().to_string();
        assert!(e.contains(want), "{e}");
    }
}

/// A tensor cut into pieces of rows: its gradient handed over whole, or a piece at a time in
/// any order, reduces as the step's own reduction does.
#[test]
fn pieces_handed_over_whole_or_one_by_one_reduce_as_after_the_backward() {
    let offsets = vec![0, 7, 9, 20, 23];
    let handles: Vec<_> = MemoryTransport::mesh(2)
        .into_iter()
        .map(|t| {
            let offsets = offsets.clone();
            thread::spawn(move || {
                let comm = Arc::new(rank_comm(t));
                let (z, g, want) = cut_in_pieces(&comm, &offsets);
                let part = |t: usize| g[offsets[t]..offsets[t + 1]].to_vec();
                let whole = overlap::ShardedExchange::inline(comm.clone(), z.reducer());
                whole.submit(vec![(3, part(3)), (2, part(2))]);
                whole.submit(vec![(0, part(0)), (1, part(1))]);
                let whole = whole.finish().unwrap();
                let pieces = overlap::ShardedExchange::start(comm.clone(), z.reducer()).unwrap();
                pieces.submit(vec![(3, part(3))]);
                for at in [8, 0, 4] {
                    let end = (at + 4).min(11);
                    pieces.submit_piece(2, at, g[9 + at..9 + end].to_vec());
                }
                pieces.submit(vec![(1, part(1)), (0, part(0))]);
                let pieces = pieces.finish().unwrap();
                // A piece that is not one, and one handed over twice.
                let bad = overlap::ShardedExchange::inline(comm.clone(), z.reducer());
                bad.submit_piece(2, 1, vec![0.0; 4]);
                let e = bad.finish().unwrap_err().to_string();
                assert!(e.contains("values 1..5 of tensor 2"), "{e}");
                (want, whole, pieces, e)
            })
        })
        .collect();
    for (r, h) in handles.into_iter().enumerate() {
        let (want, whole, pieces, _) = h.join().unwrap();
        assert_eq!(whole.grads, want.grads, "rank {r}: whole");
        assert_eq!(pieces.grads, want.grads, "rank {r}: pieces");
        assert_eq!(want.buckets(), 6);
    }
}

/// The exchange thread takes gradients under a budget of two of its largest buckets: a
/// backward that hands them over faster than they are reduced waits instead of piling them
/// up. Rank 1 hands over 6 gradients while rank 0 has not started: the first 4 fit (56 of
/// the 56 bytes of two 7-value buckets), the 5th waits until rank 0's hand-overs let the
/// reductions go on, and then the result is the reduction after the backward.
#[test]
fn a_hand_over_waits_while_the_exchange_thread_is_two_buckets_behind() {
    use std::sync::mpsc::channel;
    use std::time::Duration;
    let offsets = vec![0, 7, 9, 20, 23];
    let (done_tx, done_rx) = channel();
    let (go_tx, go_rx) = channel::<()>();
    let mut go_rx = Some(go_rx);
    let handles: Vec<_> = MemoryTransport::mesh(2)
        .into_iter()
        .map(|t| {
            let offsets = offsets.clone();
            let done_tx = done_tx.clone();
            let go_rx = go_rx.take();
            thread::spawn(move || {
                let comm = Arc::new(rank_comm(t));
                let (z, g, want) = cut_in_pieces(&comm, &offsets);
                if let Some(go) = go_rx {
                    go.recv_timeout(Duration::from_secs(30)).unwrap();
                }
                let part = |t: usize| g[offsets[t]..offsets[t + 1]].to_vec();
                let x = overlap::ShardedExchange::start(comm.clone(), z.reducer()).unwrap();
                for (k, at) in [0, 4, 8].into_iter().enumerate() {
                    let end = (at + 4).min(11);
                    x.submit_piece(2, at, g[9 + at..9 + end].to_vec());
                    let _ = done_tx.send((comm.rank(), k));
                }
                for (k, t) in [3, 1, 0].into_iter().enumerate() {
                    x.submit(vec![(t, part(t))]);
                    let _ = done_tx.send((comm.rank(), 3 + k));
                }
                (want, x.finish().unwrap())
            })
        })
        .collect();
    let wait = Duration::from_secs(30);
    for k in 0..4 {
        assert_eq!(
            done_rx.recv_timeout(wait),
            Ok((1, k)),
            "rank 1's hand-over {k}"
        );
    }
    assert!(
        done_rx.recv_timeout(Duration::from_millis(300)).is_err(),
        "the 5th hand-over waits: 64 bytes would be queued against 56"
    );
    go_tx.send(()).unwrap();
    let mut rest: Vec<(usize, usize)> = (0..8)
        .map(|_| done_rx.recv_timeout(wait).expect("the hand-overs go on"))
        .collect();
    rest.sort();
    assert_eq!(
        rest,
        [
            (0, 0),
            (0, 1),
            (0, 2),
            (0, 3),
            (0, 4),
            (0, 5),
            (1, 4),
            (1, 5)
        ]
    );
    for (r, h) in handles.into_iter().enumerate() {
        let (want, got) = h.join().unwrap();
        assert_eq!(got.grads, want.grads, "rank {r}");
    }
}

/// Stage 3 in buckets of 4 values (a.weight's 7 alone), b.weight cut into pieces of 4, 4 and
/// 3 values: the optimizer, this rank's gradient and its reduction after the backward.
fn cut_in_pieces(
    comm: &Communicator,
    offsets: &[usize],
) -> (ZeroOptimizer, Vec<f32>, crate::zero::ReducedGradients) {
    let o = optimizer(Update::adam());
    let z = ZeroOptimizer::new(Stage::Three, &tensors(), o, comm, 16).unwrap();
    let z = z.cut_rows(&[(2, 1)]).unwrap();
    let g = grad(comm.rank(), 0, &start_values());
    let values = start_values();
    let mut source = FlatSource {
        grad: &g,
        values: &values,
        offsets: offsets.to_vec(),
    };
    let want = z.reduce_gradients(comm, &mut source).unwrap();
    (z, g, want)
}
