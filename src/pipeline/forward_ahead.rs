//! ZeRO stage 3 with `--overlap`: a thread that gathers the forward's units ahead of it
//! (PyTorch FSDP's forward prefetch), so that a unit's gathers run while the units before it
//! compute instead of between them.
//!
//! How far ahead is a budget of bytes, not a number of units: the thread starts a unit's
//! gathers while what it has handed over and the forward has not taken yet, with that unit, fits
//! in one bucket (`--bucket-mb`), or when nothing waits. A ResNet's first units compute long on
//! large activations and hold few parameters, its last ones the reverse: one unit ahead left the
//! link idle during the first and the forward waiting on it during the last, where a bucket's
//! worth of small units ahead moves some of those gathers into the idle time. A unit larger
//! than the budget is still gathered one ahead, alone.
//!
//! A unit's matrices cut into pieces of rows ([`burn_dist::zero::ZeroOptimizer::cut_rows`])
//! are left out of its gather; the thread gathers their pieces after it, one at a time under
//! the same budget, and the unit's keyed products take them as they need them
//! ([`ForwardAhead::piece`]), so the forward never holds such a matrix whole.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, channel};

use burn::tensor::TensorData;
use burn_dist::room::Room;
use burn_dist::zero::module::GatheredValues;

use super::gathered::{Gathering, Shards, gather_rows};
use super::stage::StageModel;

/// The forward's thread, shared by the step's gathers of units and its keyed products' pieces
/// (`pipeline/regather.rs`), on the step's own thread; `None` once the backward has waited for
/// it to end.
pub(super) type SharedForward<'a> = Rc<RefCell<Option<ForwardAhead<'a>>>>;

/// What the thread hands over, with its bytes: a unit's parameters but its pieces, or a piece
/// of rows (matrix key, piece).
enum Sent {
    Unit(burn_dist::Result<GatheredValues>),
    Piece(u64, usize, Result<TensorData, String>),
}

/// The forward's units' parameters from the thread, in the forward's order, and their pieces.
pub(super) struct ForwardAhead<'a> {
    rx: Receiver<(Sent, usize)>,
    room: Arc<Room>,
    params: &'a burn_dist::zero::module::ShardedParams,
    /// The current unit's pieces handed over before the product that asked for them.
    spare: Vec<(u64, usize, Result<TensorData, String>)>,
}

/// A unit's gathers for the thread: its tensors and the bytes of their values but the pieces,
/// then each piece (matrix key, piece, rows, columns).
struct UnitGathers {
    tensors: std::ops::Range<usize>,
    bytes: usize,
    pieces: Vec<(u64, usize, usize, usize)>,
}

/// Starts the thread that gathers `segments`' parameters in the forward's order, ahead of it
/// by at most a bucket's bytes (or one unit, or one piece). It ends after the last unit's last
/// piece, and the first unit's backward waits for that ([`ForwardAhead::finish`]) before it
/// starts its own thread on the same communicator; if the forward stops early, it ends once
/// the forward drops its end.
pub(super) fn forward_ahead<'s, 'e, 'a: 's>(
    scope: &'s std::thread::Scope<'s, 'e>,
    g: &'a Gathering<'a>,
    segments: &[StageModel],
) -> burn_dist::Result<ForwardAhead<'a>> {
    let f32s = std::mem::size_of::<f32>();
    let units = segments
        .iter()
        .map(|s| {
            let tensors = g.params.tensors_of(s)?;
            let pieces: Vec<(u64, usize, usize, usize)> = g
                .params
                .pieces_in(g.zero, s)?
                .into_iter()
                .flat_map(|(id, rows, cols)| {
                    let key = id.val();
                    rows.into_iter()
                        .enumerate()
                        .map(move |(k, r)| (key, k, r.len(), cols))
                })
                .collect();
            let pieced: usize = pieces.iter().map(|p| p.2 * p.3).sum();
            let bytes = (g.params.len_of(tensors.clone()) - pieced) * f32s;
            Ok(UnitGathers {
                tensors,
                bytes,
                pieces,
            })
        })
        .collect::<burn_dist::Result<Vec<_>>>()?;
    let shards = Shards::of(g);
    let room = Arc::new(Room::new(g.zero.bucket_bytes()));
    let (tx, rx) = channel();
    let thread_room = room.clone();
    std::thread::Builder::new()
        .name("hearth-zero3-forward-ahead".into())
        .spawn_scoped(scope, move || {
            for unit in units {
                if !thread_room.admit(unit.bytes) {
                    return;
                }
                let values =
                    shards
                        .params
                        .gather_values_but_pieces(shards.zero, shards.comm, unit.tensors);
                let failed = values.is_err();
                if tx.send((Sent::Unit(values), unit.bytes)).is_err() || failed {
                    return;
                }
                for (key, k, rows, cols) in unit.pieces {
                    let bytes = rows * cols * f32s;
                    if !thread_room.admit(bytes) {
                        return;
                    }
                    let values = gather_rows(shards, key, k, rows, cols);
                    let failed = values.is_err();
                    if tx.send((Sent::Piece(key, k, values), bytes)).is_err() || failed {
                        return;
                    }
                }
            }
        })
        .map_err(|e| {
            burn_dist::DistError::Config(format!("starting stage 3's forward gather thread: {e}"))
        })?;
    Ok(ForwardAhead {
        rx,
        room,
        params: g.params,
        spare: Vec::new(),
    })
}

impl ForwardAhead<'_> {
    /// Unit `k` (`skeleton`, the forward's next) with its parameters from the thread (those
    /// cut into pieces empty). Pieces of the unit before that its forward did not take are
    /// dropped.
    pub(super) fn take(
        &mut self,
        k: usize,
        skeleton: &StageModel,
    ) -> burn_dist::Result<StageModel> {
        self.spare.clear();
        loop {
            match self.rx.recv() {
                Ok((Sent::Unit(values), bytes)) => {
                    self.room.taken(bytes);
                    return self.params.with_values(skeleton, values?);
                }
                Ok((Sent::Piece(..), bytes)) => self.room.taken(bytes),
                Err(_) => {
                    return Err(burn_dist::DistError::Config(format!(
                        "unit {k}'s parameters: the thread gathering the forward's units ended \
                         before it"
                    )));
                }
            }
        }
    }

    /// Piece `k` of matrix `key` of the unit taken last, from the thread: the pieces come in
    /// the order the unit lists its matrices, and one asked for out of that order keeps those
    /// before it aside (their room given back, so the thread goes on to it).
    pub(super) fn piece(&mut self, key: u64, k: usize) -> Result<TensorData, String> {
        if let Some(i) = self.spare.iter().position(|p| (p.0, p.1) == (key, k)) {
            return self.spare.swap_remove(i).2;
        }
        loop {
            match self.rx.recv() {
                Ok((Sent::Piece(got_key, got_k, values), bytes)) => {
                    self.room.taken(bytes);
                    if (got_key, got_k) == (key, k) {
                        return values;
                    }
                    self.spare.push((got_key, got_k, values));
                }
                Ok((Sent::Unit(_), bytes)) => {
                    self.room.taken(bytes);
                    return Err(format!(
                        "piece {k} of weight {key}: the forward's thread gathered the next unit \
                         without it (not a piece of this unit's matrices)"
                    ));
                }
                Err(_) => {
                    return Err(format!(
                        "piece {k} of weight {key}: the thread gathering the forward's units \
                         ended before it"
                    ));
                }
            }
        }
    }

    /// Waits for the thread to end, dropping whatever it hands over: after the forward, before
    /// another thread gathers on the same communicator (every rank's thread gathers the same,
    /// so each must finish its gathers).
    pub(super) fn finish(mut self) {
        self.spare.clear();
        while let Ok((_, bytes)) = self.rx.recv() {
            self.room.taken(bytes);
        }
    }
}

impl Drop for ForwardAhead<'_> {
    /// A thread waiting for room stops (the forward ended early, or failed).
    fn drop(&mut self) {
        self.room.close();
    }
}
