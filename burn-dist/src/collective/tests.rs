//! Collectives on 1 to 8 ranks as threads over the in-memory transport, checked against sums
//! computed directly (in f64) from every rank's input.

use std::sync::Arc;
use std::time::Duration;

use super::{Communicator, Compression, ReduceOp};
use crate::transport::Transport;
use crate::transport::memory::MemoryTransport;

fn input(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((rank * 7919 + i * 104_729) % 1000) as f32 / 100.0 - 5.0)
        .collect()
}

fn expected_sum(world: usize, len: usize) -> Vec<f64> {
    (0..len)
        .map(|i| (0..world).map(|r| input(r, len)[i] as f64).sum())
        .collect()
}

/// Runs `f` on every rank of an in-memory world, each in a thread, with a join deadline.
pub(crate) fn on_ranks<T: Send + 'static>(
    world: usize,
    chunk: usize,
    compression: Compression,
    f: impl Fn(Communicator) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let (tx, rx) = std::sync::mpsc::channel();
    for t in MemoryTransport::mesh(world) {
        let (f, tx) = (f.clone(), tx.clone());
        std::thread::spawn(move || {
            let rank = t.rank();
            let comm = Communicator::new(Arc::new(t))
                .with_chunk_elems(chunk)
                .with_compression(compression)
                .with_timeout(Duration::from_secs(20));
            let _ = tx.send((rank, f(comm)));
        });
    }
    drop(tx);
    let mut out: Vec<Option<T>> = (0..world).map(|_| None).collect();
    for _ in 0..world {
        let (rank, v) = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("a rank hung or panicked");
        out[rank] = Some(v);
    }
    out.into_iter()
        .map(|v| v.expect("every rank reported"))
        .collect()
}

const SIZES: [usize; 7] = [0, 1, 2, 7, 13, 100, 1001];

#[test]
fn allreduce_sum_and_mean_match_direct_sums() {
    for world in 1..=8 {
        for &len in &SIZES {
            for chunk in [3, 64] {
                let results = on_ranks(world, chunk, Compression::None, move |c| {
                    let mut sum = input(c.rank(), len);
                    c.allreduce(&mut sum, ReduceOp::Sum).unwrap();
                    let mut mean = input(c.rank(), len);
                    c.allreduce(&mut mean, ReduceOp::Mean).unwrap();
                    (sum, mean)
                });
                let want = expected_sum(world, len);
                for (rank, (sum, mean)) in results.iter().enumerate() {
                    assert_eq!(sum.len(), len);
                    for i in 0..len {
                        let tol = 1e-4 * (1.0 + want[i].abs());
                        assert!(
                            (sum[i] as f64 - want[i]).abs() < tol,
                            "world {world} len {len} rank {rank} [{i}]: {} vs {}",
                            sum[i],
                            want[i]
                        );
                        assert!((mean[i] as f64 - want[i] / world as f64).abs() < tol);
                    }
                    // Every rank holds bit-identical results.
                    assert_eq!(sum, &results[0].0, "world {world} len {len}: ranks differ");
                }
            }
        }
    }
}

#[test]
fn compressed_allreduce_is_close_and_identical_on_every_rank() {
    for compression in [Compression::Bf16, Compression::Fp16] {
        for world in [2, 3, 5] {
            let len = 257;
            let results = on_ranks(world, 16, compression, move |c| {
                let mut v = input(c.rank(), len);
                c.allreduce(&mut v, ReduceOp::Sum).unwrap();
                v
            });
            let want = expected_sum(world, len);
            for r in &results {
                assert_eq!(r, &results[0], "{compression:?}: ranks differ");
                for i in 0..len {
                    // bf16 keeps 8 bits of mantissa; each hop rounds once.
                    let tol = 0.02 * world as f64 * (1.0 + want[i].abs());
                    assert!((r[i] as f64 - want[i]).abs() < tol, "{compression:?} [{i}]");
                }
            }
        }
    }
}

#[test]
fn broadcast_copies_the_root_from_every_root() {
    for world in 1..=6 {
        for root in 0..world {
            for &len in &SIZES {
                let results = on_ranks(world, 5, Compression::Bf16, move |c| {
                    let mut v = input(c.rank(), len);
                    c.broadcast(&mut v, root).unwrap();
                    v
                });
                let want = input(root, len);
                for r in &results {
                    // Exact, even when reductions are compressed.
                    assert_eq!(r, &want, "world {world} root {root} len {len}");
                }
            }
        }
    }
}

#[test]
fn all_gather_and_reduce_scatter_match_direct_results() {
    for world in 1..=8 {
        for &len in &[0usize, 1, 5, 33] {
            let results = on_ranks(world, 4, Compression::None, move |c| {
                let gathered = c.all_gather(&input(c.rank(), len)).unwrap();
                let scattered = c
                    .reduce_scatter(input(c.rank(), len), ReduceOp::Sum)
                    .unwrap();
                let seg = c.segment_of(len, c.rank());
                (gathered, scattered, seg)
            });
            let want_gather: Vec<f32> = (0..world).flat_map(|r| input(r, len)).collect();
            let want_sum = expected_sum(world, len);
            let mut covered = 0;
            for (g, s, (a, b)) in &results {
                assert_eq!(g, &want_gather);
                assert_eq!(s.len(), b - a);
                for (k, v) in s.iter().enumerate() {
                    assert!(
                        (*v as f64 - want_sum[a + k]).abs() < 1e-4 * (1.0 + want_sum[a + k].abs())
                    );
                }
                covered += b - a;
            }
            assert_eq!(covered, len, "segments cover the buffer");
        }
    }
}

#[test]
fn the_memory_transport_passes_the_conformance_suite() {
    let ranks: Vec<Arc<dyn Transport>> = MemoryTransport::mesh(3)
        .into_iter()
        .map(|t| Arc::new(t) as Arc<dyn Transport>)
        .collect();
    crate::transport::conformance::run(ranks);
}

#[test]
fn barrier_and_consecutive_collectives_do_not_mix() {
    let results = on_ranks(4, 2, Compression::None, |c| {
        let mut out = Vec::new();
        for round in 0..5 {
            c.barrier().unwrap();
            let mut v = vec![c.rank() as f32 + round as f32; 9];
            c.allreduce(&mut v, ReduceOp::Sum).unwrap();
            out.push(v[0]);
        }
        out
    });
    for r in results {
        assert_eq!(r, vec![6.0, 10.0, 14.0, 18.0, 22.0]);
    }
}

#[test]
fn a_dead_peer_fails_the_collective_naming_it() {
    let mut ranks = MemoryTransport::mesh(3);
    let dead = ranks.pop().unwrap();
    let handles: Vec<_> = ranks
        .into_iter()
        .map(|t| {
            std::thread::spawn(move || {
                let c = Communicator::new(Arc::new(t)).with_timeout(Duration::from_secs(3));
                let mut v = vec![1.0; 10];
                c.allreduce(&mut v, ReduceOp::Sum)
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(50));
    dead.kill("process exited");
    for h in handles {
        let e = h.join().unwrap().unwrap_err().to_string();
        // Rank 0 waits on rank 2 directly; rank 1 on rank 0, which then fails: either way the
        // error names a failed rank or the collective times out.
        assert!(e.contains("rank 2") || e.contains("timed out"), "{e}");
    }
}

#[test]
fn mismatched_lengths_are_an_error_not_a_hang() {
    let results = on_ranks(2, 4, Compression::None, |c| {
        let mut v = vec![1.0; if c.rank() == 0 { 8 } else { 12 }];
        let c = c.with_timeout(Duration::from_millis(500));
        c.allreduce(&mut v, ReduceOp::Sum)
            .map_err(|e| e.to_string())
    });
    assert!(results.iter().any(|r| r.is_err()), "{results:?}");
}

#[test]
fn payloads_in_pieces_decode_as_whole_ones_wherever_the_pieces_split_values() {
    use crate::transport::Payload;
    let values: Vec<f32> = (0..53).map(|i| i as f32 * 0.37 - 4.0).collect();
    for c in [Compression::None, Compression::Bf16, Compression::Fp16] {
        let bytes = c.encode(&values);
        let mut whole = vec![1.0f32; values.len()];
        c.decode_with(&bytes, &mut whole, |o, w| *o += w).unwrap();
        // Pieces of 1, 2, 3, 5 and 7 bytes in turn, and an empty one: values split every way.
        for first in [0usize, 1, 2, 3] {
            let mut pieces = vec![bytes::Bytes::copy_from_slice(&bytes[..first])];
            let (mut at, mut k) = (first, 0);
            while at < bytes.len() {
                let n = [1, 2, 3, 5, 7][k % 5].min(bytes.len() - at);
                pieces.push(bytes::Bytes::copy_from_slice(&bytes[at..at + n]));
                pieces.push(bytes::Bytes::new());
                at += n;
                k += 1;
            }
            let mut got = vec![1.0f32; values.len()];
            c.decode_payload_with(&Payload::Pieces(pieces), &mut got, |o, w| *o += w)
                .unwrap();
            assert_eq!(got, whole, "{c:?} first piece {first}");
        }
        let short = Payload::Pieces(vec![bytes::Bytes::copy_from_slice(&bytes[1..])]);
        assert!(
            c.decode_payload_with(&short, &mut vec![0.0; values.len()], |o, w| *o = w)
                .is_err()
        );
    }
}
