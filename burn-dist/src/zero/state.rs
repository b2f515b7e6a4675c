//! The sharded optimizer's state in and out as whole named vectors: gathered on one rank or
//! streamed from it a bucket at a time ([`ZeroOptimizer::stream_state`]), and handed out again
//! from memory or from a [`StateReader`] (a checkpoint file read a bucket at a time), to any
//! number of ranks.

use std::ops::Range;

mod reshard;

use super::ZeroOptimizer;
use crate::collective::{Communicator, ReduceOp};
use crate::{DistError, Result};

/// The optimizer's whole state as named vectors (see the module's documentation).
#[derive(Debug, Clone, PartialEq)]
pub struct WholeState {
    /// The trainable tensors (name, values) the vectors concatenate.
    pub tensors: Vec<(String, usize)>,
    /// Updates taken (Adam's bias correction counts them).
    pub updates: u64,
    /// One vector per slot of [`ShardOptimizer::state_slots`](crate::flat::optim::ShardOptimizer::state_slots), each over all the values;
    /// empty before the first update.
    pub slots: Vec<(String, Vec<f32>)>,
    /// Per tensor: the update count when it joined (Adam's count for it starts there; see
    /// [`ShardOptimizer::born`](crate::flat::optim::ShardOptimizer::born)); empty: all 0.
    pub born: Vec<u64>,
}

impl WholeState {
    /// Every tensor's part of every slot: `(tensor.slot, values)`, as a checkpoint names them.
    pub fn named(&self) -> Vec<(String, &[f32])> {
        let mut out = Vec::new();
        for (slot, values) in &self.slots {
            let mut at = 0;
            for (name, len) in &self.tensors {
                out.push((format!("{name}.{slot}"), &values[at..at + len]));
                at += len;
            }
        }
        out
    }
}

/// A saved state handed out a piece at a time ([`ZeroOptimizer::scatter_from_reader`]): its
/// shape up front, then any range of any slot's whole vector (a checkpoint file read as it is
/// scattered, so the reading rank never holds more than a bucket of it).
pub trait StateReader {
    /// The trainable tensors (name, values) the slots' vectors concatenate.
    fn tensors(&self) -> &[(String, usize)];
    /// Updates taken.
    fn updates(&self) -> u64;
    /// The slots' names in order (none: saved before the first update).
    fn slot_names(&self) -> Vec<String>;
    /// Values `range` of slot `slot`'s whole vector.
    fn read(&mut self, slot: usize, range: Range<usize>) -> std::result::Result<Vec<f32>, String>;
    /// Per tensor: the update count when it joined ([`WholeState::born`]; empty: all 0).
    fn born(&self) -> Vec<u64> {
        Vec::new()
    }
}

/// A [`WholeState`] in memory as a [`StateReader`].
struct InMemory<'a>(&'a WholeState);

impl StateReader for InMemory<'_> {
    fn tensors(&self) -> &[(String, usize)] {
        &self.0.tensors
    }
    fn updates(&self) -> u64 {
        self.0.updates
    }
    fn slot_names(&self) -> Vec<String> {
        self.0.slots.iter().map(|s| s.0.clone()).collect()
    }
    fn read(&mut self, slot: usize, range: Range<usize>) -> std::result::Result<Vec<f32>, String> {
        self.0
            .slots
            .get(slot)
            .and_then(|s| s.1.get(range.clone()))
            .map(<[f32]>::to_vec)
            .ok_or_else(|| format!("slot {slot} has no values {range:?}"))
    }
    fn born(&self) -> Vec<u64> {
        self.0.born.clone()
    }
}

/// The shape of a streamed state ([`ZeroOptimizer::stream_state`]).
#[derive(Debug, Clone, PartialEq)]
pub struct StateLayout {
    pub tensors: Vec<(String, usize)>,
    pub updates: u64,
    /// The slots sent (empty before the first update).
    pub slots: Vec<String>,
    /// Per tensor: the update count when it joined ([`WholeState::born`]).
    pub born: Vec<u64>,
}

impl ZeroOptimizer {
    /// What [`Self::stream_state`] sends, in order: every slot (none before the first update)
    /// over every tensor, slot after slot, each slot in the vector's order.
    pub fn state_layout(&self) -> StateLayout {
        let stepped = self.state.iter().any(|s| !s.is_empty());
        StateLayout {
            tensors: self.tensors.clone(),
            updates: self.updates,
            slots: if stepped {
                self.whole
                    .state_slots()
                    .iter()
                    .map(|s| s.to_string())
                    .collect()
            } else {
                Vec::new()
            },
            born: self.born(),
        }
    }

    /// The whole state to `sink` on `root`, a bucket's values at a time in
    /// [`Self::state_layout`]'s order; every rank calls it. `root` never holds more than one
    /// bucket of it, in its inbox included (a barrier between buckets). A `sink` error is
    /// returned after the last piece (the other ranks are not left waiting).
    pub fn stream_state(
        &self,
        comm: &Communicator,
        root: usize,
        sink: &mut dyn FnMut(&[f32]) -> std::result::Result<(), String>,
    ) -> Result<()> {
        let slots = self.state_layout().slots.len();
        let mut failed = None;
        for i in 0..slots {
            for b in 0..self.buckets.len() {
                // The other ranks send a bucket only once the root has taken the one before:
                // without this they sent every bucket at once, and the root's inbox held up to
                // all of their state while it wrote the first (rank 0's peak in the memory
                // bench, 20-30 MB above the others' for ResNet-50 at 4 ranks).
                if i + b > 0 {
                    comm.barrier()?;
                }
                let n = self.segment(b, self.rank).len();
                let part = &self.state[b][i * n..(i + 1) * n];
                if let Some(piece) = comm.gather_to(root, part, &self.bounds(b))?
                    && failed.is_none()
                    && let Err(e) = sink(&piece)
                {
                    failed = Some(e);
                }
            }
        }
        match failed {
            Some(e) => Err(DistError::Config(e)),
            None => Ok(()),
        }
    }

    /// The whole state on `root` (`None` elsewhere); every rank calls it (tests and small
    /// models: a checkpoint streams it with [`Self::stream_state`] instead).
    pub fn gather_state(&self, comm: &Communicator, root: usize) -> Result<Option<WholeState>> {
        let layout = self.state_layout();
        let mut whole: Vec<f32> = Vec::new();
        self.stream_state(comm, root, &mut |piece| {
            whole.extend_from_slice(piece);
            Ok(())
        })?;
        if comm.rank() != root {
            return Ok(None);
        }
        let total = self.total();
        let slots = layout
            .slots
            .iter()
            .enumerate()
            .map(|(i, name)| (name.clone(), whole[i * total..(i + 1) * total].to_vec()))
            .collect();
        Ok(Some(WholeState {
            tensors: layout.tensors,
            updates: layout.updates,
            slots,
            born: layout.born,
        }))
    }

    /// Takes the state `root` read (any number of ranks wrote it; `None` on the other ranks,
    /// `Some(Err(why))` on `root` when it could not be read): each rank receives its segments
    /// of every slot. The tensors must be this optimizer's, by name and length, and the slots
    /// its update's; otherwise, or when the root could not read it, an error on every rank
    /// (the root's naming the first difference).
    pub fn scatter_state(
        &mut self,
        comm: &Communicator,
        root: usize,
        read: Option<std::result::Result<&WholeState, String>>,
    ) -> Result<()> {
        let mut whole = read.map(|r| {
            r.and_then(|s| {
                let total: usize = s.tensors.iter().map(|t| t.1).sum();
                match s.slots.iter().find(|x| x.1.len() != total) {
                    Some((slot, v)) => Err(format!(
                        "the saved {slot} has {} values for {total} trainable values",
                        v.len()
                    )),
                    None => Ok(InMemory(s)),
                }
            })
        });
        let reader = whole.as_mut().map(|r| {
            r.as_mut()
                .map(|m| m as &mut dyn StateReader)
                .map_err(|e| e.clone())
        });
        self.scatter_from_reader(comm, root, reader)
    }

    /// [`ZeroOptimizer::scatter_state`] from a [`StateReader`]: the root reads one bucket of
    /// one slot at a time and hands it out, so it never holds more of the state than that. A
    /// read that fails on the way is an error on every rank, the root's naming it.
    pub fn scatter_from_reader(
        &mut self,
        comm: &Communicator,
        root: usize,
        read: Option<std::result::Result<&mut dyn StateReader, String>>,
    ) -> Result<()> {
        let names = self.whole.state_slots();
        // The root's verdict first, so every rank fails alike.
        let mut header = [0f32; 3];
        let mut problem = None;
        let mut state = None;
        if comm.rank() == root {
            let s = read.unwrap_or_else(|| {
                Err("sharded optimizer: the root has no state to hand out".into())
            });
            match s {
                Ok(s) => {
                    problem = self.mismatch(s.tensors(), &s.slot_names(), names);
                    header = [
                        if problem.is_some() { 1.0 } else { 0.0 },
                        if s.slot_names().is_empty() { 0.0 } else { 1.0 },
                        // Updates travel as two exact halves.
                        (s.updates() >> 24) as f32,
                    ];
                    state = Some(s);
                }
                Err(e) => {
                    problem = Some(e);
                    header[0] = 1.0;
                }
            }
        }
        let mut low = [state
            .as_ref()
            .map_or(0.0, |s| (s.updates() & 0xFF_FFFF) as f32)];
        comm.broadcast(&mut header, root)?;
        comm.broadcast(&mut low, root)?;
        if header[0] != 0.0 {
            return Err(state_mismatch(
                SCATTER,
                problem.unwrap_or_else(|| {
                    format!("rank {root}'s saved state does not fit this model or optimizer")
                }),
            ));
        }
        self.updates = ((header[2] as u64) << 24) | low[0] as u64;
        self.applied = self.updates;
        self.scatter_born(comm, root, state.as_deref())?;
        self.state = vec![Vec::new(); self.buckets.len()];
        if let Some(r) = self.replica.as_mut() {
            r.state = vec![Vec::new(); self.buckets.len()];
        }
        if header[1] == 0.0 {
            return Ok(());
        }
        // Where each of this optimizer's tensors lies in the saved vectors (None: not saved,
        // starts from zero; only with `new_at_zero`).
        let saved_at: Option<Vec<Option<usize>>> = state.as_ref().map(|s| {
            let mut at = std::collections::BTreeMap::new();
            let mut o = 0;
            for t in s.tensors() {
                at.insert(t.clone(), o);
                o += t.1;
            }
            self.tensors.iter().map(|t| at.get(t).copied()).collect()
        });
        for slot in 0..names.len() {
            for b in 0..self.buckets.len() {
                let reader = state.as_mut().map(|s| &mut **s as &mut dyn StateReader);
                let source = reader.zip(saved_at.as_deref());
                self.scatter_bucket(comm, root, source, slot, b)?;
            }
        }
        Ok(())
    }

    /// The joining count of each tensor (the saved one, or now for a tensor the state lacks:
    /// `new_at_zero`), from the root to every rank as two exact halves per tensor.
    fn scatter_born(
        &mut self,
        comm: &Communicator,
        root: usize,
        state: Option<&dyn StateReader>,
    ) -> Result<()> {
        let mut born = vec![0f32; 2 * self.tensors.len()];
        if let Some(s) = state {
            let saved = s.born();
            let index: std::collections::BTreeMap<&(String, usize), usize> = s
                .tensors()
                .iter()
                .enumerate()
                .map(|(i, t)| (t, i))
                .collect();
            for (j, t) in self.tensors.iter().enumerate() {
                let b = match index.get(t) {
                    Some(&i) => saved.get(i).copied().unwrap_or(0),
                    None => self.updates,
                };
                born[2 * j] = (b >> 24) as f32;
                born[2 * j + 1] = (b & 0xFF_FFFF) as f32;
            }
        }
        comm.broadcast(&mut born, root)?;
        self.set_born(
            born.chunks_exact(2)
                .map(|p| ((p[0] as u64) << 24) | p[1] as u64)
                .collect(),
        );
        Ok(())
    }

    /// Bucket `b` of state slot `slot`: the root reads it from `source` (the reader and where
    /// this optimizer's tensors lie in it), says to every rank whether the read worked, then
    /// scatters it (and each rank's replica its neighbour's segment).
    fn scatter_bucket(
        &mut self,
        comm: &Communicator,
        root: usize,
        source: Option<(&mut dyn StateReader, &[Option<usize>])>,
        slot: usize,
        b: usize,
    ) -> Result<()> {
        let range = self.buckets[b].range.clone();
        let piece = source.map(|(s, at)| self.read_range(s, at, slot, range.clone()));
        let mut ok = [match &piece {
            Some(Ok(v)) if v.len() == range.len() => 0.0f32,
            Some(_) => 1.0,
            None => 0.0,
        }];
        comm.broadcast(&mut ok, root)?;
        if ok[0] != 0.0 {
            return Err(state_mismatch(
                SCATTER,
                match piece {
                    Some(Err(e)) => e,
                    Some(Ok(v)) => format!(
                        "reading {} values of slot {} gave {}",
                        range.len(),
                        self.whole.state_slots()[slot],
                        v.len()
                    ),
                    None => format!("rank {root} could not read the saved state"),
                },
            ));
        }
        let whole = piece
            .as_ref()
            .and_then(|p| p.as_ref().ok())
            .map(Vec::as_slice);
        let part = comm.scatter_from(root, whole, &self.bounds(b))?;
        if let Some(of) = self.replica.as_ref().map(|r| r.of) {
            let theirs = comm.shift_down(&part, self.segment(b, of).len())?;
            if let Some(r) = self.replica.as_mut() {
                r.state[b].extend_from_slice(&theirs);
            }
        }
        self.state[b].extend_from_slice(&part);
        Ok(())
    }

    /// Values `range` (this optimizer's coordinates) of slot `slot` from `reader`, whose
    /// tensors lie at `at` (zeros for one it does not hold).
    fn read_range(
        &self,
        reader: &mut dyn StateReader,
        at: &[Option<usize>],
        slot: usize,
        range: Range<usize>,
    ) -> std::result::Result<Vec<f32>, String> {
        if at
            .iter()
            .enumerate()
            .all(|(j, a)| *a == Some(self.offsets[j]))
        {
            return reader.read(slot, range);
        }
        let mut out = Vec::with_capacity(range.len());
        for (j, saved) in at.iter().enumerate() {
            let (start, end) = (self.offsets[j], self.offsets[j + 1]);
            let (from, to) = (range.start.max(start), range.end.min(end));
            if from >= to {
                continue;
            }
            match saved {
                Some(s) => out.extend(reader.read(slot, s + from - start..s + to - start)?),
                None => out.resize(out.len() + (to - from), 0.0),
            }
        }
        Ok(out)
    }

    fn mismatch(
        &self,
        tensors: &[(String, usize)],
        slots: &[String],
        names: &[&str],
    ) -> Option<String> {
        let want = &self.tensors;
        if self.new_at_zero && tensors != want.as_slice() {
            if let Some((a, n)) = tensors.iter().find(|t| !want.contains(t)) {
                return Some(format!(
                    "the saved state's tensor {a} ({n} values) is not one this model trains"
                ));
            }
        } else if tensors.len() != want.len() {
            return Some(format!(
                "the saved state has {} tensors, this model trains {}",
                tensors.len(),
                want.len()
            ));
        } else if let Some(((a, n), (b, m))) = tensors.iter().zip(want).find(|(x, y)| x != y) {
            return Some(format!(
                "the saved state's tensor {a} ({n} values) is {b} ({m} values) here"
            ));
        }
        if !slots.is_empty() && slots != names {
            return Some(format!(
                "the saved state holds {slots:?}, this optimizer keeps {names:?} (was it \
                 written with another optimizer or momentum?)"
            ));
        }
        None
    }
}

const SCATTER: &str = "sharded optimizer state";
const RESHARD: &str = "re-sharding the optimizer state";

fn state_mismatch(op: &str, reason: String) -> DistError {
    DistError::Mismatch {
        op: op.into(),
        reason,
    }
}
