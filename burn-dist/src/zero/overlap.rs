//! ZeRO's gradient reduction overlapped with the backward pass: the gradients are handed over
//! as the backward produces them ([`crate::overlap::OverlappedStep::begin_sharded`]), each
//! kept by its tensor's index, and as soon as every tensor of a bucket is there the bucket is
//! reduced to this rank's segment ([`BucketReducer::reduce`]: stage 2 reduce-scatters it) and
//! the whole gradient dropped. So a rank never holds the whole gradient at once, only its
//! segments and the buckets under way: stage 2's saving of gradient memory.
//!
//! Each bucket is reduced as soon as the hand-over that brings its last tensor is taken, the
//! buckets one hand-over completes from the last down, and at the end those never completed
//! (from the last down): every rank hands over the same tensors in the same order (the same
//! model, run the same way), so every rank calls the same collectives in the same order,
//! however its backward pass is timed. A backward produces the last layers' gradients first,
//! so the buckets complete in about that order; a weight's gradient handed over alone as soon
//! as it exists (ZeRO stage 3's weights kept by key) reduces its bucket before the rest of its
//! unit's backward has run.
//!
//! ```
//! use std::sync::Arc;
//! use burn_dist::collective::Communicator;
//! use burn_dist::flat::optim::ShardOptimizer;
//! use burn_dist::transport::memory::MemoryTransport;
//! use burn_dist::zero::overlap::ShardedExchange;
//! use burn_dist::zero::{Stage, ZeroOptimizer};
//!
//! let tensors = vec![("a.weight".to_string(), 4), ("a.bias".to_string(), 2)];
//! let handles: Vec<_> = MemoryTransport::mesh(2)
//!     .into_iter()
//!     .map(|t| {
//!         let tensors = tensors.clone();
//!         std::thread::spawn(move || {
//!             let comm = Arc::new(Communicator::new(Arc::new(t)));
//!             let r = comm.rank() as f32;
//!             let sgd = ShardOptimizer::sgd(0.1, 0.0);
//!             let zero = ZeroOptimizer::new(Stage::Two, &tensors, sgd, &comm, 1 << 20).unwrap();
//!             let x = ShardedExchange::start(comm, zero.reducer()).unwrap();
//!             // As a backward pass would: the bias's gradient first.
//!             x.submit(vec![(1, vec![r; 2])]);
//!             x.submit(vec![(0, vec![2.0 * r; 4])]);
//!             let reduced = x.finish().unwrap();
//!             assert_eq!(reduced.buckets(), 1);
//!         })
//!     })
//!     .collect();
//! for h in handles {
//!     h.join().unwrap();
//! }
//! ```

use std::ops::Range;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::{BucketReducer, ReducedGradients};
use crate::collective::Communicator;
use crate::room::Room;
use crate::{DistError, Result};

/// Gradients handed over by tensor index (in the trainable order), reduced bucket by bucket as
/// each bucket completes: on a thread of its own ([`Self::start`]; while it runs, nothing else
/// may call a collective on its communicator), or on the thread that hands them over
/// ([`Self::inline`]: ZeRO stage 3, whose gathers of parameters share the communicator and
/// must keep one order of collectives with the reductions).
pub struct ShardedExchange {
    mode: Mode,
}

enum Mode {
    Thread {
        tx: Option<Sender<Handing>>,
        worker: Option<JoinHandle<Result<ReducedGradients>>>,
        /// The gradients' bytes handed to the thread and not taken yet, against two of the
        /// largest buckets: a hand-over waits while the thread is behind.
        queued: Arc<Room>,
    },
    /// The pending buckets and the first failure (then what comes is dropped); `None` once
    /// finished.
    Inline(Mutex<Option<Box<Inline>>>),
}

struct Inline {
    comm: Arc<Communicator>,
    pending: Pending,
    failed: Option<DistError>,
}

impl ShardedExchange {
    /// Starts the exchange thread, reducing buckets as `reducer` cuts them over `comm`.
    ///
    /// A hand-over waits while the gradients handed over and not yet taken by the thread
    /// would pass two of the largest buckets (one being reduced, one waiting; a larger
    /// hand-over goes once nothing waits): a backward that produces gradients faster than
    /// they are reduced (ZeRO stage 3's pieces of a large matrix: a small product each) would
    /// otherwise pile them all up, the whole matrix's gradient the stage is there not to hold.
    pub fn start(comm: Arc<Communicator>, reducer: BucketReducer) -> Result<Self> {
        let largest = (0..reducer.buckets())
            .map(|b| reducer.bucket_len(b))
            .max()
            .unwrap_or(0);
        let queued = Arc::new(Room::new(2 * largest * std::mem::size_of::<f32>()));
        let (tx, rx) = channel();
        let thread_queued = queued.clone();
        let worker = std::thread::Builder::new()
            .name("burn-dist-zero-exchange".into())
            .spawn(move || {
                // However the thread ends, a hand-over waiting for room goes on (and is dropped).
                let _close = Closing(&thread_queued);
                exchange(&comm, reducer, rx, &thread_queued)
            })
            .map_err(|e| DistError::Config(format!("starting the ZeRO exchange thread: {e}")))?;
        Ok(Self {
            mode: Mode::Thread {
                tx: Some(tx),
                worker: Some(worker),
                queued,
            },
        })
    }

    /// The same reduction without a thread: each [`submit`](Self::submit) reduces the buckets
    /// it completes before it returns, on the caller's thread, so the caller's own collectives
    /// on `comm` (stage 3's gathers) keep their order with the reductions on every rank.
    pub fn inline(comm: Arc<Communicator>, reducer: BucketReducer) -> Self {
        Self {
            mode: Mode::Inline(Mutex::new(Some(Box::new(Inline {
                comm,
                pending: Pending::new(reducer),
                failed: None,
            })))),
        }
    }

    /// Hands over gradients: `(tensor index, values)`. If the exchange has failed they are
    /// dropped, and [`finish`](Self::finish) returns the failure.
    pub fn submit(&self, tensors: Handed) {
        self.hand(Handing::Tensors(tensors));
    }

    /// Hands over one piece of a tensor cut by rows ([`ZeroOptimizer::cut_rows`]): tensor
    /// `tensor`'s gradient values from `at` on, exactly one of its pieces
    /// ([`ZeroOptimizer::pieces_of`]). Its bucket is reduced at once.
    ///
    /// [`ZeroOptimizer::cut_rows`]: super::ZeroOptimizer::cut_rows
    /// [`ZeroOptimizer::pieces_of`]: super::ZeroOptimizer::pieces_of
    pub fn submit_piece(&self, tensor: usize, at: usize, values: Vec<f32>) {
        self.hand(Handing::Piece(tensor, at, values));
    }

    fn hand(&self, handing: Handing) {
        match &self.mode {
            Mode::Thread {
                tx: Some(tx),
                queued,
                ..
            } => {
                // A closed room or channel means the thread has stopped on an error: finish
                // reports it.
                let bytes = handing.bytes();
                if queued.admit(bytes) && tx.send(handing).is_err() {
                    queued.taken(bytes);
                }
            }
            Mode::Thread { tx: None, .. } => {}
            Mode::Inline(m) => {
                let mut guard = m.lock().unwrap_or_else(|e| e.into_inner());
                let Some(x) = guard.as_mut() else {
                    return;
                };
                if x.failed.is_some() {
                    return;
                }
                if let Err(e) = x.pending.take(&x.comm, handing) {
                    x.failed = Some(e);
                }
            }
        }
    }

    /// Reduces the buckets left (a tensor never handed over counts as a zero gradient: a
    /// parameter the loss does not reach) and returns every bucket's segments.
    pub fn finish(mut self) -> Result<ReducedGradients> {
        let twice = || DistError::Config("the ZeRO gradient exchange was finished twice".into());
        match &mut self.mode {
            Mode::Thread { tx, worker, .. } => {
                tx.take();
                let worker = worker.take().ok_or_else(twice)?;
                worker.join().unwrap_or_else(|_| {
                    Err(DistError::Config(
                        "the ZeRO gradient exchange thread panicked".into(),
                    ))
                })
            }
            Mode::Inline(m) => {
                let x = m.get_mut().unwrap_or_else(|e| e.into_inner()).take();
                let mut x = x.ok_or_else(twice)?;
                if let Some(e) = x.failed {
                    return Err(e);
                }
                x.pending.reduce_rest(&x.comm)?;
                Ok(x.pending.into_reduced())
            }
        }
    }
}

impl Drop for ShardedExchange {
    fn drop(&mut self) {
        // Dropped without finish (the step failed): the thread reduces what it has and stops;
        // each collective's timeout bounds the wait. (Inline: nothing runs.)
        if let Mode::Thread { tx, worker, .. } = &mut self.mode {
            tx.take();
            if let Some(w) = worker.take() {
                let _ = w.join();
            }
        }
    }
}

/// Gradients handed over together: `(tensor index, values)`.
type Handed = Vec<(usize, Vec<f32>)>;

/// What comes to the exchange: whole tensors' gradients, or a piece of one (tensor, its
/// first value within the tensor, the values).
enum Handing {
    Tensors(Handed),
    Piece(usize, usize, Vec<f32>),
}

impl Handing {
    fn bytes(&self) -> usize {
        let values = match self {
            Handing::Tensors(t) => t.iter().map(|(_, v)| v.len()).sum(),
            Handing::Piece(_, _, v) => v.len(),
        };
        values * std::mem::size_of::<f32>()
    }
}

/// Closes the exchange's room when its thread ends.
struct Closing<'a>(&'a Room);

impl Drop for Closing<'_> {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// A bucket's reduced segments: this rank's, and its replica's.
type Segments = (Vec<f32>, Option<Vec<f32>>);

/// What the exchange thread holds: the gradients waiting for their buckets, and the buckets
/// reduced so far.
struct Pending {
    reducer: BucketReducer,
    /// Per bucket: its tensors' gradients (a piece's alone for a piece of a tensor), until
    /// the bucket is reduced.
    slots: Vec<Vec<Option<Vec<f32>>>>,
    /// Per tensor: its buckets (several for a tensor cut into pieces).
    buckets_of: Vec<Range<usize>>,
    /// Per bucket: its slots not filled yet.
    missing: Vec<usize>,
    /// Per bucket: its segments, once reduced.
    done: Vec<Option<Segments>>,
}

impl Pending {
    fn new(reducer: BucketReducer) -> Self {
        let buckets = reducer.buckets();
        let mut buckets_of = vec![0..0; reducer.tensor_count()];
        let mut slots = Vec::with_capacity(buckets);
        for b in 0..buckets {
            let tensors = reducer.tensors(b);
            for t in tensors.clone() {
                let of = &mut buckets_of[t];
                *of = match of.start == of.end {
                    true => b..b + 1,
                    false => of.start..b + 1,
                };
            }
            let n = match reducer.piece(b) {
                Some(_) => 1,
                None => tensors.len(),
            };
            slots.push(vec![None; n]);
        }
        Self {
            missing: slots.iter().map(Vec::len).collect(),
            slots,
            reducer,
            buckets_of,
            done: (0..buckets).map(|_| None).collect(),
        }
    }

    /// Fills slot `i` of bucket `b`; an error for a second hand-over.
    fn fill(&mut self, b: usize, i: usize, values: Vec<f32>, what: &str) -> Result<()> {
        // A reduced bucket's slots are gone: that test first.
        if self.done[b].is_some() || self.slots[b][i].is_some() {
            return Err(exchange_mismatch(format!(
                "{what}'s gradient was handed over twice"
            )));
        }
        self.slots[b][i] = Some(values);
        self.missing[b] -= 1;
        Ok(())
    }

    /// Keeps what was handed over; returns the buckets it completed. An error for an unknown
    /// tensor or piece, a wrong length or a second hand-over.
    fn add(&mut self, handing: Handing) -> Result<Vec<usize>> {
        let mut completed = Vec::new();
        match handing {
            Handing::Tensors(tensors) => {
                for (t, values) in tensors {
                    self.check_tensor(t, values.len())?;
                    let buckets = self.buckets_of[t].clone();
                    if self.reducer.piece(buckets.start).is_none() {
                        let b = buckets.start;
                        let i = t - self.reducer.tensors(b).start;
                        self.fill(b, i, values, &format!("tensor {t}"))?;
                        completed.extend((self.missing[b] == 0).then_some(b));
                        continue;
                    }
                    // A tensor cut into pieces handed over whole: each piece to its bucket.
                    for b in buckets {
                        let piece = self.reducer.piece(b).unwrap_or(0..0);
                        let part = values.get(piece).map(<[f32]>::to_vec).unwrap_or_default();
                        self.fill(b, 0, part, &format!("tensor {t}"))?;
                        completed.push(b);
                    }
                }
            }
            Handing::Piece(t, at, values) => {
                if t >= self.buckets_of.len() {
                    return Err(exchange_mismatch(format!(
                        "a piece of tensor {t} handed over, of {} trainable tensors",
                        self.buckets_of.len()
                    )));
                }
                let b = self.buckets_of[t].clone().find(|&b| {
                    self.reducer.piece(b).map(|p| p.start..p.end) == Some(at..at + values.len())
                });
                let Some(b) = b else {
                    return Err(exchange_mismatch(format!(
                        "values {at}..{} of tensor {t} handed over: not one of its pieces",
                        at + values.len()
                    )));
                };
                self.fill(b, 0, values, &format!("tensor {t} from value {at}"))?;
                completed.push(b);
            }
        }
        Ok(completed)
    }

    /// An error for an unknown tensor or a gradient of another length than its parameter.
    fn check_tensor(&self, t: usize, len: usize) -> Result<()> {
        if t >= self.buckets_of.len() {
            return Err(exchange_mismatch(format!(
                "tensor {t} handed over, of {} trainable tensors",
                self.buckets_of.len()
            )));
        }
        let want = self.reducer.tensor_len(t);
        if len != want {
            return Err(exchange_mismatch(format!(
                "tensor {t}'s gradient has {len} values, its parameter {want}"
            )));
        }
        Ok(())
    }

    /// Keeps gradients handed over together, then reduces the buckets they complete, from the
    /// last down.
    fn take(&mut self, comm: &Communicator, handing: Handing) -> Result<()> {
        let mut completed = self.add(handing)?;
        completed.sort_unstable_by(|a, b| b.cmp(a));
        for b in completed {
            self.reduce(comm, b)?;
        }
        Ok(())
    }

    /// Every bucket's segments, once all are reduced.
    fn into_reduced(self) -> ReducedGradients {
        let mut reduced = ReducedGradients::with_capacity(self.reducer.buckets());
        for (mine, theirs) in self.done.into_iter().flatten() {
            reduced.push(mine, theirs);
        }
        reduced
    }

    /// Reduces every bucket not reduced yet, from the last down (a tensor never handed over
    /// counts as a zero gradient).
    fn reduce_rest(&mut self, comm: &Communicator) -> Result<()> {
        for b in (0..self.done.len()).rev() {
            if self.done[b].is_none() {
                self.reduce(comm, b)?;
            }
        }
        Ok(())
    }

    /// Reduces bucket `b` (not reduced yet) to this rank's segments and drops its gradients.
    fn reduce(&mut self, comm: &Communicator, b: usize) -> Result<()> {
        let tensors = self.reducer.tensors(b);
        let piece = self.reducer.piece(b);
        let slots = std::mem::take(&mut self.slots[b]);
        let g = if let Some(piece) = piece {
            // A piece of a tensor: its values are the bucket, moved.
            let slot = slots.into_iter().next().flatten();
            slot.unwrap_or_else(|| vec![0.0; piece.len()])
        } else if tensors.len() == 1 {
            // One tensor: its values are the bucket, moved.
            let slot = slots.into_iter().next().flatten();
            slot.unwrap_or_else(|| vec![0.0; self.reducer.tensor_len(tensors.start)])
        } else {
            // Its whole length at once: a vector grown by doubling held up to three times the
            // bucket's gradient for a moment (a stage 3 step's peak).
            let len = tensors.clone().map(|t| self.reducer.tensor_len(t)).sum();
            let mut g = Vec::with_capacity(len);
            for (t, slot) in tensors.zip(slots) {
                match slot {
                    Some(v) => g.extend_from_slice(&v),
                    None => g.resize(g.len() + self.reducer.tensor_len(t), 0.0),
                }
            }
            g
        };
        self.done[b] = Some(self.reducer.reduce(comm, b, g)?);
        Ok(())
    }
}

fn exchange_mismatch(reason: String) -> DistError {
    DistError::Mismatch {
        op: "ZeRO gradient exchange".into(),
        reason,
    }
}

/// The exchange thread: keeps what comes, reduces the buckets as they complete, the rest
/// when the sender is done.
fn exchange(
    comm: &Communicator,
    reducer: BucketReducer,
    rx: Receiver<Handing>,
    queued: &Room,
) -> Result<ReducedGradients> {
    let mut pending = Pending::new(reducer);
    for handing in rx {
        let bytes = handing.bytes();
        let took = pending.take(comm, handing);
        queued.taken(bytes);
        took?;
    }
    pending.reduce_rest(comm)?;
    Ok(pending.into_reduced())
}
