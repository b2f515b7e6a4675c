//! The thread that gathers a stage 3 step's backward ahead of its ops (`--overlap`, from the
//! second step): each bucket, or piece of rows of a matrix cut into pieces, in the order the
//! last step's backward fetched them ([`FetchOrder`](crate::pipeline::gathered::FetchOrder)),
//! one ahead; and the gathers themselves, which the step's passes also call on their own
//! thread where no thread gathers.

use std::sync::mpsc::{Receiver, SyncSender};

use burn::module::ParamId;
use burn::tensor::TensorData;
use hearth_kernels::keyed::Pieced;

use super::super::gathered::{Fetched, Shards, gather_rows};

/// A bucket gathered: its tensors' keys and values, or what failed.
pub(super) type Gathered = Result<Vec<(u64, TensorData)>, String>;

/// What the thread hands over: a bucket's tensors, or a piece of rows of a matrix.
#[derive(Debug)]
pub(super) enum Got {
    Bucket(Vec<(u64, TensorData)>),
    Piece(u64, usize, TensorData),
}

impl Got {
    fn is(&self, want: Fetched) -> bool {
        match (self, want) {
            (Got::Bucket(b), Fetched::Bucket(key)) => b.iter().any(|(k, _)| *k == key),
            (Got::Piece(key, k, _), Fetched::Piece(want_key, want_k)) => {
                (*key, *k) == (want_key, want_k)
            }
            _ => false,
        }
    }
}

/// Weight `key`'s bucket from the ranks' shards: its tensors by key.
pub(super) fn gather_bucket(g: Shards<'_>, key: u64) -> Gathered {
    let bucket = g
        .params
        .gather_bucket_of(g.zero, g.comm, &ParamId::from(key))
        .map_err(|e| format!("gathering weight {key}'s bucket: {e}"))?;
    Ok(bucket
        .into_iter()
        .map(|(id, shape, v)| (id.val(), TensorData::new(v, shape)))
        .collect())
}

/// Piece `k` of matrix `key` (its pieces' rows in `pieced`) from the ranks' shards.
pub(super) fn gather_piece(
    g: Shards<'_>,
    pieced: &Pieced,
    key: u64,
    k: usize,
) -> Result<TensorData, String> {
    let p = pieced
        .get(&key)
        .ok_or_else(|| format!("weight {key} is not cut into pieces in this unit"))?;
    let rows = p
        .rows
        .get(k)
        .ok_or_else(|| format!("piece {k} of weight {key}, of {}", p.rows.len()))?
        .len();
    gather_rows(g, key, k, rows, p.cols)
}

/// The thread's body: gathers what `order` names, each handed over when the backward takes
/// it; it stops at the first failure (handed over) or when the backward no longer takes any.
/// `pieced`: every unit's matrices cut into pieces (a piece's shape).
pub(super) fn gather_ahead(
    g: Shards<'_>,
    pieced: Pieced,
    order: Vec<Fetched>,
    tx: SyncSender<Result<Got, String>>,
) {
    for want in order {
        let got = match want {
            Fetched::Bucket(key) => gather_bucket(g, key).map(Got::Bucket),
            Fetched::Piece(key, k) => {
                gather_piece(g, &pieced, key, k).map(|v| Got::Piece(key, k, v))
            }
        };
        let failed = got.is_err();
        if tx.send(got).is_err() || failed {
            return;
        }
    }
}

/// What a thread gathers ahead of a step's backward, and what it gathered that the backward
/// has not asked for yet (taken out of order: only where the order changed).
pub(super) struct Ahead {
    rx: Receiver<Result<Got, String>>,
    spare: Vec<Got>,
    /// Whether the thread may still hand over.
    open: bool,
}

impl Ahead {
    pub(super) fn new(rx: Receiver<Result<Got, String>>) -> Self {
        Self {
            rx,
            spare: Vec::new(),
            open: true,
        }
    }

    /// `want`, if the thread gathered it: from the spares, else from the thread, keeping what
    /// came before it as spares. `None` once the thread has ended without it (its collectives
    /// done, so the caller may gather on the same communicator).
    pub(super) fn take(&mut self, want: Fetched) -> Option<Result<Got, String>> {
        if let Some(i) = self.spare.iter().position(|g| g.is(want)) {
            return Some(Ok(self.spare.swap_remove(i)));
        }
        while self.open {
            match self.rx.recv() {
                Ok(Ok(got)) if got.is(want) => return Some(Ok(got)),
                Ok(Ok(got)) => self.spare.push(got),
                Ok(Err(e)) => return Some(Err(e)),
                Err(_) => self.open = false,
            }
        }
        None
    }

    /// [`Self::take`] of the bucket that holds weight `key`.
    pub(super) fn bucket(&mut self, key: u64) -> Option<Gathered> {
        Some(match self.take(Fetched::Bucket(key))? {
            Ok(Got::Bucket(b)) => Ok(b),
            Ok(Got::Piece(..)) => Err(format!("weight {key}'s bucket came back as a piece")),
            Err(e) => Err(e),
        })
    }

    /// [`Self::take`] of piece `k` of matrix `key`.
    pub(super) fn piece(&mut self, key: u64, k: usize) -> Option<Result<TensorData, String>> {
        Some(match self.take(Fetched::Piece(key, k))? {
            Ok(Got::Piece(_, _, v)) => Ok(v),
            Ok(Got::Bucket(_)) => Err(format!("piece {k} of weight {key} came back as a bucket")),
            Err(e) => Err(e),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::sync_channel;

    use super::*;

    fn bucket(keys: &[u64]) -> Got {
        Got::Bucket(
            keys.iter()
                .map(|&k| (k, TensorData::new(vec![k as f32], [1])))
                .collect(),
        )
    }

    fn piece(key: u64, k: usize) -> Got {
        Got::Piece(key, k, TensorData::new(vec![k as f32], [1, 1]))
    }

    fn keys_of(b: &Gathered) -> Vec<u64> {
        b.as_ref()
            .map_or(Vec::new(), |b| b.iter().map(|(k, _)| *k).collect())
    }

    fn piece_value(p: Option<Result<TensorData, String>>) -> Vec<f32> {
        p.expect("gathered ahead")
            .expect("a piece")
            .try_into_vec::<f32>()
            .expect("f32")
    }

    /// A thread's buckets and pieces taken in its order, out of it (those before kept as
    /// spares and taken from there), and `None` once it ended without the one asked for: then,
    /// and only then, the caller gathers on the communicator itself.
    #[test]
    fn what_was_gathered_ahead_is_taken_in_order_out_of_order_and_none_after_the_thread() {
        let (tx, rx) = sync_channel(0);
        let thread = std::thread::spawn(move || {
            for g in [
                bucket(&[1, 2]),
                piece(9, 0),
                bucket(&[3]),
                piece(9, 1),
                bucket(&[4]),
            ] {
                if tx.send(Ok(g)).is_err() {
                    return;
                }
            }
        });
        let mut ahead = Ahead::new(rx);
        assert_eq!(keys_of(&ahead.bucket(2).expect("gathered ahead")), [1, 2]);
        assert_eq!(piece_value(ahead.piece(9, 0)), [0.0]);
        // 4 before 3 and piece 1: both wait as spares.
        assert_eq!(keys_of(&ahead.bucket(4).expect("gathered ahead")), [4]);
        assert_eq!(ahead.spare.len(), 2);
        assert_eq!(piece_value(ahead.piece(9, 1)), [1.0]);
        assert_eq!(keys_of(&ahead.bucket(3).expect("a spare")), [3]);
        assert!(ahead.bucket(5).is_none(), "the thread has ended without 5");
        assert!(ahead.piece(9, 2).is_none(), "nor piece 2");
        assert!(!ahead.open);
        thread.join().expect("the sender ends");
    }

    /// A failed gather is handed over as what was asked for, naming what failed.
    #[test]
    fn a_failed_gather_ahead_comes_back_as_the_fetch_error() {
        let (tx, rx) = sync_channel(0);
        let thread = std::thread::spawn(move || {
            let _ = tx.send(Err(
                "gathering piece 3 of weight 7: peer 1 timed out".to_string()
            ));
        });
        let mut ahead = Ahead::new(rx);
        match ahead.piece(7, 3) {
            Some(Err(e)) => assert!(e.contains("peer 1 timed out"), "{e}"),
            other => panic!("expected the thread's error, got {other:?}"),
        }
        thread.join().expect("the sender ends");
    }
}
